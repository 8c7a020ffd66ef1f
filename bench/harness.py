"""One small benchmark harness shared by every entry point in ``bench/``.

Timing: warm-up calls, then ``repeats`` timed calls with ``time.perf_counter`` (plus a device
synchronise when a CUDA tensor is involved), reported as median and spread. Candidates that are
compared are run *interleaved* round by round (``interleaved``): machines here drift by 2x within
minutes, so only medians taken side by side compare. Results go to JSON (with the machine
description) and CSV; plots are drawn from that data, never from live objects. Benchmarks that measure
in fresh processes start them with ``run_ranks`` (one process per rank) or ``run_child`` (one process).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from zenflow_kernels.testing import free_port  # (the rank launchers' MASTER_PORT; tests use it too)

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Timing:
    """Seconds per call over the repeats: median, min, max and the interquartile spread."""

    median: float
    min: float
    max: float
    iqr: float
    repeats: int

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> Timing:
        s = sorted(samples)
        if len(s) >= 4:
            q = statistics.quantiles(s, n=4)
            iqr = q[2] - q[0]
        else:
            iqr = s[-1] - s[0]
        return cls(statistics.median(s), s[0], s[-1], iqr, len(s))

    def as_dict(self) -> dict:
        return asdict(self)

    def as_row(self) -> dict:
        """The fields of a result row, in seconds: median_s, iqr_s, min_s, max_s, rounds."""
        return {"median_s": self.median, "iqr_s": self.iqr, "min_s": self.min, "max_s": self.max,
                "rounds": self.repeats}


def _synchronize() -> None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def time_call(fn: Callable[[], object], warmup: int = 2, repeats: int = 10) -> Timing:
    """Median-of-``repeats`` wall time of ``fn()`` after ``warmup`` untimed calls."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    for _ in range(warmup):
        fn()
    _synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _synchronize()
        samples.append(time.perf_counter() - t0)
    return Timing.from_samples(samples)


def interleaved(
    candidates: dict[str, Callable[[], object]], rounds: int = 10, warmup: int = 1, calls_per_round: int = 1
) -> dict[str, Timing]:
    """Time several candidates round by round (A, B, C, A, B, C, ...) so drift hits all equally.

    Each round times ``calls_per_round`` consecutive calls of one candidate and records the mean.
    """
    if rounds < 1 or calls_per_round < 1:
        raise ValueError(f"rounds and calls_per_round must be >= 1, got {rounds!r}, {calls_per_round!r}")
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    _synchronize()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            for _ in range(calls_per_round):
                fn()
            _synchronize()
            samples[name].append((time.perf_counter() - t0) / calls_per_round)
    return {name: Timing.from_samples(s) for name, s in samples.items()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the instruction sets the kernels' speed turns on: two CPUs of one model name can differ in these
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def cpu_detail() -> dict:
    """What tells two CPUs of one model name apart: vendor, family / model / stepping, the clock the kernel reports,
    the SIMD flags that matter here and the cache sizes (Linux: ``/proc/cpuinfo`` and sysfs; ``{}`` elsewhere)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return {}
    detail: dict = {key: fields.get(name) for key, name in (("vendor", "vendor_id"), ("family", "cpu family"),
                                                          ("model", "model"), ("stepping", "stepping"))}
    detail["mhz"] = round(float(fields["cpu MHz"])) if "cpu MHz" in fields else None
    flags = set(fields.get("flags", "").split())
    detail["flags"] = [flag for flag in _CPU_FLAGS if flag in flags]
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        caches[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    detail["caches"] = caches
    return detail


def _git_commit() -> str | None:
    """HEAD's short hash, with "+dirty" when tracked library or bench code differs from it (results
    written before their code is committed must not claim the older commit)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                              timeout=5).stdout.strip()
        if not head:
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "zenflow_kernels",
                                  "bench/*.py"], capture_output=True, text=True, cwd=here.parent, timeout=5)
        return head + ("+dirty" if changed.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    """What the numbers were measured on: CPU, cores, memory, GPU, and library versions."""
    info: dict = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cpu_detail": cpu_detail(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "git_commit": _git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        info["memory_gib"] = None
    # from the installed packages' metadata, not by importing them (deepspeed's import takes seconds and logs)
    info["versions"] = {}
    for mod in ("torch", "triton", "numba", "numpy", "deepspeed"):
        try:
            info["versions"][mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][mod] = None
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
        else:
            info["gpu"] = None
    except ImportError:  # pragma: no cover
        info["gpu"] = None
    return info


def output_dir(path: str | os.PathLike | None) -> Path:
    """Create (if needed) and return the folder results go to; a clear error if it is unwritable."""
    out = Path(path) if path is not None else RESULTS_DIR
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise SystemExit(f"error: output folder {str(out)!r} is not writable: {exc.strerror or exc}") from None
    return out


def write_result(path: str | os.PathLike, payload: dict) -> Path:
    """Write a benchmark's result as indented JSON: ``payload`` with a ``machine`` entry (:func:`machine_info`,
    unless the payload has one) and its ``record`` (:func:`result_record`), which says
    how to make it again and what it was made on. Every result under bench/results/ is written by this function
    (``tests/test_results.py`` checks their records)."""
    payload = dict(payload)
    if "machine" not in payload:  # (a payload may bring its own: a run that adds the GPU, a rank's)
        payload["machine"] = machine_info()
    payload["record"] = result_record(payload.get("command"), payload["machine"])
    path = Path(path)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


# -- the record of a result --------------------------------------------------------------------------------------

RECORD_FIELDS = ("command", "commit", "clean", "changed", "machine", "load", "started_utc", "finished_utc", "wall_s")


def command_line() -> str | None:
    """``python -m bench.<module> <its arguments>`` when this process runs a benchmark module (``python -m``), else
    None (a benchmark's ``main(argv)`` called from another program names its command in the payload)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.name.startswith("bench."):
        return None
    return " ".join([f"python -m {spec.name}", *map(shlex.quote, sys.argv[1:])])


def git_state(root: Path = REPO) -> tuple[str | None, list[str]]:
    """HEAD's full hash and the paths that differ from it: tracked files anywhere but ``bench/results`` and
    ``studies/results`` and the untracked ones under ``zenflow_kernels``, ``bench`` and ``studies`` (what could
    change a result). ``(None, [])`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root,
                              timeout=10).stdout.strip()
        if not head:
            return None, []
        results = [":(exclude)bench/results", ":(exclude)studies/results"]
        tracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *results],
                                 capture_output=True, text=True, cwd=root, timeout=10)
        untracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "zenflow_kernels",
                                    "bench", "studies", *results], capture_output=True, text=True, cwd=root,
                                   timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, []
    changed = {line[3:] for out in (tracked.stdout, untracked.stdout) for line in out.splitlines() if line.strip()}
    return head, sorted(changed)


def result_record(command: str | None = None, machine: dict | None = None) -> dict:
    """How a result was made: ``command`` (by default :func:`command_line`), the repository's ``commit`` and whether
    the tree was ``clean`` (else the ``changed`` paths), the ``machine`` (CPU model, cores, memory, GPU), the
    ``load`` other processes put on the machine from the harness's import to now (this process's waited-for
    children's CPU counted as its own: :class:`OtherLoad`) with the 1-minute load average at the end, and when it
    ran."""
    commit, changed = git_state()
    machine = machine if machine is not None else machine_info()
    now = time.time()
    return {
        "command": command or command_line(),
        "commit": commit,
        "clean": commit is not None and not changed,
        "changed": changed[:50],
        "machine": {key: machine.get(key) for key in ("cpu", "cpu_detail", "logical_cores", "affinity_cores",
                                                      "memory_gib", "gpu", "platform", "versions")},
        "load": {"other_processes_share_of_cores": round(_RUN_LOAD.fraction(), 4),
                 "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None},
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_RUN_STARTED)),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "wall_s": round(now - _RUN_STARTED, 1),
    }


def _json_default(obj):
    if isinstance(obj, Timing):
        return obj.as_dict()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_csv(path: str | os.PathLike, rows: Sequence[dict]) -> Path:
    """Write a list of flat dicts as CSV (columns from the union of keys, in first-seen order)."""
    path = Path(path)
    fields: list[str] = []
    for row in rows:
        for key in row:
            if key not in fields:
                fields.append(key)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def plt():
    """matplotlib.pyplot with a non-interactive backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (11, 4)):
    """A headless figure and its axes (``pyplot.subplots``)."""
    return plt().subplots(nrows, ncols, figsize=size)


def style(ax, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None, *,
          logx: int | None = None, logy: int | None = None, legend: float | None = 7, grid: str | None = "both"):
    """One call for an axis's labels, log scales (the base), legend (font size; None: none) and grid."""
    for setter, value in ((ax.set_xlabel, xlabel), (ax.set_ylabel, ylabel), (ax.set_title, title)):
        if value is not None:
            setter(value)
    if logx:
        ax.set_xscale("log", base=logx)
    if logy:
        ax.set_yscale("log", base=logy)
    if legend is not None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend)
    if grid:
        ax.grid(alpha=0.3, axis=grid)
    return ax


def save(fig, path, dpi: int = 110) -> None:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt().close(fig)


def draw_lanes(ax, spans, lanes, colors: dict, *, scale: float = 1.0) -> None:
    """A ``testing.Timeline``'s spans ``(lane, label, start, end, nbytes)`` as a row of bars per lane, ``lanes``
    from top to bottom, times multiplied by ``scale`` (1e3: milliseconds)."""
    for y, lane in enumerate(lanes):
        bars = [(a * scale, (b - a) * scale) for ln, _, a, b, _ in spans if ln == lane]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[lane])
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()


def meminfo_bytes(key: str) -> int | None:
    """A ``/proc/meminfo`` entry (``"MemAvailable"``, ``"Cached"``, ...) in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's largest resident set so far (``getrusage``; KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit status 2), no usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def int_at_least(minimum: int):
    """An argparse ``type=``: an integer >= ``minimum``, with a one-line message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= {minimum}")
        return value

    return parse


# -- child processes -------------------------------------------------------------------------------------


def _child_env(extra: dict | None) -> dict:
    env = {**os.environ, **(extra or {})}
    env.pop("TRITON_INTERPRET", None)  # benchmarks time the default path, never Triton's interpreter
    return env


def run_ranks(module: str, world: int, args: list[str], *, timeout: float, what: str = "a rank",
              env_extra: dict | None = None) -> list[dict]:
    """Start ``world`` processes ``python -m <module> --worker-out DIR <args>`` from the repository root,
    as torchrun would (MASTER_ADDR/MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, plus
    ``env_extra``; without ``TRITON_INTERPRET``), and return their results: rank r writes its JSON to
    ``DIR/rank{r}.json``, DIR being a temporary folder removed once they are read. Each rank is waited on for
    up to ``timeout`` seconds; its stdout is discarded. A failing rank ends the caller with
    ``SystemExit("<module>: <what> failed:")`` and the last 3000 characters of the first failing rank's stderr."""
    env = _child_env({**(env_extra or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                      "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    with tempfile.TemporaryDirectory(prefix=f"{module.rsplit('.', 1)[-1]}-ranks-") as tmp:
        cmd = [sys.executable, "-m", module, "--worker-out", tmp, *args]
        procs = [subprocess.Popen(cmd, cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        errors = []
        try:
            for p in procs:  # every rank is waited on: a failed one's peers end when their collectives fail
                _, err = p.communicate(timeout=timeout)
                if p.returncode:
                    errors.append(err[-3000:])
        finally:
            for p in procs:  # after a timeout, no rank is left running
                p.kill()
        if errors:
            raise SystemExit(f"{module}: {what} failed:\n{errors[0]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def run_child(module: str, args: list[str], *, timeout: float, what: str = "the process",
              env_extra: dict | None = None) -> dict:
    """Run one process ``python -m <module> <args> --worker-out PATH`` from the repository root (the
    environment plus ``env_extra``, without ``TRITON_INTERPRET``), killed after ``timeout`` seconds, and
    return the JSON it wrote to PATH, a file in a temporary folder removed once it is read. Its stdout is
    discarded; a failure ends the caller with ``SystemExit("<module>: <what> failed:")`` and the last 3000
    characters of its stderr."""
    with tempfile.TemporaryDirectory(prefix=f"{module.rsplit('.', 1)[-1]}-") as tmp:
        out = Path(tmp, "result.json")
        proc = subprocess.run([sys.executable, "-m", module, *args, "--worker-out", str(out)], cwd=REPO,
                              env=_child_env(env_extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
        if proc.returncode:
            raise SystemExit(f"{module}: {what} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


# -- a shared machine: measure while the others are quiet ------------------------------------------------


class OtherLoad:
    """CPU time used by *other* processes while a block ran, as a fraction of all cores (this machine
    is shared; a number well above 0 means that block's timings are suspect)."""

    def __init__(self):
        self._t0, self._busy0, self._own0 = self._sample()

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        tick = os.sysconf("SC_CLK_TCK")
        own = sum(os.times()[:4])  # seconds of CPU of this process and its waited-for children (user + system)
        return time.perf_counter(), (sum(fields) - idle) / tick, own

    def fraction(self) -> float:
        t1, busy1, own1 = self._sample()
        other = (busy1 - self._busy0) - (own1 - self._own0)
        return max(0.0, other) / max(1e-9, (t1 - self._t0) * (os.cpu_count() or 1))


def wait_quiet(limit_s: float, threshold: float = 0.1) -> float:
    """Wait (up to limit_s) until other processes use < threshold of the machine over 5 s; returns it."""
    end = time.perf_counter() + limit_s
    while True:
        probe = OtherLoad()
        time.sleep(5)
        load = probe.fraction()
        if load < threshold or time.perf_counter() > end:
            return load


def quietest(measure, load_of, attempts: int, max_other_load: float, label: str) -> dict:
    """``measure()``, again after waiting for quiet while other processes took more than ``max_other_load`` of the
    CPUs (``load_of(result)``), up to ``attempts`` runs in all; the quietest result is kept, every attempt's load
    in its ``other_load_of_attempts``."""
    result = measure()
    loads = [load_of(result)]
    while min(loads) > max_other_load and len(loads) < attempts:
        print(f"{label}: other processes used {loads[-1]:.0%} of the CPUs, running it again", flush=True)
        wait_quiet(60)
        again = measure()
        loads.append(load_of(again))
        if loads[-1] == min(loads):
            result = again
    result["other_load_of_attempts"] = loads
    return result


def parse_width_layers(text: str) -> tuple[int, int]:
    """An argparse ``type=`` for a transformer-shaped size ``DxLAYERS`` (e.g. ``1024x24``): width a multiple of 16."""
    try:
        d, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not DxLAYERS (e.g. 1024x24)") from None
    if d < 16 or d % 16 or layers < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: d must be a multiple of 16 (>= 16) and layers >= 1")
    return d, layers


# the whole run's record: from the harness's import (every benchmark imports it first) to its result's writing
_RUN_STARTED = time.time()
_RUN_LOAD = OtherLoad()
