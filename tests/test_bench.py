"""The benchmark entry points run end to end at a tiny size and write the data they promise.

Each entry point runs as a subprocess (``python -m bench.<name>``), as a user runs it, into a temporary
folder; the JSON it writes is checked for its fields and for sane values. ``TRITON_INTERPRET`` (set for the
suite by conftest) is removed for these: benchmarks time the default path, never the interpreter. A run that
must stop at its options calls the module's ``main`` in this process instead (``run_main``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.subprocess]

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_module(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_main(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args`` for a run that stops at its options (a bad option, no GPU): the module's
    ``main(argv)`` in this process, its stdout and stderr captured and the status it exits with, as the
    interpreter would give them (a SystemExit's message on stderr, status 1), without an interpreter's start and
    imports per case (about a second each)."""
    import contextlib
    import importlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = importlib.import_module(module).main(list(args)) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out.getvalue(), err.getvalue())


def finite(xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode != 0, f"exit status 0 for a bad option; stderr: {err!r}"
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# -- how the bench modules depend on each other (read from their source, nothing imported) --------------


def bench_imports() -> dict[str, dict[str, set[str]]]:
    """Per module of bench/: the bench modules it imports, at any depth in the file (a lazy import inside a
    function counts), each with the names it takes from it (``from bench.x import a``, ``from bench import x``
    then ``x.a``; ``*`` for a plain module import)."""
    import ast

    folder = REPO / "bench"
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        deps: dict[str, set[str]] = {}
        aliases: dict[str, str] = {}  # a local name -> the bench module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "bench":
                for a in node.names:
                    if a.name in modules:
                        deps.setdefault(a.name, set()).add("*")
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("bench."):
                deps.setdefault(node.module.split(".")[1], set()).update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                deps.setdefault((node.module or "").split(".")[0] or "__init__", set()).update(
                    a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("bench."):
                        deps.setdefault(a.name.split(".")[1], set()).add("*")
                        if a.asname:
                            aliases[a.asname] = a.name.split(".")[1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                deps[aliases[node.value.id]].add(node.attr)
        deps.pop(path.stem, None)
        graph[path.stem] = deps
    return graph


def test_bench_modules_import_no_cycle():
    """No import cycle anywhere in bench/ (the CPU and GPU end-to-end entry points share bench.e2e_core and the GPU
    one does not import the CPU one), and no bench module takes another's private (underscore) names."""
    graph = bench_imports()
    assert "e2e" not in graph["gpu_e2e"] and {"e2e_core"} <= set(graph["gpu_e2e"]) & set(graph["e2e"]), \
        {m: sorted(graph[m]) for m in ("e2e", "gpu_e2e")}
    state: dict[str, str] = {}  # "open" while on the depth-first path, "done" after

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, {})):
            assert state.get(dep) != "open", "import cycle in bench/: " + " -> ".join(
                path[path.index(dep):] + [dep] if dep in path else [*path, dep])
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    borrowed = {f"bench.{m} takes {d}.{n}" for m, deps in graph.items() for d, names in deps.items() for n in names
                if n.startswith("_") and not n.startswith("__")}
    assert not borrowed, sorted(borrowed)


# -- bench.e2e --------------------------------------------------------------------------------------------

E2E_STEPS = 24


@pytest.fixture(scope="module")
def e2e_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    proc = run_module(
        "bench.e2e", "--model", "tiny", "--steps", str(E2E_STEPS), "--pretrain-steps", "0", "--threads", "1",
        "--eval-points", "3", "--out", str(out / "results"), "--cache", str(out / "cache"), "--quiet",
        "--baseline-threads", "1",
    )
    assert proc.returncode == 0, proc.stderr
    return proc, out / "results"


def test_e2e_writes_json_png_and_table(e2e_result):
    proc, out = e2e_result
    assert (out / "e2e.png").read_bytes()[:8] == PNG_MAGIC
    result = json.loads((out / "e2e.json").read_text())
    for key in ("config", "model", "corpus", "pretrain", "runs", "comparison", "machine", "total_s"):
        assert key in result, key
    assert [r["name"] for r in result["runs"]] == ["adamw", "offload", "adamw_t1", "zenflow"]
    assert result["corpus"]["train"]["bytes"] > 0 and result["corpus"]["heldout"]["bytes"] > 0
    assert set(result["corpus"]["train"]["first_files"]).isdisjoint(result["corpus"]["heldout"]["first_files"])
    header = proc.stdout.splitlines()[0]
    for column in ("steps/s", "stall %", "host upd", "train loss", "held-out"):
        assert column in header
    # the gradient's concentration at each selection, and what it implies, printed with the table
    conc = next(r for r in result["runs"] if r["name"] == "zenflow")["concentration"]
    assert len(conc["top10"]) == len(conc["top1"]) == len(conc["selected"]) >= 1
    assert all(0 < a <= b <= 1 + 1e-9 for a, b in zip(conc["top1"], conc["top10"], strict=True))
    assert "zenflow: gradient concentration at the last of" in proc.stdout and "  -> " in proc.stdout


def test_e2e_runs_have_sane_figures(e2e_result):
    result = json.loads((e2e_result[1] / "e2e.json").read_text())
    for r in result["runs"]:
        assert r["steps"] == E2E_STEPS and len(r["train_loss"]) == E2E_STEPS
        assert r["wall_s"] > 0 and r["steps_per_s"] > 0 and r["steps_per_s_median"] > 0
        assert finite(r["train_loss"]) and finite(r["wall_at_step"])
        assert r["wall_at_step"] == sorted(r["wall_at_step"])
        assert [e["step"] for e in r["evals"]] == [0, 8, 16, 24]
        held = [e["heldout_loss"] for e in r["evals"]]
        assert finite(held)
        # from a random initialisation 24 steps must lower both losses
        assert held[-1] < held[0] - 0.1, (r["name"], held)
        assert sum(r["train_loss"][-6:]) < sum(r["train_loss"][:6]), r["name"]
        assert 0.0 <= r["stall_pct"] < 100.0
    by = {r["name"]: r for r in result["runs"]}
    assert by["adamw_t1"]["torch_threads_during_run"] == 1
    assert by["adamw_t1"]["train_loss"] == pytest.approx(by["adamw"]["train_loss"], abs=1e-4)
    assert by["adamw"]["host_updates"] == 0
    assert by["offload"]["host_updates"] == E2E_STEPS  # synchronous offload: a host AdamW every step
    assert by["zenflow"]["host_updates"] == E2E_STEPS // 4  # update_interval 4
    assert by["zenflow"]["selections"] >= 1 and by["zenflow"]["stall_s"] >= 0


def test_e2e_sync_offload_is_adamw(e2e_result):
    """The synchronous offload baseline runs AdamW on the fp32 host master: the same trajectory."""
    result = json.loads((e2e_result[1] / "e2e.json").read_text())
    by = {r["name"]: r for r in result["runs"]}
    worst = max(abs(a - b) for a, b in zip(by["adamw"]["train_loss"], by["offload"]["train_loss"], strict=True))
    assert worst < 1e-3, worst


def test_e2e_comparison_ratios(e2e_result):
    result = json.loads((e2e_result[1] / "e2e.json").read_text())
    cmp = result["comparison"]
    zen = cmp["per_run"]["zenflow"]
    assert zen["steps_per_s_vs_adamw"] > 0 and zen["steps_per_s_vs_offload"] > 0
    assert math.isfinite(zen["heldout_gap_vs_adamw_equal_steps"])
    assert math.isfinite(zen["heldout_gap_vs_offload_equal_wall"]) and zen["equal_wall_time_s"] > 0
    goals = {"stall_lt_5pct", "steps_per_s_ge_0p9_adamw", "heldout_le_offload_equal_wall"}
    assert set(cmp["goals"]["zenflow"]) == goals
    assert cmp["per_run"]["adamw"]["steps_per_s_vs_adamw"] == pytest.approx(1.0)


def test_e2e_pretraining_is_cached(tmp_path):
    from bench import e2e

    cfg = e2e.E2EConfig(model="tiny", steps=2, pretrain_steps=3, eval_windows=4, pretrain_bytes=50_000,
                        train_bytes=50_000, heldout_bytes=20_000, threads=1, device="cpu")
    first = e2e.prepare(cfg, cache_dir=tmp_path)
    second = e2e.prepare(cfg, cache_dir=tmp_path)
    assert not first.pretrain["cached"] and second.pretrain["cached"]
    assert len(list(tmp_path.glob("pretrain-tiny-*.pt"))) == 1
    for k, v in first.state.items():
        assert (v == second.state[k]).all(), k
    other = e2e.prepare(e2e.E2EConfig(**{**cfg.__dict__, "pretrain_steps": 4}), cache_dir=tmp_path)
    assert not other.pretrain["cached"]  # a different pre-training is a different cache entry


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--model", "huge"], "--model"),
        (["--steps", "-3"], "--steps"),
        (["--steps", "0"], "--steps"),
        (["--runs", "adamw,sgd"], "--runs"),
        (["--out", "{file}"], "not writable"),
    ],
    ids=["unknown-model", "negative-steps", "zero-steps", "unknown-run", "unwritable-out"],
)
def test_e2e_bad_options_one_line(tmp_path, args, fragment):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    args = [a.replace("{file}", str(blocker / "sub")) for a in args]
    proc = run_main("bench.e2e", *args, "--cache", str(tmp_path / "cache"))
    assert_one_line_error(proc, "error", fragment)
    assert not (tmp_path / "cache").exists()  # nothing ran


# -- bench.kernels and bench.cpu_adam (written by others; checked through their documented flags) ---------


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_preset_says_it_needs_a_gpu(tmp_path):
    proc = run_main("bench.e2e", "--preset", "gpu", "--out", str(tmp_path))
    assert_one_line_error(proc, "needs a CUDA GPU", "--device cpu")
    assert not list(tmp_path.iterdir())


def test_gpu_preset_runs_its_code_path_on_cpu(tmp_path):
    """The GPU benchmark's runs, figures and goals, on CPU at a tiny size (the GPU run is bench/gpu_suite.sh's)."""
    steps = 6
    proc = run_module("bench.e2e", "--preset", "gpu", "--device", "cpu", "--model", "tiny", "--steps", str(steps),
                      "--threads", "1", "--out", str(tmp_path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "e2e_gpu.json").read_text())
    assert (tmp_path / "e2e_gpu.png").read_bytes()[:8] == PNG_MAGIC
    assert data["config"]["autocast"] == "bf16" and data["config"]["pretrain_steps"] == 0
    names = list(data["summary"])
    assert names[:4] == ["adamw", "offload", "zenflow", "zenflow_devacc"]
    assert ("ds_zenflow" in names) == (data["deepspeed_skipped"] is None)
    runs = {r["name"]: r for r in data["runs"]}
    for name, row in data["summary"].items():
        assert len(runs[name]["step_ms"]) == steps and finite(runs[name]["step_ms"])
        assert row["ms_per_step_median"] > 0 and row["ms_per_step_mean"] > 0
        if not name.startswith("ds_"):  # a peer's losses are recorded as they come (DeepSpeed 0.19.8's
            # ZenFlow gives NaN at this tiny CPU size where its ZeRO-2 offload does not)
            assert math.isfinite(row["final_train_loss"]) and math.isfinite(row["final_heldout_loss"]), name
    assert data["summary"]["adamw"]["d2h_bytes_per_step"] == 0
    # the same ZenFlow run with device-side sums: the same losses, fewer gradient bytes to the host
    zen, dev = data["summary"]["zenflow"], data["summary"]["zenflow_devacc"]
    assert runs["zenflow"]["train_loss"] == runs["zenflow_devacc"]["train_loss"]
    assert 0 < dev["d2h_bytes_per_step"] < zen["d2h_bytes_per_step"]
    assert data["summary"]["offload"]["h2d_bytes_per_step"] > zen["h2d_bytes_per_step"] > 0
    assert set(data["goals"]) == {"step_le_1p25x_adamw", "speed_ge_4x_sync_offload", "stall_lt_5pct",
                                  "faster_than_deepspeed_zenflow", "step_call_le_2ms"}
    assert "goals:" in proc.stdout and "ZenFlowAdamW" in proc.stdout


def test_kernels_quick(tmp_path):
    proc = run_module("bench.kernels", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    files = sorted(tmp_path.glob("kernels*.json"))
    assert files, list(tmp_path.iterdir())
    result = json.loads(files[0].read_text())
    assert result["complete"] is True and result["machine"]["python"]
    assert result["rows"]
    for row in result["rows"]:
        assert row["ms"] > 0 and math.isfinite(row["ms"]), row
        assert {"op", "shape", "dtype", "impl"} <= set(row)


def test_cpu_adam_quick(tmp_path):
    proc = run_module("bench.cpu_adam", "--quick", "--sizes", "65536", "--rounds", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "cpu_adam.json").read_text())
    assert result["machine"]["python"] and result["config"]["sizes"] == [65536]
    ours = [r for r in result["adam"] if r["candidate"] == "zenflow"]
    assert ours, [r["candidate"] for r in result["adam"]]
    for row in result["adam"]:
        assert row["size"] == 65536 and row["median_s"] > 0 and row["mparams_per_s"] > 0, row
    assert (tmp_path / "cpu_adam.png").read_bytes()[:8] == PNG_MAGIC


def test_zero_quick(tmp_path):
    proc = run_module("bench.zero", "--model", "tiny", "--steps", "3", "--warmup", "1", "--repeats", "1",
                      "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "zero_cpu.json").read_text())
    one, two = result["summary"]["1"], result["summary"]["2"]
    assert one["steps_per_s_median"] > 0 and two["steps_per_s_median"] > 0
    assert one["collective_bytes_per_step"] == {}  # one rank: no collectives
    assert two["collective_bytes_per_step"]["gradients"] > 100 * two["collective_bytes_per_step"]["selection scores"]
    whole, halves = one["host_state_bytes_per_rank"], two["host_state_bytes_per_rank"]
    assert len(halves) == 2 and sum(halves) == whole[0] and max(halves) < 0.6 * whole[0]
    # ZeRO-2 releases the gradients: after backward a rank's .grad holds the vectors only, and its
    # reductions the sums of its own range (about half); one rank holds every gradient in .grad
    n = one["parameter_elements"]
    assert one["gradient_elements_held_per_rank"] == [dict(grad=n, own=0, in_flight=0)]
    held = two["gradient_elements_held_per_rank"]
    assert len(held) == 2 and sum(h["own"] for h in held) < n
    for h in held:
        assert 0 < h["grad"] < 0.05 * n and 0.3 * n < h["own"] < 0.7 * n and h["in_flight"] < 0.7 * n
    assert result["machine"]["python"] and (tmp_path / "zero_cpu.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("module", ["bench.kernels", "bench.cpu_adam", "bench.zero"])
def test_other_benches_reject_bad_options(tmp_path, module):
    proc = run_main(module, "--no-such-option", "--out", str(tmp_path))
    assert_one_line_error(proc, "error:", "--no-such-option")
    assert not list(tmp_path.glob("*.json"))


# -- bench.scale -------------------------------------------------------------------------------------------


def test_scale_quick(tmp_path):
    """Every config at a tiny size and the per-tensor measurement: the JSON's structure and what must hold
    whatever the speed (the host budget by buffer, RSS at least the reported buffers). One size (each run is a
    fresh process): the growth across sizes is checked on rows of known slope below."""
    proc = run_module("bench.scale", "--quick", "--sizes", "32x2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "scale_cpu.json").read_text())
    assert (tmp_path / "scale_cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert result["machine"]["python"] and result["config"]["quick"] is True
    assert not result["skipped"]
    runs = result["runs"]
    configs = ("overlap", "sync", "devacc")
    assert {(r["size"], r["config"]) for r in runs} == {("32x2", c) for c in configs}
    for r in runs:
        where = (r["size"], r["config"])
        assert r["params"] == r["layers"] * (12 * r["d"] ** 2 + 2 * r["d"]) and r["tensors"] == 6 * r["layers"], where
        bpp, hb = r["bytes_per_param"], r["host_bytes"]
        # docs/design.md section 9: master 4, moments 8, accumulation 4 a buffer (two with overlap and host
        # accumulation), a bf16 copy-out (the fp32 norm vectors add a little), no landing area on the CPU link
        assert bpp["master"] == pytest.approx(4, rel=1e-3), where
        assert bpp["exp_avg"] == bpp["exp_avg_sq"] == bpp["master"], where
        acc = 8 if r["config"] == "overlap" else 4
        assert bpp["accumulation"] == pytest.approx(acc, rel=1e-3), where
        assert 2 <= bpp["copy_out"] <= 2.02, where
        assert hb["landing"] == 0 and bpp["total"] == pytest.approx(12 + acc + bpp["copy_out"]), where
        assert hb["device_sums"] == (hb["master"] if r["config"] == "devacc" else 0), where
        assert 0 < bpp["fast_state"] < 2, where  # 10% of the columns: fp32 master and moments
        rss = r["rss"]
        assert rss["peak"] >= rss["end"] >= rss["reported"] == hb["total"] + hb["fast_state"] + hb["device_sums"]
        assert rss["peak"] >= rss["params_and_grads"] + rss["reported"], where
        tm = r["times"]
        assert len(tm["step_s"]) == len(tm["boundary"]) == r["steps"] == 8 and finite(tm["step_s"]), where
        assert tm["boundary"] == [t % 4 == 3 for t in range(8)], where  # update_interval 4
        assert min(tm["step_s"]) > 0 and tm["mean_step_s"] > 0 and tm["cold_first_step_s"] > 0, where
        hu = r["host_update"]
        assert hu["count"] == 2 and finite(hu["seconds"]) and hu["roofline_s"] > 0, where
        assert hu["bytes_per_element"] == (36 if r["config"] == "sync" else 34), where
        assert r["stats"]["host_updates"] == 2 and r["stats"]["selections"] == 1, where
        assert {b["pattern"] for b in r["bandwidth"]} == {hu["pattern"], "accumulate"}, where
        assert all(b["gbps"] > 0 for b in r["bandwidth"]) and hu["fraction_of_roofline_last"] > 0, where
    assert {(b["pattern"], b["threads"]) for b in result["roofline_bandwidth"]} >= {
        (r["host_update"]["pattern"], r["host_threads"]) for r in runs}
    pt = result["per_tensor"]
    assert {(r["candidate"], r["tensors"]) for r in pt["rows"]} == {
        (c, n) for c in ("zenflow_cpu_link", "zenflow_async_link", "torch_adamw_foreach") for n in (12, 24)}
    assert all(r["median_s"] > 0 for r in pt["rows"])
    assert set(pt["summary"]["zenflow_async_link"]) >= {"us_per_tensor", "vs_torch_adamw_at_12", "vs_torch_adamw_at_24"}
    ds = result["deepspeed_reference"]
    assert ds["zero_offload"]["bytes_per_param"] == 16 and ds["zenflow_overlap"]["bytes_per_param"] == 32
    assert result["growth"] == {}  # one size: nothing to fit


def test_scale_growth_fits_time_per_parameter():
    """``bench.scale.growth``: the least-squares ns per parameter, intercept and exponent, on rows of a known line
    (2 ns per parameter plus 1 ms) and power law (time ~ params^0.5), per config."""
    from bench.scale import growth

    def row(config, params, t):
        return dict(config=config, params=params, host_update=dict(last_s=t),
                    times=dict(mean_step_s=t, between_boundaries_median_s=t, cold_first_step_s=t))

    line = [row("sync", n, 2e-9 * n + 1e-3) for n in (10**6, 2 * 10**6, 4 * 10**6)]
    power = [row("overlap", n, 1e-3 * (n / 10**6) ** 0.5) for n in (10**6, 16 * 10**6)]
    fit = growth(line + power + [row("devacc", 10**6, 1e-3)])
    assert set(fit) == {"sync", "overlap"}  # devacc: one size
    for key in ("mean_step", "between_boundaries", "host_update_last", "cold_first_step"):
        assert fit["sync"][key]["ns_per_param"] == pytest.approx(2.0)
        assert fit["sync"][key]["intercept_ms"] == pytest.approx(1.0)
        assert fit["overlap"][key]["exponent"] == pytest.approx(0.5)


@pytest.mark.parametrize("args, fragment", [(["--sizes", "100x2"], "--sizes"), (["--configs", "fast"], "--configs"),
                                            (["--steps", "2"], "--steps")], ids=["size", "config", "steps"])
def test_scale_rejects_bad_options(tmp_path, args, fragment):
    proc = run_main("bench.scale", *args, "--out", str(tmp_path))
    assert_one_line_error(proc, "error:", fragment)
    assert not list(tmp_path.glob("*.json"))


# -- bench.step_overhead -----------------------------------------------------------------------------------


def test_step_overhead_quick(tmp_path):
    """Every candidate at both quick counts, both clocks, each repeat, in one run: the JSON's structure and its plot
    (timings are the machine's)."""
    proc = run_module("bench.step_overhead", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "step_overhead_cpu.json").read_text())
    assert (tmp_path / "step_overhead_cpu.png").read_bytes()[:8] == PNG_MAGIC
    candidates = ("zenflow_cpu_link", "zenflow_async_link", "zenflow_async_link_hooks", "torch_adamw_foreach",
                  "torch_adamw_fused")
    config = result["config"]
    assert result["machine"]["python"] and config["quick"] is True and config["repeats"] == 2
    assert config["clocks"] == {"cpu": "time.thread_time", "wall": "time.perf_counter"}
    assert config["tensors"] == [8, 16]
    assert {(r["candidate"], r["tensors"], r["clock"], r["repeat"]) for r in result["rows"]} == {
        (c, n, clock, k) for c in candidates for n in (8, 16) for clock in ("cpu", "wall") for k in (0, 1)}
    for r in result["rows"]:
        assert r["steps"] > 0 and 0 < r["min_ms"] <= r["median_ms"] and math.isfinite(r["median_ms"]), r
    assert set(result["summary"]) == set(candidates)  # (no goal at counts other than 150 and 600)
    for clock in ("cpu", "wall"):
        summary = result["summary"]["zenflow_async_link"][clock]
        assert {"ms_at_8", "ms_at_16", "us_per_tensor", "vs_torch_adamw_foreach_at_16"} <= set(summary)


# -- bench.cpu_rules ---------------------------------------------------------------------------------------


def test_cpu_rules_quick(tmp_path):
    """Every rule (the hand-written kernels and the compiled rules of one's own), the roofline passes, both thread
    counts: the JSON's structure and its plot (timings are the machine's); each rule's fraction of the roofline is
    its bytes over its time against the roofline pass's, from the recorded numbers."""
    proc = run_module("bench.cpu_rules", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "cpu_rules.json").read_text())
    assert (tmp_path / "cpu_rules.png").read_bytes()[:8] == PNG_MAGIC
    assert result["config"]["quick"] is True and result["machine"]
    assert result["command"] == f"python -m bench.cpu_rules --quick --out {tmp_path}"
    custom = ("rmsprop_compiled", "rmsprop_eager", "ademamix_compiled", "from_torch_rmsprop")
    rules = ("lion", "sgd", "adam", *custom)
    assert result["bytes_per_element"] == {"lion": 26, "sgd": 26, "adam": 34, "rmsprop_compiled": 26,
                                           "rmsprop_eager": 26, "ademamix_compiled": 42, "from_torch_rmsprop": 26}
    threads = result["config"]["threads"]
    by = {(r["threads"], r["candidate"]): r for r in result["rows"]}
    assert {(k, rule) for k in threads for rule in rules} <= set(by), sorted(by)
    for r in result["rows"]:
        assert r["size"] == 2**16 and r["gbps"] > 0 and math.isfinite(r["gbps"]), r
        assert r["median_s"] > 0 and math.isfinite(r["median_s"]), r
    for k in threads:
        for rule in rules:
            r = by[k, rule]
            per_element = result["bytes_per_element"][rule]
            roof = by[k, f"rmw_{per_element}"]  # (the in-place pass over the same bytes per element)
            assert r["roofline"] == roof["candidate"] and roof["bytes_per_element"] == per_element
            bandwidth = per_element * r["size"] / r["median_s"], per_element * roof["size"] / roof["median_s"]
            assert r["gbps"] == pytest.approx(bandwidth[0] / 1e9) and roof["gbps"] == pytest.approx(bandwidth[1] / 1e9)
            assert r["fraction_of_roofline"] == pytest.approx(bandwidth[0] / bandwidth[1]) and bandwidth[0] > 0
        for rule in custom:
            r = by[k, rule]
            assert r["vs_lion"] == pytest.approx(r["median_s"] / by[k, "lion"]["median_s"])
            # (from_torch's step may fall back to eager after recompiles: its path then "compiled and eager")
            expected = {"rmsprop_eager": ("eager",), "from_torch_rmsprop": ("compiled", "compiled and eager")}
            assert r["rule_path"] in expected.get(rule, ("compiled",)), r
            assert r["compiles"] >= 0 and r["compile_s"] >= 0 and r["first_call_s"] > 0
    for rule in custom:  # compiled outside the timed blocks: the first block's warm-up paid for it
        assert sum(by[k, rule]["compiles"] for k in threads) >= (0 if rule == "rmsprop_eager" else 1)


def test_step_overhead_rules_quick(tmp_path):
    """``--rules``: ZenFlow with Lion, SGD and Adam beside the others (their fused device step, and their torch
    step), in their own JSON."""
    proc = run_module("bench.step_overhead", "--quick", "--rules", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "step_overhead_rules_cpu.json").read_text())
    assert (tmp_path / "step_overhead_rules_cpu.png").read_bytes()[:8] == PNG_MAGIC
    rules = {f"zenflow_async_link_{name}{path}" for name in ("lion", "sgd", "adam") for path in ("", "_torch")}
    custom = {f"zenflow_async_link_{name}" for name in ("rmsprop_compiled", "rmsprop_eager", "ademamix_compiled",
                                                        "from_torch_rmsprop")}
    rules |= custom
    assert rules <= set(result["summary"]) and rules <= set(result["config"]["candidates"])
    for name in rules:
        assert result["summary"][name]["cpu"]["vs_torch_adamw_foreach_at_16"] > 0
        for r in (r for r in result["rows"] if r["candidate"] == name):
            assert r["steps"] > 0 and 0 < r["min_ms"] <= r["median_ms"] and math.isfinite(r["median_ms"]), r
    assert set(result["rule_paths"]) == custom
    for name in custom:  # the device step compiled (in the untimed warm-up), or eager where compile=False
        fast = [result["rule_paths"][name][n]["fast"] for n in ("8", "16")]
        assert all(f["path"] == ("eager" if name.endswith("_eager") else "compiled") for f in fast), fast
        assert sum(f["compiles"] for f in fast) >= (0 if name.endswith("_eager") else 1)


# -- bench.host_multi --------------------------------------------------------------------------------------


def test_host_multi_quick(tmp_path):
    """Both ops, both dtypes, both quick sizes in one run: the JSON's structure, and what holds whatever the
    speed: the norms agree with float64 sums (ours to 1e-12, torch's fp32 norms to 1e-5)."""
    proc = run_module("bench.host_multi", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "host_multi_cpu.json").read_text())
    assert (tmp_path / "host_multi_cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert result["machine"]["python"] and result["config"]["quick"] is True
    rows = result["rows"]
    assert {(r["op"], r["dtype"], r["hidden"]) for r in rows} == {
        (op, dt, h) for op in ("grad_norm", "accumulate") for dt in ("bfloat16", "float32") for h in (32, 64)}
    for r in rows:
        for name in ("ours", "ours_unchecked", "torch"):
            assert r[f"{name}_ms"] > 0 and math.isfinite(r[f"{name}_ms"]), r
        if r["op"] == "grad_norm":
            assert r["ours_rel_error"] < 1e-12 and r["ours_unchecked_rel_error"] < 1e-12, r
            assert r["torch_rel_error"] < 1e-5, r


# -- bench.fsdp2 -------------------------------------------------------------------------------------------


def test_fsdp2_quick(tmp_path):
    """One process against FSDP2 at 2 ranks (ZenFlow, AdamW, AdamW with CPUOffloadPolicy) in one run: the JSON's
    structure and what must hold whatever the speed: the host state halves at 2 ranks, FSDP2's all-gathers and
    reduce-scatters are counted, ZenFlow's score all-reduce is far below the gradients, 2 ranks on halves of
    the batch train as one process on the whole."""
    proc = run_module("bench.fsdp2", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "fsdp2_cpu.json").read_text())
    assert (tmp_path / "fsdp2_cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert result["machine"]["python"] and result["config"]["quick"] is True
    s = result["summary"]
    assert list(s) == ["one_zenflow", "one_adamw", "fsdp2_zenflow", "fsdp2_adamw", "fsdp2_offload_adamw"]
    steps = result["config"]["warmup"] + result["config"]["steps"]
    for name, row in s.items():
        world = 2 if name.startswith("fsdp2") else 1
        assert row["world"] == world and row["torch_threads_per_rank"] >= 1, name
        assert row["steps_per_s_median"] > 0 and row["steps_per_s_wall"] > 0 and row["step_call_ms_median"] > 0
        assert len(row["losses"]) == steps and finite(row["losses"]) and math.isfinite(row["final_loss"]), name
        assert len(row["optimizer_state_bytes_per_rank"]) == len(row["parameter_bytes_per_rank"]) == world, name
        assert min(row["peak_rss_bytes_per_rank"]) > 0, name
        assert len(row["other_cpu_share_per_repeat"]) == 1 and row["calm_repeats"] in (0, 1), name
    one = s["one_adamw"]["parameter_bytes_per_rank"][0]
    assert s["one_zenflow"]["collective_bytes_per_step"] == s["one_adamw"]["collective_bytes_per_step"] == {}
    for name in ("fsdp2_zenflow", "fsdp2_adamw", "fsdp2_offload_adamw"):
        row, twin = s[name], s[result["comparisons"][name]["twin"]]
        assert sum(row["parameter_bytes_per_rank"]) == one, name  # each rank holds its rows only
        halves, whole = row["optimizer_state_bytes_per_rank"], twin["optimizer_state_bytes_per_rank"][0]
        assert max(halves) < 0.6 * whole and sum(halves) == pytest.approx(whole, rel=0.02), name
        moved = row["collective_bytes_per_step"]
        # fp32 gradients reduce-scattered once a step (the unsharded buffer), every parameter all-gathered at
        # least once (the forward; the blocks again in backward)
        assert moved["FSDP2 reduce-scatter"] >= one and moved["FSDP2 all-gather"] >= one, name
        assert row["fsdp2_collectives"]["all-gather"]["calls_per_step"] > 0, name
        # the same training as one process on the whole batch
        assert result["comparisons"][name]["max_abs_loss_diff"] < 1e-3, name
    assert set(s["fsdp2_adamw"]["collective_bytes_per_step"]) == {"FSDP2 all-gather", "FSDP2 reduce-scatter"}
    zen = s["fsdp2_zenflow"]
    moved = zen["collective_bytes_per_step"]
    assert 0 < 100 * moved["selection scores"] < moved["FSDP2 reduce-scatter"]
    assert 0 < moved["gradient norm"] < moved["selection scores"]
    # ZenFlow's own count of its collectives is what the shims saw on the groups that are not FSDP2's
    assert zen["zenflow"]["shim_bytes_total_other_groups"] == sum(zen["zenflow"]["collective_bytes_total"].values())
    one_host, two_host = s["one_zenflow"]["zenflow"]["host_bytes_per_rank"], zen["zenflow"]["host_bytes_per_rank"]
    assert len(two_host) == 2 and max(h["total"] for h in two_host) < 0.6 * one_host[0]["total"]
    assert zen["zenflow"]["selections"] == 1 and zen["zenflow"]["host_updates"] == steps // 4


@pytest.mark.parametrize("args, fragment", [(["--configs", "one_adamw,sgd"], "--configs"),
                                            (["--steps", "0"], "--steps"), (["--adamw", "slow"], "--adamw")],
                         ids=["config", "steps", "adamw"])
def test_fsdp2_rejects_bad_options(tmp_path, args, fragment):
    proc = run_main("bench.fsdp2", *args, "--out", str(tmp_path))
    assert_one_line_error(proc, "error:", fragment)
    assert not list(tmp_path.glob("*.json"))


# -- bench.overlap, bench.overlap_gpu ------------------------------------------------------------------------


def test_overlap_quick(tmp_path):
    """Both quick sizes (1x and 12x the modeled fold job), both bandwidths, every variant, in fresh processes: the
    JSON's structure, the PNG, and what holds whatever the speed: every modeled copy took at least its bytes
    over the bandwidth (so the d2h lane inside backward can only be a share of it), hand-over on for the
    default variant and off for at_step, the gradient bytes crossing the same for both, the folds timed."""
    proc = run_module("bench.overlap", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "overlap_cpu.json").read_text())
    assert (tmp_path / "overlap_cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert result["machine"]["python"] and result["config"]["quick"] is True
    rows = result["rows"]
    assert {(r["size"], r["bandwidth"], r["variant"]) for r in rows} == {
        (s, b, v) for s in (1, 12) for b in ("pcie", "slow") for v in ("handover", "at_step")}
    assert [s["times_fold"] >= s["size"] * 0.9 for s in result["sizes"]] == [True, True]
    for r in rows:
        assert r["wall_s"] > 0 and r["free_wall_s"] > 0 and r["backward_s"] > 0, r
        assert r["fold_s"] > 0 and r["fold_wait_s"] >= 0, r
        assert math.isfinite(r["added_stall_s"]) and r["transfer_s"] > 0 and r["hidden_share"] >= 0, r
        assert r["handover"] == ("off" if r["variant"] == "at_step" else "on"), r
        if r["variant"] == "at_step":
            assert r["d2h_bytes_in_backward"] == 0, r
        else:
            assert r["d2h_bytes_in_backward"] > 0, r
    for (size, bw), group in itertools.groupby(sorted(rows, key=lambda r: (r["size"], r["bandwidth"])),
                                               key=lambda r: (r["size"], r["bandwidth"])):
        assert len({r["d2h_bytes"] for r in group}) == 1, (size, bw)
    assert {"handover", "at_step"} <= set(result["timelines"])
    assert set(result["summary"]) == {f"{b}/{v}" for b in ("pcie", "slow") for v in ("handover", "at_step")}


def test_overlap_model_keeps_its_gradients_out_of_the_subnormal_range():
    """bench.overlap's MLP at the depth of its largest size (256 layers): every layer's weight gradient has no
    subnormal entry and a norm within 10^3 of the last layer's. (With torch's default init the gradient shrinks
    about 0.4x a layer and crosses the subnormal range near layer 170, where backward runs ~100x slower per layer:
    the 64x size's gradients then came in a burst at the end of backward.)"""
    import torch

    from bench.overlap import build_model

    model = build_model(256, 512)
    x, y = torch.randn(32, 512, generator=torch.Generator().manual_seed(0)), torch.zeros(32, 512)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [m.weight.grad for m in model if isinstance(m, torch.nn.Linear)]
    tiny = torch.finfo(torch.float32).tiny
    subnormal = [i for i, g in enumerate(grads) if ((g != 0) & (g.abs() < tiny)).any()]
    assert not subnormal, subnormal[:5]
    norms = torch.stack([g.norm() for g in grads])
    assert torch.isfinite(norms).all() and (norms / norms[-1]).min() > 1e-3 and (norms / norms[-1]).max() < 1e3, norms


def test_overlap_gpu_runs_its_code_path_on_cpu(tmp_path):
    """bench.overlap_gpu is for a lent GPU (bench/gpu_suite.sh); on CPU with --device cpu --quick the same code
    runs every variant end to end (nothing is hidden on CPU: the JSON's structure only)."""
    proc = run_module("bench.overlap_gpu", "--device", "cpu", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "overlap_gpu.json").read_text())
    assert [r["run"] for r in result["runs"]] == ["adamw", "offload", "zenflow", "zenflow_at_step"]
    for r in result["runs"]:
        assert r["ms_per_step"] > 0 and math.isfinite(r["loss"]), r
    assert result["config"]["device"] == "cpu" and result["config"]["params"] > 0
    assert 0 < result["config"]["pinned_bytes_per_s"] < math.inf and result["config"]["transfer_ms"] > 0
    for r in result["runs"][1:]:  # (the synchronous CPU link adds on the training thread: no fold job)
        assert r["fold_ms_per_step"] == 0, r
    proc = run_main("bench.overlap_gpu", "--out", str(tmp_path / "gpu"))
    if not __import__("torch").cuda.is_available():
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout


# -- bench.fingerprint --------------------------------------------------------------------------------------


def test_fingerprint_quick(tmp_path):
    """The quick run: every size and dtype, the four candidates timed on one tensor, the JSON's structure and
    what holds at any speed (positive times; the ratios are their quotients); the PNG; --device cuda without a
    GPU is a one-line error."""
    proc = run_module("bench.fingerprint", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "fingerprint_cpu.json").read_text())
    assert (tmp_path / "fingerprint_cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert result["machine"]["python"] and result["config"]["device"] == "cpu"
    rows = result["rows"]
    assert {(r["n"], r["dtype"]) for r in rows} == {(n, d) for n in (1 << 16, 1 << 18) for d in ("float32", "bfloat16")}
    for r in rows:
        for name in ("fingerprint", "read", "copy", "fold"):
            assert r[f"{name}_s"] > 0 and r[f"{name}_gbps"] == pytest.approx(r["bytes"] / r[f"{name}_s"] / 1e9), r
        assert r["fingerprint_over_read"] == pytest.approx(r["fingerprint_s"] / r["read_s"])
        assert r["check_over_crossing"] == pytest.approx(2 * r["fingerprint_s"] / r["copy_s"])
    if not __import__("torch").cuda.is_available():
        proc = run_main("bench.fingerprint", "--device", "cuda", "--out", str(tmp_path / "gpu"))
        assert_one_line_error(proc, "error:", "no CUDA device")


# -- bench.nvme ---------------------------------------------------------------------------------------------


def _padded(numel: int) -> int:
    from zenflow_kernels.host import ALIGN

    return math.ceil(numel / ALIGN) * ALIGN


def _check_nvme_storage(result: dict) -> None:
    """The storage pass at 1 M parameters: every pass moved twice the file's bytes, the rates are what bytes
    over seconds give."""
    assert result["sizes_m"] == [1]
    assert [r["mode"] for r in result["results"]] == ["buffered", "direct"]
    for r in result["results"]:
        if "skipped" in r:
            assert r["mode"] == "direct", r  # a filesystem without O_DIRECT: named, not failed
            continue
        assert r["file_bytes"] == 12 * (1 << 20) and r["traffic_bytes"] == 2 * r["file_bytes"]
        for name in ("roofline", "streamed"):
            p = r[name]
            assert p["best_s"] == min(p["seconds"]) > 0
            assert math.isclose(p["gb_per_s"], r["traffic_bytes"] / p["best_s"] / 1e9)
        assert math.isclose(r["streamed_over_roofline"], r["roofline"]["best_s"] / r["streamed"]["best_s"])
        # the page cache's growth is the whole machine's (other processes' files too): reported, not asserted
        assert all(g is None or isinstance(g, int) for g in r["streamed"]["cache_growth_bytes"]), r


def _check_nvme_run_memory(run: dict) -> None:
    """host_bytes() of a run against its parameters' shapes: the master and moments on disk (whole blocks of
    12 bytes an element) or in memory, the accumulation buffers, device_accumulation's sums."""
    d, layers = run["d"], run["layers"]
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)] * layers
    padded = sum(_padded(math.prod(s)) for s in shapes)
    assert run["params"] == sum(math.prod(s) for s in shapes) and run["padded_numel"] == padded
    hb, block = run["host_bytes"], run["block_numel"]
    # devacc (overlapped) on disk: no host accumulation buffer, two device buffers, three blocks to fetch into
    stay = run["config"] == "devacc" and run["offload"] == "nvme"
    num_acc = 0 if stay else 2 if run["config"] == "overlap" else 1
    assert hb["accumulation"] == 4 * padded * num_acc
    assert hb["device_sums"] == (4 * padded * (2 if stay else 1) if run["config"] == "devacc" else 0)
    assert hb.get("sums_blocks", 0) == (3 * 4 * min(block, padded) if stay else 0)
    assert hb["total"] == sum(hb.get(k, 0) for k in ("master", "exp_avg", "exp_avg_sq", "accumulation", "copy_out",
                                                     "landing", "sums_blocks"))
    if run["offload"] == "nvme":
        assert hb["master"] == hb["exp_avg"] == hb["exp_avg_sq"] == 0
        assert block == 1 << 20 and hb["disk"] == 12 * math.ceil(padded / block) * block
        roof, hu = run["host_update"]["disk_roofline"], run["host_update"]
        assert roof["file_bytes"] == hb["disk"] and roof["best_s"] == min(roof["seconds"]) > 0
        assert math.isclose(hu["roofline_over_last"], roof["best_s"] / hu["last_s"])
    else:
        assert hb["master"] == hb["exp_avg"] == hb["exp_avg_sq"] == 4 * padded and "disk" not in hb
    rss = run["rss"]
    assert rss["device_side"] == hb["fast_state"] + hb["device_sums"]
    assert rss["host_side_growth"] == rss["growth_over_run"] - rss["device_side"]
    assert math.isclose(rss["growth_per_param"], rss["growth_over_run"] / run["params"])


def _check_nvme_run_steps(run: dict) -> None:
    """Steps, boundaries and host updates agree with the run's update_interval."""
    tm, interval = run["times"], run["update_interval"]
    assert run["steps"] == 2 * interval and len(tm["step_s"]) == len(tm["boundary"]) == run["steps"]
    assert sum(tm["boundary"]) == run["steps"] // interval == run["stats"]["host_updates"]
    assert tm["boundary"][interval - 1] and tm["boundary"][-1]  # the last step is a boundary, flush() follows
    assert run["host_update"]["count"] == len(run["host_update"]["seconds"]) == run["stats"]["host_updates"]
    assert math.isclose(tm["mean_step_s"], sum(tm["step_s"][1:]) / (run["steps"] - 1))
    assert finite([tm["cold_first_step_s"], tm["boundary_mean_s"], tm["between_mean_s"], tm["flush_s"]])
    cache = run["page_cache"]
    assert all(v is None or isinstance(v, int) for v in cache.values()), cache


def _check_nvme_summaries(result: dict) -> None:
    runs = result["runs"]
    configs = result["run_config"]["configs"]
    assert result["skipped_runs"] == [] and result["billion"] == []  # tiny sizes, no 1 B run
    assert {(r["config"], r["offload"]) for r in runs} == {(c, o) for c in configs for o in ("nvme", "cpu")}
    # where the state lives changes no bit of the weights
    assert {(w["config"], w["update_interval"]) for w in result["weights_identical"]} >= {(c, 4) for c in configs}
    assert all(w["identical"] for w in result["weights_identical"]), result["weights_identical"]
    for config in configs:
        disk, memory = result["memory"][f"{config} nvme"], result["memory"][f"{config} cpu"]
        assert disk["goal"] == result["run_config"]["goal_bytes_per_param"][config] and "goal" not in memory
        assert [s["size"] for s in disk["sizes"]] == result["run_config"]["run_sizes"]
        assert disk["sizes"][0]["host_buffers_reported"] < memory["sizes"][0]["host_buffers_reported"]
    assert [row["update_interval"] for row in result["stall"]] == result["run_config"]["stall_intervals"]
    for row in result["stall"]:
        assert math.isclose(row["extra_per_step_s"], row["nvme"]["mean_step_s"] - row["cpu"]["mean_step_s"])
        assert row["nvme"]["disk_roofline_s"] > 0 and row["cpu"]["disk_roofline_s"] is None
    assert len(result["page_cache"]) == len(runs)


def test_nvme_quick(tmp_path):
    """The storage pass at 1 M parameters (buffered and O_DIRECT) and whole optimizer runs at a tiny size, each
    config with the state on disk and in memory: the JSON's structure, the PNG, and what holds whatever the
    machine (the reported buffers and the state file's size from the shapes, steps and host updates from the
    update_interval, bit-identical weights on disk and in memory, the state folder gone afterwards). No speed
    is asserted."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # two of the three configs (host and device accumulation), each run a child process of its own: the suite's time
    proc = run_module("bench.nvme", "--quick", "--out", str(tmp_path), "--dir", str(state_dir), "--headroom-gib", "0",
                      "--configs", "overlap", "devacc", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "nvme_cpu.json").read_text())
    assert (tmp_path / "nvme_cpu.png").read_bytes()[:8] == PNG_MAGIC
    assert result["machine"]["python"] and result["quick"] is True
    _check_nvme_storage(result)
    for run in result["runs"]:
        _check_nvme_run_memory(run)
        _check_nvme_run_steps(run)
    _check_nvme_summaries(result)
    assert list(state_dir.iterdir()) == []  # the bench's state files were removed

