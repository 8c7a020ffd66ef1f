"""The NVMe tier's storage layer against this disk's roofline (issue 25, first step: the optimizer does not use
it yet; docs/design.md section 9 describes the in-memory host).

    python -m bench.nvme [--out DIR] [--quick] [--sizes 16 64 256] [--dir PATH] [--repeats 2]

For each size (millions of parameters; the state file holds 12 bytes per parameter: fp32 master and both
moments) and each way of opening the file (``buffered``: the page cache between the process and the disk;
``direct``: ``O_DIRECT``), two passes over the same bytes with the same block size and the same system calls:

* ``roofline``: a plain sequential pass, read a block then write it back, one thread, nothing computed;
* ``streamed``: ``streamed_adam_``, the host update's AdamW over the file (read ahead, the numba kernel,
  write behind; the in-memory host's bits, tests/test_state_files.py).

Reported per pass: seconds, GB/s of disk traffic (read + write), the streamed pass over the roofline (goal
of issue 25: >= 0.7), and how much the page cache (``/proc/meminfo`` Cached) grew during the pass. Before
each pass the file's pages are written out and dropped from the cache (``fdatasync`` +
``POSIX_FADV_DONTNEED``), so a buffered read comes from the disk. Results: ``nvme_cpu.json`` and
``nvme_cpu.png`` in ``bench/results``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench.harness import (
    OneLineParser,
    int_at_least,
    machine_info_light,
    meminfo_bytes,
    output_dir,
    plt,
    write_json_light,
)

SIZES_M = [16, 64, 256]
QUICK_SIZES_M = [1]
BLOCK_NUMEL = 1 << 20
MODES = ("buffered", "direct")
GOAL = 0.7


def drop_from_cache(files) -> None:
    os.fdatasync(files._fd)
    os.posix_fadvise(files._fd, 0, 0, os.POSIX_FADV_DONTNEED)


def plain_pass(files) -> None:
    bufs = files.new_block()
    for j in range(files.blocks):
        files.read_block(j, bufs)
        files.write_block(j, bufs)


def measure(size_m: int, mode: str, where: str, repeats: int) -> dict:
    import torch

    from zenflow_kernels.state_files import StateFileError, StateFiles
    from zenflow_kernels.streamed_adam import Run, streamed_adam_

    numel = size_m * (1 << 20)
    try:
        files = StateFiles(where, numel, block_numel=min(BLOCK_NUMEL, numel), direct=mode == "direct")
    except (StateFileError, ValueError) as exc:
        return dict(size_m=size_m, mode=mode, skipped=str(exc))
    try:
        acc = torch.ones(numel)
        run = Run(0, numel, None, dict(step=1, grad_scale=1.0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                       weight_decay=0.01))
        plain_pass(files)  # every block written once (allocated space reads as zeros but may be unwritten)
        small = Run(0, min(numel, 1024), None, run.adam)
        streamed_adam_(files, acc, [small])  # the numba kernel compiled (or loaded) before anything is timed
        out = dict(size_m=size_m, mode=mode, file_bytes=files.nbytes, traffic_bytes=2 * files.nbytes)
        for name, fn in (("roofline", lambda: plain_pass(files)),
                         ("streamed", lambda: streamed_adam_(files, acc, [run]))):
            seconds, grew = [], []
            for _ in range(repeats):
                drop_from_cache(files)
                before = meminfo_bytes("Cached")
                t0 = time.perf_counter()
                fn()
                if mode == "buffered":
                    os.fdatasync(files._fd)  # the written bytes reached the disk: part of the pass
                seconds.append(time.perf_counter() - t0)
                after = meminfo_bytes("Cached")
                grew.append(None if before is None else after - before)
            best = min(seconds)
            out[name] = dict(seconds=seconds, best_s=best, gb_per_s=2 * files.nbytes / best / 1e9,
                             cache_growth_bytes=grew)
        out["streamed_over_roofline"] = out["roofline"]["best_s"] / out["streamed"]["best_s"]
        return out
    finally:
        files.close()


def plot(results: list[dict], path) -> None:
    pyplot = plt()
    done = [r for r in results if "skipped" not in r]
    fig, (ax1, ax2) = pyplot.subplots(1, 2, figsize=(11, 4))
    for mode, marker in zip(MODES, "os", strict=True):
        rows = [r for r in done if r["mode"] == mode]
        sizes = [r["size_m"] for r in rows]
        for name, style in (("roofline", "--"), ("streamed", "-")):
            ax1.plot(sizes, [r[name]["gb_per_s"] for r in rows], style, marker=marker, label=f"{mode} {name}")
            ax2.plot(sizes, [max(0, r[name]["cache_growth_bytes"][-1] or 0) / 2**20 for r in rows], style,
                     marker=marker, label=f"{mode} {name}")
    for ax, label in ((ax1, "disk traffic GB/s (read + write)"), (ax2, "page cache growth per pass (MiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("host Adam state on disk: streamed AdamW pass against a plain read+write pass")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m bench.nvme", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="1 M parameters, one repeat (the test suite's)")
    parser.add_argument("--sizes", type=int_at_least(1), nargs="+", default=None, help="millions of parameters")
    parser.add_argument("--dir", default=None, help="where the state files go (default: a temporary folder)")
    parser.add_argument("--repeats", type=int_at_least(1), default=2)
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES_M if args.quick else SIZES_M)
    repeats = 1 if args.quick else args.repeats
    where = args.dir or tempfile.gettempdir()
    free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
    results = []
    for size_m in sizes:
        for mode in MODES:
            if size_m * (1 << 20) * 12 > free * 0.8:
                results.append(dict(size_m=size_m, mode=mode, skipped=f"needs {size_m * 12} MiB, {free} bytes free"))
                continue
            r = measure(size_m, mode, where, repeats)
            results.append(r)
            if "skipped" in r:
                print(f"{size_m:>6} M {mode:>8}: skipped ({r['skipped']})", flush=True)
            else:
                print(f"{size_m:>6} M {mode:>8}: roofline {r['roofline']['gb_per_s']:.2f} GB/s, streamed "
                      f"{r['streamed']['gb_per_s']:.2f} GB/s ({r['streamed_over_roofline']:.2f}x), page cache "
                      f"+{(r['streamed']['cache_growth_bytes'][-1] or 0) / 2**20:.0f} MiB", flush=True)
    out = output_dir(args.out)
    write_json_light(out / "nvme_cpu.json", dict(
        bench="nvme", quick=args.quick, sizes_m=sizes, block_numel=BLOCK_NUMEL, goal_streamed_over_roofline=GOAL,
        directory=where, free_bytes=free, results=results, machine=machine_info_light()))
    plot(results, out / "nvme_cpu.png")
    print(f"wrote {out / 'nvme_cpu.json'} and {out / 'nvme_cpu.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
