"""bench.overlap on real PCIe: a >= 1 B-parameter bf16 model on one GPU (``bench/gpu_suite.sh`` runs it).

    python -m bench.overlap_gpu [--out DIR] [--blocks 8] [--width 4096] [--tokens 8192] [--steps 8]
    python -m bench.overlap_gpu --device cpu --quick        # the same code on CPU, tiny (the test suite)

The model: ``blocks`` MLP blocks ``Linear(w, 4w) -> GELU -> Linear(4w, w)`` (8 w^2 parameters each: 8 blocks of
width 4096 are 1.07 B), bf16, a batch of ``tokens`` rows. Runs, each on its own copy, one after the other, every
step ended by a device sync: ``adamw`` (``torch.optim.AdamW(fused=True)`` on the device: the speed to reach),
``offload`` (synchronous offload through ``ZenFlowAdamW``), ``zenflow`` (``topk_ratio=0.1``, ``update_interval=4``,
overlapped: gradients cross from backward's hooks into the host's landing area, docs/design.md section 5.1) and
``zenflow_at_step`` (hand-over from hooks off, ``orderings.changed(early_handover=False)`` around the run: every
gradient crosses at ``step()``, after backward).

Per run: ms/step (median), ``step()`` ms, the host's time folding each step's landed gradients into the sums
(``fold_ms_per_step``), and for the ZenFlow runs the D2H time left after backward: from a CUDA event on the compute
stream when backward returned to one on the link's D2H stream after the step's copies (0 when the copies were done
first), over the transfer time of the step's gradient bytes at the pinned bandwidth measured in the same run.
Hidden = 1 - left / transfer. With ``--device cpu`` wall clocks replace the events (only to keep the path
exercised). Writes ``overlap_gpu.json``.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from bench.e2e_core import OFFLOAD
from bench.harness import OneLineParser, int_at_least, machine_info, output_dir, time_call, write_result

ZENFLOW = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, full_warm_up_rounds=0, select_strategy="step",
               select_interval=10**6)
RUNS = ("adamw", "offload", "zenflow", "zenflow_at_step")


def build(blocks: int, width: int, device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


class Clock:
    """Marks on the device's timeline: CUDA events on a stream, or wall clocks on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def after_copies(self, engine):
        """A mark behind every D2H copy the link's engine issued so far: recorded on its D2H stream through the
        engine's ``behind_d2h`` (the work it runs finds that stream current); on the current stream without one."""
        if engine is None:
            return self.mark()
        marks = []
        engine.behind_d2h(lambda: marks.append(self.mark()))
        return marks[0]

    def seconds(self, a, b) -> float:
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def sync(self, device):
        if self.cuda:
            torch.cuda.synchronize(device)


def pinned_bandwidth(nbytes: int, device) -> float:
    """Bytes per second of one device -> pinned host copy of ``nbytes`` (median of 3); on CPU a host memcpy into
    pageable memory (pinning needs CUDA), so the CPU tests run these lines."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return nbytes / time_call(lambda: dst.copy_(src, non_blocking=True), warmup=1, repeats=3).median


def run(name: str, base, x, y, steps: int, warmup: int, device) -> dict:
    """One run, start to end (its optimizer's first ``step()`` reads the ablation switch: hand-over from backward's
    hooks, off for ``zenflow_at_step``)."""
    from zenflow_kernels import ZenFlowAdamW
    from zenflow_kernels.orderings import orderings

    with orderings.changed(early_handover=name != "zenflow_at_step"):
        model = copy.deepcopy(base)
        if name == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        else:
            opt = ZenFlowAdamW(model.parameters(), lr=1e-4, zenflow=OFFLOAD if name == "offload" else ZENFLOW)
        clock = Clock(device)
        rows = []
        for t in range(warmup + steps):
            clock.sync(device)
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            backward_end = clock.mark()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            left = None
            if name.startswith("zenflow") and opt.built:
                if clock.cuda:
                    copies_end = clock.after_copies(getattr(opt.link, "engine", None))
                else:
                    opt.link.synchronize()
                    copies_end = clock.mark()
                left = max(0.0, clock.seconds(backward_end, copies_end))
            clock.sync(device)
            t2 = time.perf_counter()
            if t >= warmup:
                rows.append(dict(wall=t2 - t0, step=t2 - t1, d2h_left=left))
        out = dict(run=name, ms_per_step=1e3 * statistics.median(r["wall"] for r in rows),
                   step_ms=1e3 * statistics.median(r["step"] for r in rows), loss=float(loss))
        if name != "adamw":
            stats = opt.stats()
            out.update(stall_fraction=stats["stall_fraction"], handover=stats["handover"],
                       d2h_bytes_per_step=stats["d2h_bytes_per_step"],
                       share_handed_in_backward=stats["d2h_bytes_in_backward"] / max(1, stats["d2h_bytes"]),
                       # the host's fold of each step's landed gradients into the sums (beside the next forward)
                       fold_ms_per_step=1e3 * stats["fold_s"] / max(1, stats["steps"]))
            if name.startswith("zenflow"):
                out["d2h_left_ms"] = 1e3 * statistics.median(r["d2h_left"] for r in rows)
            opt.close()
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.overlap_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    ap.add_argument("--blocks", type=int_at_least(1), default=None, help="MLP blocks (default 8)")
    ap.add_argument("--width", type=int_at_least(8), default=None, help="block width (default 4096)")
    ap.add_argument("--tokens", type=int_at_least(1), default=None, help="rows per batch (default 8192)")
    ap.add_argument("--steps", type=int_at_least(2), default=None, help="timed steps per run (default 8)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: bench.overlap_gpu needs a CUDA GPU; --device cpu --quick runs the code path on CPU")
        return 2
    blocks = args.blocks or (2 if args.quick else 8)
    width = args.width or (32 if args.quick else 4096)
    tokens = args.tokens or (64 if args.quick else 8192)
    steps, warmup = args.steps or (3 if args.quick else 8), 2 if args.quick else 3
    base = build(blocks, width, device)
    params = sum(p.numel() for p in base.parameters())
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, width, generator=g).to(device=device, dtype=torch.bfloat16)
    y = torch.randn(tokens, width, generator=g).to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.dim() == 2)
    bandwidth = pinned_bandwidth(grad_bytes, device)
    transfer_s = grad_bytes / bandwidth
    results = [run(name, base, x, y, steps, warmup, device) for name in RUNS]
    by = {r["run"]: r for r in results}
    for r in results:
        r["vs_adamw"] = r["ms_per_step"] / by["adamw"]["ms_per_step"]
        if "d2h_left_ms" in r and transfer_s > 0:
            r["hidden_share"] = 1 - min(1.0, r["d2h_left_ms"] / 1e3 / transfer_s)
    payload = dict(config=dict(device=str(device), blocks=blocks, width=width, tokens=tokens, params=params,
                               dtype="bfloat16", steps=steps, warmup=warmup, zenflow=ZENFLOW,
                               matrix_grad_bytes=grad_bytes, pinned_bytes_per_s=bandwidth,
                               transfer_ms=1e3 * transfer_s, quick=args.quick),
                   runs=results, machine=machine_info())
    if device.type == "cuda":
        payload["machine"]["gpu"] = torch.cuda.get_device_name(device)
    path = write_result(output_dir(args.out) / "overlap_gpu.json", payload)
    print(f"{params / 1e9:.2f} B parameters (bf16), gradient {grad_bytes / 1e9:.2f} GB, pinned D2H "
          f"{bandwidth / 1e9:.1f} GB/s: transfer {1e3 * transfer_s:.1f} ms")
    print(f"{'run':<16} {'ms/step':>9} {'x adamw':>8} {'step() ms':>10} {'d2h left ms':>12} {'hidden':>7}")
    for r in results:
        left = f"{r['d2h_left_ms']:.1f}" if "d2h_left_ms" in r else "-"
        hidden = f"{r['hidden_share']:.2f}" if "hidden_share" in r else "-"
        print(f"{r['run']:<16} {r['ms_per_step']:>9.1f} {r['vs_adamw']:>8.2f} {r['step_ms']:>10.1f} {left:>12} "
              f"{hidden:>7}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
