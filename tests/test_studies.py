"""The studies (studies/): the tuned comparison's sweep, target and summary worked by hand on made-up runs, its
reference Lion against the paper's arithmetic, a quick run of each kind of workload, the time-to-target table's
arithmetic, and a quick run of the concentration study (tests/test_deepspeed_semantics.py: the DeepSpeed replay)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from studies import concentration_study as cs
from studies import time_to_target as ttt
from studies import tuned_comparison as tc

REPO = Path(__file__).resolve().parents[1]


def test_value_at_and_steps_to_read_the_curve_linearly():
    curve = [[0, 1.0], [10, 0.6], [20, 0.4], [30, 0.5]]
    assert tc.value_at(curve, 5) == pytest.approx(0.8)
    assert tc.value_at(curve, 25) == pytest.approx(0.45)
    assert tc.steps_to(curve, 0.5) == pytest.approx(15.0)  # first crossing, between 10 and 20
    assert tc.steps_to(curve, 1.0) == 0.0
    assert tc.steps_to(curve, 0.3) is None  # never reached
    assert tc.steps_to(curve, 0.4 * (1 - 1e-7)) == 20.0  # float noise above the target counts as met
    with pytest.raises(ValueError, match="step=40 is outside"):
        tc.value_at(curve, 40)


class FakeSweep(tc.Sweep):
    """A sweep whose runs are a parabola in log2(lr) around ``best_lr``, plus a per-seed offset: no training."""

    def __init__(self, best_lr, seed_offsets=None):
        super().__init__("study_flat", quick=True, log=None, resume=False)
        self.best_lr, self.seed_offsets, self.calls = best_lr, seed_offsets or {}, []

    def ensure(self, name, k, seeds):
        out = []
        for seed in seeds:
            key = (name, k, seed)
            if key not in self.runs:
                self.calls.append(key)
                lr = self.lr(name, k)
                final = 0.1 + (math.log2(lr / self.best_lr)) ** 2 + self.seed_offsets.get((k, seed), 0.0)
                self.runs[key] = dict(variant=name, k=k, seed=seed, lr=lr, final=final, error=None,
                                      curve=[[0, 2.0], [10, final]], top10_share=None, metrics={})
            out.append(self.runs[key])
        return out


@pytest.mark.parametrize("best_k", [-5, -2, 1, 3, 6])
def test_the_grid_grows_until_the_best_is_inside(best_k):
    sweep = FakeSweep(best_lr=tc.wl.WORKLOADS["study_flat"].centers["adam"] * 2.0 ** best_k)
    got = sweep.tune("adamw")
    assert got["k"] == best_k and got["inside"], got
    assert got["ks"][0] < best_k < got["ks"][-1] and set(tc.GRID) <= set(got["ks"])
    extra = {k for name, k, seed in sweep.calls if seed in tc.EXTRA_SEEDS}
    assert len(extra) == 2 and best_k in extra  # the extra seeds only at the best two


def test_a_five_seed_best_at_the_edge_grows_the_grid_again():
    # on seeds 0-2, k=2 wins inside (1, 2, 3); seeds 3 and 4 make k=3, the last point, better: the grid must grow
    center = tc.wl.WORKLOADS["study_flat"].centers["adam"]
    offsets = {(3, 3): -5.0, (3, 4): -5.0}
    sweep = FakeSweep(best_lr=center * 2.0 ** 2.4, seed_offsets=offsets)
    got = sweep.tune("adamw", grid=(1, 2, 3))
    assert got["k"] == 3 and got["inside"] and got["ks"][-1] == 4, got


def test_the_summary_at_each_variants_best_rate_by_hand():
    sweep = tc.Sweep("study_flat", quick=True, log=None, resume=False)
    sweep.tasks[0] = type("T", (), {"steps": 20})()
    curves = {  # (variant, k, seed) -> curve
        ("adamw", 0, 0): [[0, 2.0], [10, 1.0], [20, 0.5]],  # seed 0's target, at 15 steps: 0.75
        ("adamw", 0, 1): [[0, 2.0], [10, 1.2], [20, 0.6]],  # seed 1's: 0.9
        ("zenflow", 1, 0): [[0, 2.0], [10, 1.5], [20, 0.6]],  # reaches 0.75 at 10 + 10 * 0.75 / 0.9 steps
        ("zenflow", 1, 1): [[0, 2.0], [10, 1.6], [20, 0.95]],  # never reaches 0.9
    }
    for (name, k, seed), curve in curves.items():
        sweep.runs[(name, k, seed)] = dict(variant=name, k=k, seed=seed, lr=sweep.lr(name, k), final=curve[-1][1],
                                           curve=curve, error=None, top10_share=0.5 if name != "adamw" else None,
                                           metrics={})
    tuned = {"adamw": dict(k=0, ks=[0], inside=True, seeds=[0, 1]),
             "zenflow": dict(k=1, ks=[1], inside=True, seeds=[0, 1])}
    got = tc.summarise("study_flat", sweep, tuned)
    assert got["targets_per_seed"] == pytest.approx({0: 0.75, 1: 0.9})  # each seed's AdamW at 75% of 20 steps
    assert got["target"] == pytest.approx((0.75 + 0.9) / 2)
    assert got["variants"]["adamw"]["steps_to_target_per_seed"] == pytest.approx([15.0, 15.0])
    z = got["variants"]["zenflow"]
    assert z["lr_over_adamw"] == pytest.approx(2.0)
    assert z["final"]["mean"] == pytest.approx((0.6 + 0.95) / 2)
    assert z["gap_vs_adamw"]["mean"] == pytest.approx(((0.6 - 0.5) + (0.95 - 0.6)) / 2)
    assert z["final_over_adamw"]["max"] == pytest.approx(0.95 / 0.6)
    assert z["recovered"]["min"] == pytest.approx((2 - 0.95) / (2 - 0.6))
    assert z["steps_to_target_per_seed"][0] == pytest.approx(10 + 10 * (1.5 - 0.75) / (1.5 - 0.6))
    assert z["steps_to_target_per_seed"][1] is None and z["reached"] == 1
    assert z["steps_to_target"]["mean"] is None and z["steps_over_adamw"]["mean"] is None  # a seed never got there


def test_plain_lion_is_the_papers_arithmetic():
    torch.manual_seed(0)
    p0, grads = torch.randn(6), [torch.randn(6) for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = tc.PlainLion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    want, m = p0.clone().double(), torch.zeros(6, dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        g = g.double()
        want = want * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-6, atol=1e-6)


def run_quick(tmp_path, workload, *variants):
    proc = subprocess.run([sys.executable, "-m", "studies.tuned_comparison", "--workload", workload, "--quick",
                           "--out", str(tmp_path), "--variants", *variants], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "ZENFLOW_E2E_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / f"tuned_{workload}.json").read_text())


@pytest.mark.subprocess
def test_a_quick_study_run_tunes_each_variant_and_offload_is_adamw(tmp_path):
    got = run_quick(tmp_path, "study_concentrated", "offload", "zenflow")
    v = got["summary"]["variants"]
    assert set(v) == {"adamw", "offload", "zenflow"}
    # synchronous offload runs AdamW's arithmetic on the host: the same held-out losses as torch.optim.AdamW
    assert v["offload"]["best_lr"] == v["adamw"]["best_lr"]
    assert v["offload"]["gap_vs_adamw"]["max"] == pytest.approx(0.0, abs=1e-6)
    for name in ("adamw", "zenflow"):  # (the quick grid may end at an edge: it grows one point at most)
        ks = [g["k"] for g in v[name]["grid"]]
        assert v[name]["best_inside"] == (ks[0] < v[name]["best_k"] < ks[-1]) and len(ks) <= 5, v[name]
    assert v["zenflow"]["top10_share"] > 0.5  # the concentrated level: most energy in the top 10% of columns
    assert got["record"]["command"].startswith("python -m studies.tuned_comparison")
    assert (tmp_path / "tuned_study_concentrated.png").stat().st_size > 0
    runs = [json.loads(line) for line in (tmp_path / "tuned_study_concentrated.runs.jsonl").read_text().splitlines()]
    assert len(runs) == len(got["runs"]) and all(r["curve"][0][0] == 0 for r in runs)


@pytest.mark.subprocess
def test_a_quick_classification_run_reports_accuracy(tmp_path):
    got = run_quick(tmp_path, "gpt_classify", "zenflow")
    v = got["summary"]["variants"]
    assert 0.0 <= v["zenflow"]["metrics"]["accuracy"]["mean"] <= 1.0
    assert math.isfinite(v["adamw"]["final"]["mean"])


@pytest.mark.subprocess
def test_an_unknown_variant_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "studies.tuned_comparison", "--workload", "gpt_finetune",
                           "--variants", "warm_up3", "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "['warm_up3'] unknown for gpt_finetune" in proc.stderr, proc.stderr


def summary_of(ratios: dict) -> dict:
    """(exact ratio or None, the lower bound, the half target's ratio) per variant."""
    return dict(variants={n: dict(steps_over_adamw=dict(mean=r), steps_over_adamw_at_least=lb,
                                  half_steps_over_adamw=dict(mean=h)) for n, (r, lb, h) in ratios.items()})


def test_time_to_target_is_the_steps_ratio_times_the_modeled_step():
    got = ttt.table({"w": summary_of({"adamw": (1.0, 1.0, 1.0), "offload": (1.0, 1.0, 1.0),
                                      "zenflow": (1.5, 1.5, 1.2), "overlap": (None, 1.4, None)})})
    for model, params in ttt.MODELS.items():
        rows = got[f"w/{model}"]["rows"]
        base = got[f"w/{model}"]["base"]
        assert rows["zenflow"]["steps_ratio"] == pytest.approx(1.5) and not rows["zenflow"]["at_least"]
        want = 1.5 * rows["zenflow"]["step_s"] / rows[base]["step_s"]
        assert rows["zenflow"]["time_vs_" + base] == pytest.approx(want)
        assert rows["zenflow"]["half_time_vs_" + base] == pytest.approx(want * 1.2 / 1.5)
        # a seed that never reached the target: the lower bound, marked, and no figure at the half target
        assert rows["overlap"]["at_least"] and rows["overlap"]["half_time_vs_" + base] is None
        lower = 1.4 * rows["overlap"]["step_s"] / rows[base]["step_s"]
        assert rows["overlap"]["time_vs_" + base] == pytest.approx(lower)
        # every step is at least the device's compute; offload's stall is its whole host update every step
        compute = 6.0 * params * ttt.PROFILE["tokens_per_step"] / (ttt.PROFILE["device_tflops"] * 1e12)
        assert all(r["step_s"] is None or r["step_s"] >= compute for r in rows.values())
        assert rows["offload"]["step_s"] > rows["zenflow"]["step_s"]
    assert got["w/7B"]["rows"]["adamw"]["fits"]  # 112 GB of 141


COMMITTED = sorted((REPO / "studies" / "results").glob("tuned_*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.stem for p in COMMITTED])
def test_a_committed_sweep_is_its_runs_summarised_again(path, monkeypatch):
    """The committed summary is what the sweep's rules choose from the committed runs (no run missing: a run the
    choice needs and the file lacks fails), made by a clean checkout with the command it names."""
    data = json.loads(path.read_text())
    workload = data["config"]["workload"]["name"]
    assert data["record"]["clean"] and data["record"]["command"].startswith("python -m studies.tuned_comparison")
    assert not data["config"]["quick"]
    sweep = tc.Sweep(workload, quick=False, log=None, resume=False)
    for r in data["runs"]:
        sweep.runs[(r["variant"], r["k"], r["seed"])] = r
    sweep.tasks[0] = type("Task", (), {"steps": data["summary"]["steps"]})()

    def missing(*args, **kwargs):
        raise AssertionError(f"a run the committed file lacks: {args[2:]}")

    monkeypatch.setattr(tc, "run", missing)
    again = tc.study(workload, list(data["config"]["variants"]), quick=False, log=None, resume=False, sweep=sweep)
    assert json.loads(json.dumps(again)) == data["summary"]
    assert all(v["best_inside"] is not False for v in again["variants"].values())  # every best inside its grid
    assert {len(v["grid"]) for n, v in again["variants"].items() if n != "offload"} >= {6}


def test_the_demo_runs_the_tuned_comparisons_pick():
    """``make demo`` (bench.e2e --demo) runs at the byte-GPT fine-tune's tuned AdamW rate, ZenFlow at the setting that
    beat the base setting on every workload, at its own best rate there (the same)."""
    from bench.e2e import DEMO_TUNED, parser

    variants = json.loads((REPO / "studies" / "results" / "tuned_gpt_finetune.json").read_text())["summary"]["variants"]
    assert DEMO_TUNED["lr"] == pytest.approx(variants["adamw"]["best_lr"])
    pick = dict(tc.BASE_ZENFLOW, **tc.VARIANTS["topk0.05_ui2"].zenflow)
    assert (DEMO_TUNED["topk_ratio"], DEMO_TUNED["update_interval"], DEMO_TUNED["overlap"],
            DEMO_TUNED["select_interval"]) == (pick["topk_ratio"], pick["update_interval"], pick["overlap_step"],
                                               pick["select_interval"])
    assert variants["topk0.05_ui2"]["best_lr"] == pytest.approx(DEMO_TUNED["lr"])
    for name in ("study_flat", "study_concentrated", "gpt_finetune", "gpt_classify"):  # beats the base setting
        v = json.loads((REPO / "studies" / "results" / f"tuned_{name}.json").read_text())["summary"]["variants"]
        assert v["topk0.05_ui2"]["final"]["mean"] < v["zenflow"]["final"]["mean"], name
    args = parser().parse_args(["--demo"])
    assert (args.lr, args.topk_ratio, args.update_interval, args.overlap) == (None,) * 4  # filled in by main


def test_the_demos_time_to_target_reads_each_curve_and_models_its_settings():
    from bench import e2e_target

    def run(name, kind, losses, walls, zenflow=None):
        return dict(name=name, kind=kind, steps=40, zenflow=zenflow, evals=[
            dict(step=s, wall_s=w, heldout_loss=x) for s, w, x in zip((0, 10, 20, 30, 40), walls, losses, strict=True)])

    zen = dict(topk_ratio=0.05, update_interval=2, overlap_step=True, select_strategy="epoch", select_interval=1,
               steps_per_epoch=25)
    got = e2e_target.to_target([
        run("adamw", "adamw", [3.0, 2.8, 2.6, 2.4, 2.3], [0, 1, 2, 3, 4]),
        run("offload", "offload", [3.0, 2.8, 2.6, 2.4, 2.3], [0, 2, 4, 6, 8]),
        run("zenflow", "zenflow", [3.0, 2.9, 2.7, 2.5, 2.35], [0, 1, 2, 3, 4], zen),
        run("never", "zenflow", [3.0, 2.9, 2.8, 2.7, 2.6], [0, 1, 2, 3, 4], zen)])
    assert got["target"] == pytest.approx(2.4)  # AdamW's at 30 of 40 steps
    r = got["runs"]
    assert r["adamw"]["steps"] == pytest.approx(30) and r["offload"]["cpu_s"] == pytest.approx(6.0)
    assert r["zenflow"]["steps"] == pytest.approx(30 + 10 / 1.5) and r["zenflow"]["cpu_s"] == pytest.approx(3 + 1 / 1.5)
    assert r["never"]["steps"] is None and r["never"]["modeled_s"] is None
    probe = ttt.host_probe(ttt.PROFILE)
    params = ttt.MODELS[e2e_target.MODEL]
    step = ttt.zenflow_step_time(params, ttt.PROFILE, probe, zen)["step_s"]
    assert r["zenflow"]["modeled_s"] == pytest.approx((30 + 10 / 1.5) * step)
    assert step > ttt.zenflow_step_time(params, ttt.PROFILE, probe, dict(zen, steps_per_epoch=50))["step_s"]
    assert r["adamw"]["modeled_s"] == pytest.approx(30 * ttt.step_times(params, ttt.PROFILE, probe)["adamw"]["step_s"])
    text = "\n".join(e2e_target.lines({"to_target": got}))
    assert "MODELED" in text and "never: not reached" in text


def test_the_demos_target_forgives_float_noise_on_a_curve_that_is_not_monotone():
    """Sync offload (AdamW's arithmetic on other kernels) 4e-6 above AdamW's loss at the target's step, then rising:
    reached at AdamW's step, not a stretch later."""
    from bench import e2e_target

    def run(name, kind, losses):
        return dict(name=name, kind=kind, steps=40, zenflow=None, evals=[
            dict(step=s, wall_s=s / 10, heldout_loss=x) for s, x in zip((0, 10, 20, 30, 40), losses, strict=True)])

    adamw, offload = [2.6, 2.55, 2.5, 2.48326, 2.48588], [2.6, 2.55, 2.5, 2.48327, 2.48587]
    got = e2e_target.to_target([run("adamw", "adamw", adamw), run("offload", "offload", offload)])
    assert got["target"] == 2.48326 and got["runs"]["adamw"]["steps"] == 30.0
    assert got["runs"]["offload"]["steps"] == 30.0 and got["runs"]["offload"]["cpu_s"] == pytest.approx(3.0)
    assert tc.steps_to(list(zip((0, 10, 20, 30, 40), offload, strict=True)), 2.48326) is None  # (the study's 1e-6)


# -- studies.concentration_study -----------------------------------------------------------------------------------


@pytest.mark.subprocess
def test_concentration_study_quick(tmp_path):
    """Two concentration levels, one seed: the JSON's structure and what holds whatever the machine: the measured
    top-10% share rises with the exponent, AdamW improves, every recovered share is finite."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "studies.concentration_study", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "concentration_study.json").read_text())
    assert (tmp_path / "concentration_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["command"] == f"python -m studies.concentration_study --quick --out {tmp_path}"
    assert result["machine"]["python"] and result["config"]["quick"] is True
    flat, peaked = result["summary"]
    assert flat["alpha"] == 0.0 and peaked["alpha"] > 0 and flat["top10_share"] < 0.5 < peaked["top10_share"]
    for s in result["summary"]:
        assert 0 < s["top1_share"] <= s["top10_share"] <= 1 and s["adamw_improvement"] > 0
        assert all(math.isfinite(s[k]) for k in ("zenflow_overlap_recovered", "zenflow_sync_recovered"))
    assert {r["candidate"] for r in result["runs"]} == {"adamw", "zenflow_overlap", "zenflow_sync"}
    assert all(r["selections"] >= 2 for r in result["runs"] if r["candidate"] != "adamw")


def test_concentration_study_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        cs.main(["--steps", "3", "--out", str(tmp_path)])
    message = capsys.readouterr().err.strip()
    assert err.value.code == 2 and len(message.splitlines()) == 1, message
    assert "--steps" in message and "at least 8" in message
