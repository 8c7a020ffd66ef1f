"""The optimizer's two multi-tensor host passes against torch's foreach ops, on CPU.

    python -m bench.host_multi [--out DIR] [--quick] [--rounds N]

What ``step()`` does over every gradient of a CPU model (or of the staged gradients, in the accumulate
worker), for transformer-shaped tensor lists (per block: four [h, h] and three [4h, h]-sized matrices and
two [h] vectors) in bf16 and fp32, at a few model sizes and tensor counts:

* gradient norm: ``cpu_ops.multi_sum_squares`` (one numba launch per dtype, float64 sums in fixed chunks)
  against what the optimizer did before, ``torch._foreach_norm(grads, 2, dtype=float32)`` then
  ``stack().double().pow(2).sum()``;
* accumulation: ``cpu_ops.multi_accumulate_`` (fp32 acc += grad, bf16 widened in the same pass) against
  ``torch._foreach_add_(accs, grads)`` (mixed dtypes: a slow path per tensor).

Both pairs compute the same thing (the accumulation bit for bit; the norm to float64 rounding, checked
here). Each candidate is timed with ``harness.interleaved`` (round by round with its rival: this machine
drifts), median wall time, the calling thread's default thread counts (2 cores). Results:
``host_multi_cpu.json`` (with the machine) and ``host_multi_cpu.png`` in ``bench/results``.
"""

from __future__ import annotations

import time

from bench import harness

# (hidden size, blocks): from many small tensors (the per-tensor overhead) to a few large ones (bandwidth)
SIZES = [(64, 8), (256, 8), (512, 12), (1024, 6)]
QUICK_SIZES = [(32, 2), (64, 2)]


def _tensors(hidden: int, blocks: int, dtype, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = ([(hidden, hidden)] * 4 + [(4 * hidden, hidden)] * 2 + [(hidden, 4 * hidden)]
              + [(hidden,)] * 2) * blocks
    return [(torch.randn(s, generator=g) * 1e-2).to(dtype) for s in shapes]


def _candidates(grads, accs, flat) -> tuple[dict, dict]:
    """(gradient norm, accumulation) candidates over these tensors: the public op (checks every tensor), the
    unchecked form the optimizer calls (it checked the gradients once in step()), torch's foreach."""
    import torch

    from zenflow_kernels.cpu_ops import multi_accumulate_, multi_sum_squares
    from zenflow_kernels.cpu_ops.accumulate import accumulate_unchecked, sum_squares_unchecked

    def torch_norm():
        return float(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double().pow(2).sum())

    norm = {"ours": lambda: multi_sum_squares(grads), "ours_unchecked": lambda: sum_squares_unchecked(grads),
            "torch": torch_norm}
    acc = {"ours": lambda: multi_accumulate_(accs, flat), "ours_unchecked": lambda: accumulate_unchecked(accs, flat),
           "torch": lambda: torch._foreach_add_(accs, flat)}
    return norm, acc


def measure(sizes, rounds: int) -> list[dict]:
    import torch

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for hidden, blocks in sizes:
            grads = _tensors(hidden, blocks, dtype)
            flat = [g.view(-1) for g in grads]
            accs = [torch.zeros(g.numel()) for g in grads]
            numel = sum(g.numel() for g in grads)
            norm, acc = _candidates(grads, accs, flat)
            exact = sum(float((g.double() ** 2).sum()) for g in grads)
            errors = {name: abs(fn() - exact) / exact for name, fn in norm.items()}
            calls = max(1, (1 << 22) // numel)
            for op, fns, bytes_per in (("grad_norm", norm, dtype.itemsize), ("accumulate", acc, dtype.itemsize + 8)):
                timing = harness.interleaved(fns, rounds=rounds, warmup=2, calls_per_round=calls)
                row = dict(op=op, dtype=str(dtype).replace("torch.", ""), hidden=hidden, blocks=blocks,
                           tensors=len(grads), elements=numel, calls_per_round=calls)
                for name in fns:
                    row[f"{name}_ms"] = timing[name].median * 1e3
                row.update(speedup=timing["torch"].median / timing["ours"].median,
                           speedup_unchecked=timing["torch"].median / timing["ours_unchecked"].median,
                           ours_gbps=numel * bytes_per / timing["ours_unchecked"].median / 1e9)
                if op == "grad_norm":
                    row.update({f"{name}_rel_error": e for name, e in errors.items()})
                rows.append(row)
    return rows


def plot(rows: list[dict], path) -> None:
    fig, axes = harness.figure(2)
    for ax, op in zip(axes, ("grad_norm", "accumulate"), strict=True):
        for dtype, marker in (("bfloat16", "o"), ("float32", "s")):
            chosen = [r for r in rows if r["op"] == op and r["dtype"] == dtype]
            ax.plot([r["elements"] for r in chosen], [r["speedup"] for r in chosen], marker=marker,
                    label=f"{dtype}, public op")
            ax.plot([r["elements"] for r in chosen], [r["speedup_unchecked"] for r in chosen], marker=marker,
                    ls="--", label=f"{dtype}, unchecked (the optimizer's)")
        ax.axhline(1.0, color="grey", lw=0.8)
        harness.style(ax, "elements (all tensors)", "torch foreach time / ours",
                      {"grad_norm": "gradient norm", "accumulate": "fp32 acc += grad"}[op], logx=10, grid=None)
    fig.suptitle("multi-tensor host passes vs torch foreach (CPU, median of interleaved rounds)")
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = harness.OneLineParser(prog="python -m bench.host_multi", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="two small sizes, few rounds (the test suite's run)")
    ap.add_argument("--rounds", type=harness.int_at_least(3), default=None, help="interleaved rounds (default 15)")
    args = ap.parse_args(argv)
    out_dir = harness.output_dir(args.out)
    sizes = QUICK_SIZES if args.quick else SIZES
    rounds = args.rounds or (3 if args.quick else 15)
    started = time.perf_counter()
    rows = measure(sizes, rounds)
    payload = dict(config=dict(sizes=sizes, rounds=rounds, quick=args.quick, clock="time.perf_counter (wall)"),
                   rows=rows, total_s=time.perf_counter() - started, machine=harness.machine_info())
    path = harness.write_result(out_dir / "host_multi_cpu.json", payload)
    plot(rows, out_dir / "host_multi_cpu.png")
    print(f"{'op':<11}{'dtype':<10}{'tensors':>8}{'elements':>11}{'ours ms':>10}{'unchecked':>10}{'torch ms':>10}"
          f"{'speed-up':>10}{'unchecked':>10}")
    for r in rows:
        print(f"{r['op']:<11}{r['dtype']:<10}{r['tensors']:>8}{r['elements']:>11}{r['ours_ms']:>10.3f}"
              f"{r['ours_unchecked_ms']:>10.3f}{r['torch_ms']:>10.3f}{r['speedup']:>10.2f}{r['speedup_unchecked']:>10.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
