"""What stochastic rounding of bf16 host state costs the host Adam pass: fp32 moments, bf16 rounded to nearest, bf16
rounded stochastically, side by side.

    python -m bench.stochastic_rounding [--out DIR] [--sizes 2^22 2^24] [--rounds N] [--quick]

Each candidate is ``cpu_adam_`` as the optimizer's host update calls it: the gradient sums from the fp32 accumulation
buffer, zeroed in the same pass, the updated parameter written as a bf16 copy (``out=``); the moments fp32 (``fp32``,
32 bytes a parameter moved plus the copy-out) or bf16 (16 bytes less) stored rounded to nearest even
(``bf16_nearest``) or stochastically (``bf16_stochastic``: one 32-bit hash per element, ``zenflow_kernels.rounding``).
The candidates run interleaved, one timed call each per round after a warm-up, at each size and thread count; the
rows give the median seconds per call, the parameters per second, and the ratio to ``bf16_nearest`` measured in
the same rounds (these VMs are noisy: only those ratios are comparable). Results: ``stochastic_rounding.json`` in
bench/results (or ``--out``).
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.cpu_adam import parse_size
from bench.harness import OneLineParser, output_dir, write_result

CANDIDATES = ("fp32", "bf16_nearest", "bf16_stochastic")
ADAM = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def tensors(n: int, candidate: str) -> dict:
    gen = torch.Generator().manual_seed(n)
    dtype = torch.float32 if candidate == "fp32" else torch.bfloat16
    return dict(p=torch.randn(n, generator=gen), acc=torch.randn(n, generator=gen),
                m=(torch.randn(n, generator=gen) * 1e-3).to(dtype), v=(torch.rand(n, generator=gen) * 1e-6).to(dtype),
                out=torch.empty(n, dtype=torch.bfloat16))


def call(t: dict, candidate: str, step: int, threads: int) -> float:
    from zenflow_kernels.cpu_ops import cpu_adam_
    from zenflow_kernels.rounding import StochasticRounding

    rounding = StochasticRounding(seed=0, step=step, key=0) if candidate == "bf16_stochastic" else None
    t0 = time.perf_counter()
    cpu_adam_(t["p"], t["acc"], t["m"], t["v"], step=step, grad_scale=4.0, out=t["out"], zero_grad=True,
              num_threads=threads, rounding=rounding, **ADAM)
    return time.perf_counter() - t0


def measure(n: int, threads: int, rounds: int) -> list[dict]:
    data = {c: tensors(n, c) for c in CANDIDATES}
    seconds: dict[str, list[float]] = {c: [] for c in CANDIDATES}
    for step in range(1, rounds + 3):
        for c in CANDIDATES:
            s = call(data[c], c, step, threads)
            if step > 2:  # (the first calls compile or load the kernels and warm the pages)
                seconds[c].append(s)
    base = statistics.median(seconds["bf16_nearest"])
    ratios = {c: statistics.median(a / b for a, b in zip(seconds[c], seconds["bf16_nearest"], strict=True))
              for c in CANDIDATES}
    return [dict(candidate=c, size=n, threads=threads, rounds=rounds, median_s=statistics.median(seconds[c]),
                 params_per_s=n / statistics.median(seconds[c]), vs_bf16_nearest=ratios[c],
                 vs_bf16_nearest_of_medians=statistics.median(seconds[c]) / base) for c in CANDIDATES]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.stochastic_rounding", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--sizes", type=parse_size, nargs="+", default=None, help="elements (default 2^22 2^24)")
    ap.add_argument("--rounds", type=parse_size, default=None, help="timed calls per candidate (default 30)")
    ap.add_argument("--quick", action="store_true", help="one small size, a few rounds: the structure only")
    args = ap.parse_args(argv)
    import numba

    sizes = args.sizes or ([1 << 16] if args.quick else [1 << 22, 1 << 24])
    rounds = args.rounds or (3 if args.quick else 30)
    started = time.perf_counter()
    rows = []
    for n in sizes:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            rows += measure(n, threads, rounds)
            for r in rows[-len(CANDIDATES):]:
                print(f"2^{n.bit_length() - 1} {threads} thread(s) {r['candidate']:16s} {r['median_s'] * 1e3:8.2f} ms "
                      f"{r['vs_bf16_nearest']:.2f}x bf16_nearest", flush=True)
    payload = dict(benchmark="stochastic_rounding", description=__doc__.split("\n\n")[1], adam=ADAM, rows=rows,
                   total_s=time.perf_counter() - started)
    path = write_result(output_dir(args.out) / "stochastic_rounding.json", payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
