"""What checking a handed-over gradient costs: the fingerprint against the passes it sits beside.

    python -m bench.fingerprint [--out DIR] [--quick] [--device cpu|cuda] [--rounds N]

The asynchronous link fingerprints each gradient as its backward hook copies it to the host, and again at ``step()``
(docs/design.md section 5.1): two reads of the gradients, on the device, whose cost is a share of what the gradients
cost anyway. So each size and dtype times, on one tensor, interleaved round by round (``harness.interleaved``: this
machine drifts):

* ``fingerprint``: ``ops.multi_fingerprint`` (numba on CPU, Triton on CUDA);
* ``read``: a plain read of the same bytes, the memory roofline of a read (``cpu_ops.multi_sum_squares`` on CPU;
  ``torch.sum`` in fp32 on CUDA);
* ``copy``: the copy to the host the link makes anyway (on CPU a memcpy into another buffer, standing in for it; on
  CUDA a non-blocking copy into pinned host memory, the real D2H);
* ``fold``: on CPU, the host's pass adding the landed gradient into the fp32 sums once ``step()`` checked it
  (``accumulate_unchecked``: the landing area's host cost).

Per row: seconds, GB/s of the tensor's bytes, ``fingerprint / read`` and ``fingerprint / copy``; two fingerprints a
step against one copy, ``2 * fingerprint / copy``, is the check's cost relative to the crossing it protects. On a CPU
the "device" is the host: these figures say what the stand-in costs, not what a GPU pays (the CUDA rows come from
``bench/gpu_suite.sh`` on a lent device). Results: ``fingerprint_<device>.json`` (with the machine) and ``.png``.
"""

from __future__ import annotations

import time

from bench import harness

SIZES = [1 << 20, 1 << 22, 1 << 24, 1 << 26]
QUICK_SIZES = [1 << 16, 1 << 18]
DTYPES = ("float32", "bfloat16")
KEY = 0x9E3779B97F4A7C15


def measure(n: int, dtype_name: str, device: str, rounds: int) -> dict:
    import torch

    from zenflow_kernels import ops
    from zenflow_kernels.cpu_ops.accumulate import accumulate_unchecked, sum_squares_unchecked

    dtype = getattr(torch, dtype_name)
    x = torch.randn(n, device=device).to(dtype)
    nbytes = n * x.element_size()
    out = torch.zeros(1, dtype=torch.int64, device=device)
    candidates = {"fingerprint": lambda: ops.multi_fingerprint([x], KEY, out=out)}
    if device == "cpu":
        dst, acc = torch.empty_like(x), torch.zeros(n)
        candidates.update(read=lambda: sum_squares_unchecked([x]), copy=lambda: dst.copy_(x),
                          fold=lambda: accumulate_unchecked([acc], [x]))
    else:
        host = torch.empty(n, dtype=dtype).pin_memory()
        candidates.update(read=lambda: x.sum(dtype=torch.float32), copy=lambda: host.copy_(x, non_blocking=True))
    calls = max(1, (1 << 24) // n)
    timings = harness.interleaved(candidates, rounds=rounds, warmup=2, calls_per_round=calls)
    row = dict(n=n, dtype=dtype_name, device=device, bytes=nbytes, calls_per_round=calls)
    for name, t in timings.items():
        row[f"{name}_s"] = t.median
        row[f"{name}_iqr_s"] = t.iqr
        row[f"{name}_gbps"] = nbytes / t.median / 1e9
    row["fingerprint_over_read"] = row["fingerprint_s"] / row["read_s"]
    row["fingerprint_over_copy"] = row["fingerprint_s"] / row["copy_s"]
    row["check_over_crossing"] = 2 * row["fingerprint_s"] / row["copy_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = harness.OneLineParser(prog="python -m bench.fingerprint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="two small sizes, few rounds (the test suite's run)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live (default cpu)")
    ap.add_argument("--rounds", type=harness.int_at_least(2), default=None, help="interleaved rounds (default 15)")
    args = ap.parse_args(argv)
    import torch

    from zenflow_kernels.ops import use_backend

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    out_dir = harness.output_dir(args.out)
    sizes = QUICK_SIZES if args.quick else SIZES
    rounds = args.rounds or (3 if args.quick else 15)
    started = time.perf_counter()
    rows = []
    with use_backend("numba" if args.device == "cpu" else "triton"):
        for dtype in DTYPES:
            for n in sizes:
                rows.append(measure(n, dtype, args.device, rounds))
                r = rows[-1]
                print(f"{dtype:>9} n=2^{n.bit_length() - 1:<2} fingerprint {r['fingerprint_gbps']:6.2f} GB/s  read "
                      f"{r['read_gbps']:6.2f}  copy {r['copy_gbps']:6.2f}  fingerprint/read "
                      f"{r['fingerprint_over_read']:.2f}  2 x fingerprint/copy {r['check_over_crossing']:.2f}")
    payload = dict(config=dict(sizes=sizes, dtypes=list(DTYPES), device=args.device, rounds=rounds,
                               quick=args.quick), rows=rows, total_s=time.perf_counter() - started,
                   machine=harness.machine_info())
    name = f"fingerprint_{args.device}"
    path = harness.write_result(out_dir / f"{name}.json", payload)
    plot(payload, out_dir / f"{name}.png")
    print(f"wrote {path}")
    return 0


def plot(payload: dict, path) -> None:
    fig, axes = harness.figure(2, size=(12, 4.5))
    rows = payload["rows"]
    names = [k[: -len("_gbps")] for k in rows[0] if k.endswith("_gbps")]
    for dtype, style in zip(payload["config"]["dtypes"], ("-", "--"), strict=False):
        sel = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: r["n"])
        for name in names:
            axes[0].plot([r["n"] for r in sel], [r[f"{name}_gbps"] for r in sel], style, marker="o",
                         label=f"{name}, {dtype}")
        for key, marker in (("fingerprint_over_read", "o"), ("check_over_crossing", "s")):
            axes[1].plot([r["n"] for r in sel], [r[key] for r in sel], style, marker=marker, label=f"{key}, {dtype}")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    for ax, ylabel in zip(axes, ("GB/s of the tensor's bytes", "ratio"), strict=True):
        harness.style(ax, "elements", ylabel, logx=2, grid=None)
    fig.suptitle(f"bench.fingerprint on {payload['config']['device']}: the check of a handed-over gradient "
                 "against the passes beside it")
    harness.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
