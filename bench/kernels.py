"""Kernel benchmark: column scores, top-k selection, selective AdamW, single and multi-tensor.

    python -m bench.kernels [--out DIR] [--quick]

On a GPU every kernel is timed with ``triton.testing.do_bench`` (median of its repeats) against the
torch baselines and against a device-to-device copy moving the same number of bytes, measured in the
same run:

* column scores:  ours vs ``(g.float()**2).sum(0)``;
* selection:      ``multi_column_scores`` + ``multi_topk_columns`` over a 32-layer model's matrices vs a
                  Python loop of ``(g.float()**2).sum(0)`` + ``torch.topk`` + sort per matrix;
* selective AdamW (topk_ratio 0.1): ours vs DeepSpeed's path (gather ``p[:, idx]`` and ``g[:, idx]``,
                  ``torch.optim.AdamW`` on the compact copy -- foreach, DeepSpeed's default -- and
                  ``p[:, idx] = ...`` scatter back); the fused torch AdamW is reported too.

Bytes (counted once, useful bytes only; GB/s = bytes / time / 1e9):
* scores:  R*C*elt(grad) + 4*C
* AdamW:   R*k*(2*elt(param) + elt(grad) + 16 [m, v read+write] + 8 [master read+write, if any]) + 8*k
* copy:    a copy of N bytes moves 2N (read + write); the reference copy moves the op's byte count.
``copy_fraction`` = op GB/s / copy GB/s. Gathered columns touch whole 32-byte sectors, so the AdamW
figure is a lower bound of the traffic the memory system really serves.

On a CPU-only machine the CPU paths are timed at modest sizes (harness.interleaved): torch for scores and
selection, and for selective AdamW both the numba kernels (what ``ops`` dispatches to on CPU; the multi
form in one launch) and the torch implementation beside them. The GPU figures need a GPU and the output
says so. Results: ``kernels_<gpu|cpu>.json`` (with the machine), ``.csv``, ``.png`` under ``--out``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from bench import harness
from zenflow_kernels import ops, torch_ops
from zenflow_kernels.cpu_ops import selective_adamw as numba_ops

GOALS = {
    "column_scores": ">= 85% of copy bandwidth for >= 4096x4096",
    "selective_adamw": ">= 3x DeepSpeed's path at topk_ratio 0.1",
    "selection": "<= 3 launches for ~224 matrices, faster than the torch loop",
}
NO_GPU_NOTE = ("No CUDA device: these are CPU timings of the CPU paths (torch, and numba for selective AdamW) at "
               "modest sizes. The Triton figures "
               "(GB/s, fraction of copy bandwidth, speed-ups over DeepSpeed's path) need a GPU: run "
               "bench/gpu_suite.sh OUTDIR on one.")
RATIO = 0.1
HP = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def model_shapes(layers: int, hidden: int, inter: int) -> list[tuple[int, int]]:
    """nn.Linear weights [out, in] of a Llama-style block: q, k, v, o, gate, up, down."""
    per_layer = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)]
    return per_layer * layers


def time_ms(fns: dict[str, Callable[[], object]], device: str, quick: bool) -> dict[str, float]:
    """ms per call, median: triton.testing.do_bench on a GPU (L2 flushed before each run), harness.interleaved on a
    CPU."""
    if device == "cuda":
        import triton.testing

        rep = 40 if quick else 100  # ms of repeats per candidate
        return {name: float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
                for name, fn in fns.items()}
    timings = harness.interleaved(fns, rounds=3 if quick else 7, warmup=1)
    return {name: t.median * 1e3 for name, t in timings.items()}


def copy_fn(nbytes: int, device: str) -> Callable[[], object]:
    """A device-to-device copy that moves ``nbytes`` in total (reads nbytes/2, writes nbytes/2)."""
    half = max(nbytes // 2, 1)
    src = torch.empty(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def launches(fn) -> int | None:
    try:
        from zenflow_kernels.triton import count_launches
    except ImportError:
        return None
    with count_launches() as n:
        fn()
    return sum(n.values())


def bench_scores(timer, shapes, dtypes, device) -> list[dict]:
    rows = []
    impl_ops = ops if device == "cuda" else torch_ops  # (the CPU path of ops is the torch implementation)
    for R, C in shapes:
        for dtype in dtypes:
            g = torch.randn(R, C, device=device).to(dtype)
            nbytes = R * C * g.element_size() + 4 * C
            ms = timer({"ours": lambda g=g: impl_ops.column_scores(g),
                        "torch (g.float()**2).sum(0)": lambda g=g: (g.float() ** 2).sum(0),
                        "copy": copy_fn(nbytes, device)})
            copy_bw = gbps(nbytes, ms["copy"])
            for impl in ("ours", "torch (g.float()**2).sum(0)"):
                rows.append(dict(op="column_scores", shape=f"{R}x{C}", dtype=str(dtype).replace("torch.", ""),
                                 impl=impl if impl != "ours" else ("triton" if device == "cuda" else "torch_ops"),
                                 ms=ms[impl], bytes=nbytes, gbps=gbps(nbytes, ms[impl]), copy_gbps=copy_bw,
                                 copy_fraction=gbps(nbytes, ms[impl]) / copy_bw,
                                 speedup_vs_torch=ms["torch (g.float()**2).sum(0)"] / ms[impl]))
    return rows


def bench_selection(timer, shapes, device, label) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(r, c, device=device, generator=gen).to(torch.bfloat16) for r, c in shapes]
    ks = [max(1, int(RATIO * c)) for _, c in shapes]

    impl_ops = ops if device == "cuda" else torch_ops  # (the CPU path of ops is the torch implementation)

    def ours():
        return impl_ops.multi_topk_columns(impl_ops.multi_column_scores(grads), ks, check_data=False)

    def torch_loop():
        return [torch.topk((g.float() ** 2).sum(0), k).indices.sort().values for g, k in zip(grads, ks, strict=True)]

    n_launch = launches(ours) if device == "cuda" else None
    ms = timer({"ours": ours, "torch loop": torch_loop})
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    return [dict(op="selection", shape=label, dtype="bfloat16", impl=impl, ms=ms[key], bytes=nbytes,
                 gbps=gbps(nbytes, ms[key]), matrices=len(grads), launches=n_launch if key == "ours" else None,
                 speedup_vs_torch=ms["torch loop"] / ms[key])
            for key, impl in (("ours", "triton multi" if device == "cuda" else "torch_ops multi"),
                              ("torch loop", "torch loop"))]


def deepspeed_path(ps, gs, idxs, device: str, fused: bool = False) -> Callable[[], None]:
    """DeepSpeed's ZenFlowSelectiveAdamW without offload, one step for all the matrices: gather each one's selected
    columns, ``torch.optim.AdamW`` on the compact copies (foreach on CUDA, DeepSpeed's default; torch's default, the
    per-tensor loop, on CPU; or fused), scatter back. Its compact state has the param's dtype (no fp32 master)."""
    bufs = [p[:, i].clone().requires_grad_(True) for p, i in zip(ps, idxs, strict=True)]
    opt = torch.optim.AdamW(bufs, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=not fused and device == "cuda",
                            fused=fused or None)

    def step():
        for p, g, i, b in zip(ps, gs, idxs, bufs, strict=True):
            torch.index_select(p, 1, i, out=b.data)
            b.grad = g.index_select(1, i)
        opt.step()
        for p, i, b in zip(ps, idxs, bufs, strict=True):
            p[:, i] = b.detach()

    return step


def bench_adamw(timer, shapes, device) -> list[dict]:
    rows = []
    for R, C in shapes:
        for pdtype, master in ((torch.float32, False), (torch.bfloat16, True)):
            k = max(1, int(RATIO * C))
            gen = torch.Generator(device=device).manual_seed(1)
            p = torch.randn(R, C, device=device, generator=gen).to(pdtype)
            g = (torch.randn(R, C, device=device, generator=gen) * 1e-3).to(pdtype)
            idx = torch.sort(torch.randperm(C, device=device, generator=gen)[:k]).values
            m, v = torch.zeros(R, k, device=device), torch.zeros(R, k, device=device)
            w = p[:, idx].float() if master else None

            def ours(impl_ops, p=p, g=g, idx=idx, m=m, v=v, w=w):
                return lambda: impl_ops.selective_adamw_(p, g, idx, m, v, step=10, master=w, check_data=False, **HP)

            fns = {name: ours(impl_ops) for name, impl_ops in _ours_adamw(device).items()}
            fns["deepspeed path (foreach AdamW)"] = deepspeed_path([p], [g], [idx], device)
            if device == "cuda":
                fns["deepspeed path (fused AdamW)"] = deepspeed_path([p], [g], [idx], device, fused=True)
            nbytes = R * k * (2 * p.element_size() + g.element_size() + 16 + (8 if master else 0)) + 8 * k
            fns["copy"] = copy_fn(nbytes, device)
            ms = timer(fns)
            copy_bw = gbps(nbytes, ms["copy"])
            for impl in [name for name in fns if name != "copy"]:
                rows.append(dict(op="selective_adamw", shape=f"{R}x{C}", dtype=str(pdtype).replace("torch.", ""),
                                 master=master, k=k, impl=impl, ms=ms[impl], bytes=nbytes,
                                 gbps=gbps(nbytes, ms[impl]), copy_gbps=copy_bw,
                                 copy_fraction=gbps(nbytes, ms[impl]) / copy_bw,
                                 speedup_vs_deepspeed=ms["deepspeed path (foreach AdamW)"] / ms[impl]))
    return rows


def bench_multi_adamw(timer, shapes, device, label) -> list[dict]:
    """Whole-model fast-path step: one multi-tensor call vs DeepSpeed's per-parameter path in a loop."""
    gen = torch.Generator(device=device).manual_seed(2)
    ps = [torch.randn(r, c, device=device, generator=gen).to(torch.bfloat16) for r, c in shapes]
    gs = [(torch.randn(r, c, device=device, generator=gen) * 1e-3).to(torch.bfloat16) for r, c in shapes]
    idxs = [torch.sort(torch.randperm(c, device=device, generator=gen)[: max(1, int(RATIO * c))]).values
            for _, c in shapes]
    ms_ = [torch.zeros(r, len(i), device=device) for (r, _), i in zip(shapes, idxs, strict=True)]
    vs_ = [torch.zeros_like(m) for m in ms_]
    ws = [p[:, i].float() for p, i in zip(ps, idxs, strict=True)]

    def ours(impl_ops):
        # ops' one signature, its backend forced: the backends keep only the launches (their items_)
        backend = {numba_ops: "numba", torch_ops: "torch"}.get(impl_ops, "auto")

        def step():
            with ops.use_backend(backend):
                ops.multi_selective_adamw_(ps, gs, idxs, ms_, vs_, steps=10, lrs=1e-4, beta1=0.9, beta2=0.999,
                                           eps=1e-8, weight_decays=0.01, masters=ws, check_data=False)
        return step

    fns = {f"{name} multi": ours(impl_ops) for name, impl_ops in _ours_adamw(device).items()}
    n_launch = launches(fns["triton multi"]) if device == "cuda" else None
    ms = timer(fns | {"deepspeed path": deepspeed_path(ps, gs, idxs, device)})
    return [dict(op="multi_selective_adamw", shape=label, dtype="bfloat16", master=True,
                 impl="deepspeed path (foreach AdamW, one step for all)" if key == "deepspeed path" else key,
                 ms=ms[key], matrices=len(shapes), launches=n_launch if key == "triton multi" else None,
                 speedup_vs_deepspeed=ms["deepspeed path"] / ms[key])
            for key in ms]


def _ours_adamw(device: str) -> dict:
    """Our selective AdamW implementations on this device: the Triton kernel on CUDA; on CPU the numba
    kernel (what ``ops`` dispatches to) and the torch implementation beside it."""
    return {"triton": ops} if device == "cuda" else {"numba": numba_ops, "torch_ops": torch_ops}


ROLE_COLORS = {"ours": "C0", "baseline": "C1", "ours (torch reference)": "C2", "baseline (fused AdamW)": "C3"}


def _role(row: dict) -> str:
    impl = row["impl"]
    if impl.startswith(("triton", "numba")):
        return "ours"
    if impl.startswith("torch_ops"):  # the CPU path of scores and selection; beside numba for AdamW
        return "ours" if row["op"] in ("column_scores", "selection") else "ours (torch reference)"
    return "baseline (fused AdamW)" if "fused" in impl else "baseline"


def plot(rows: list[dict], path, title: str) -> None:
    """ms per call, ours vs baselines; ours annotated with the fraction of copy bandwidth or the speed-up."""
    fig, axes = harness.figure(3, size=(17, 5))
    panels = [(("column_scores",), "column scores (annotation: fraction of copy bandwidth)"),
              (("selective_adamw",), "selective AdamW, k = 0.1 C (annotation: speed-up vs DeepSpeed path)"),
              (("selection", "multi_selective_adamw"), "whole model: selection / AdamW step (speed-up)")]
    for ax, (names, title_) in zip(axes, panels, strict=True):
        sel = [r for r in rows if r["op"] in names]
        labels = list(dict.fromkeys((r["op"], r["shape"], r["dtype"]) for r in sel))
        roles = list(dict.fromkeys(_role(r) for r in sel))
        width = 0.8 / max(len(roles), 1)
        for j, role in enumerate(roles):
            xs, ys, notes = [], [], []
            for i, lab in enumerate(labels):
                r = next((r for r in sel if (r["op"], r["shape"], r["dtype"]) == lab and _role(r) == role), None)
                if r is None:
                    continue
                xs.append(i + j * width)
                ys.append(r["ms"])
                if role == "ours":
                    frac, sp = r.get("copy_fraction"), r.get("speedup_vs_deepspeed") or r.get("speedup_vs_torch")
                    notes.append(f"{frac:.0%}" if "column_scores" in names and frac else f"{sp:.1f}x" if sp else "")
            bars = ax.bar(xs, ys, width, label=role, color=ROLE_COLORS.get(role))
            if role == "ours":
                ax.bar_label(bars, notes, fontsize=7)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels([f"{o}\n{s}" if o in ("selection", "multi_selective_adamw") else f"{s}\n{d}"
                            for o, s, d in labels], fontsize=7)
        harness.style(ax, None, "ms per call (median, lower is better)", title_, logy=10, grid=None)
        ax.title.set_fontsize(9)
    fig.suptitle(title, fontsize=10)
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = harness.OneLineParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, layers and repeats")
    args = ap.parse_args(argv)
    out = harness.output_dir(args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timer = functools.partial(time_ms, device=device, quick=args.quick)
    torch.manual_seed(0)
    tag = "gpu" if device == "cuda" else "cpu"
    if device == "cuda":
        shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (8192, 8192), (4096, 11008)]
        layers, adam_layers = (4, 4) if args.quick else (32, 8)
        model = model_shapes(layers, 4096, 11008)
    else:
        print(f"NOTE: {NO_GPU_NOTE}", flush=True)
        shapes = [(512, 512)] if args.quick else [(1024, 1024), (2048, 2048), (1024, 2752)]
        layers = adam_layers = 1 if args.quick else 4
        model = model_shapes(layers, 256, 688)  # a 4-layer model at 1/16 of Llama-7B's width
    note = "GPU timings: triton.testing.do_bench medians" if device == "cuda" else NO_GPU_NOTE
    payload = dict(device=device, note=note, quick=args.quick, topk_ratio=RATIO, goals=GOALS,
                   bytes_formulas={"column_scores": "R*C*elt(grad) + 4*C",
                                   "selective_adamw": "R*k*(2*elt(param) + elt(grad) + 16 + 8*[master]) + 8*k",
                                   "copy": "the copy moves the op's byte count: reads bytes/2, writes bytes/2",
                                   "gbps": "bytes / seconds / 1e9; copy_fraction = op gbps / copy gbps"},
                   gpu_figures_need_a_gpu=device != "cuda", complete=False, rows=[])
    adam_model = model[: 7 * adam_layers]
    sections = [lambda: bench_scores(timer, shapes, [torch.float32, torch.bfloat16], device),
                lambda: bench_selection(timer, model, device, f"{layers} layers, {len(model)} matrices"),
                lambda: bench_adamw(timer, shapes, device),
                lambda: bench_multi_adamw(timer, adam_model, device,
                                          f"{adam_layers} layers, {len(adam_model)} matrices")]
    for section in sections:
        new = section()
        for r in new:
            extra = " ".join(f"{k}={r[k]:.3g}" for k in ("gbps", "copy_fraction", "speedup_vs_torch",
                                                          "speedup_vs_deepspeed") if r.get(k) is not None)
            launch_s = f" launches={r['launches']}" if r.get("launches") is not None else ""
            print(f"{r['op']:22s} {r['shape']:24s} {r['dtype']:9s} {r['impl']:34s} {r['ms']:9.3f} ms "
                  f"{extra}{launch_s}", flush=True)
        payload["rows"] += new
        # written after every section: a run cut short still leaves its data
        harness.write_result(out / f"kernels_{tag}.json", payload)
        harness.write_csv(out / f"kernels_{tag}.csv", payload["rows"])
        if device == "cuda":
            torch.cuda.empty_cache()
    payload["complete"] = True
    harness.write_result(out / f"kernels_{tag}.json", payload)
    try:
        plot(payload["rows"], out / f"kernels_{tag}.png",
             f"zenflow_kernels ops on {device} ({'quick' if args.quick else 'full'}); " + (
                 "Triton vs torch/DeepSpeed baselines" if device == "cuda"
                 else "CPU paths (torch; numba for selective AdamW): GPU figures need a GPU"))
    except ImportError as exc:  # matplotlib missing: the data files are the result
        print(f"no plot ({exc})")
    print(f"wrote {out / f'kernels_{tag}.json'}, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
