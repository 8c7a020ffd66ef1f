"""The README is a front door that works: its first Python block runs as is on CPU and stands near the top, it
stays short, every relative link in it and in docs/ points to a file that exists, and `make demo` writes only to
an ignored folder (the committed results are refreshed on purpose, by `make bench-results`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_first_python_block_runs_as_is_within_the_first_60_lines(tmp_path):
    lines = README.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "```python")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
    assert start < 60, f"the first Python block starts at line {start + 1}"
    script = tmp_path / "quick_start.py"
    script.write_text("\n".join(lines[start + 1:end]) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user has it
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], proc.stdout  # it trains
    assert re.search(r"stall: [0-9.]+ fast columns of layer 0: \[(\d+, ){5}\d+\]", proc.stdout), proc.stdout


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 250


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_point_to_files_that_exist(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name}: {missing}"


def test_make_demo_writes_to_an_ignored_folder():
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.MULTILINE).group(1)
    out = re.search(r"--out (\S+)", demo).group(1)
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{out}/e2e.json"], cwd=ROOT)
    assert ignored.returncode == 0, f"make demo writes to {out}, which git does not ignore"
    # the committed results are made again by bench.refresh, which writes to bench/results/ (tests/test_results.py)
    assert re.search(r"^bench-results:.*\n\t.*-m bench\.refresh", makefile, re.MULTILINE)


def _sections():
    from tools.results_tables import SECTIONS

    return list(SECTIONS)


@pytest.mark.parametrize("name", _sections())
def test_the_results_tables_are_what_the_committed_results_say(name):
    """Every results table of README.md and docs/ is what tools/results_tables.py renders from its JSON today."""
    from tools import docs_results
    from tools.results_tables import SECTIONS

    path = SECTIONS[name][0]
    assert docs_results.current(path.read_text(), name) == docs_results.section(name), (
        f"{path.name}'s table {name} differs from its JSON: run python -m tools.docs_results")


def test_the_annotated_figures_in_prose_are_their_data():
    from tools import docs_results

    assert [w for page in docs_results.PAGES for w in docs_results.wrong_figures(page)] == []


def test_a_table_and_a_figure_follow_their_json(tmp_path, monkeypatch):
    """Change a result and its table changes; a figure written against it is then wrong, and one that is its
    value rounded as written (a single figure, a span of a list) is right."""
    import json
    import shutil

    from tools import docs_results, results_tables

    dirs = [tmp_path / d / "results" for d in ("bench", "studies")]
    for d in dirs:
        shutil.copytree(ROOT / d.relative_to(tmp_path), d)
    bench = dirs[0]
    demo = json.loads((bench / "e2e.json").read_text())
    demo["comparison"]["per_run"]["zenflow"]["stall_pct"] = 12.34
    (bench / "e2e.json").write_text(json.dumps(demo | {"spread": [1.64, 4.04, 2.0]}))
    monkeypatch.setattr(results_tables, "RESULT_DIRS", dirs)
    for module in (results_tables, docs_results):  # (results' links and the pages' names are relative to it)
        monkeypatch.setattr(module, "REPO", tmp_path)
    assert "| 12.3 / " in results_tables.readme()
    page = tmp_path / "page.md"
    key = "e2e.json comparison.per_run.zenflow.stall_pct"
    cases = {f"stall 12.3%<!--= {key} -->": True, f"stall 12.34%<!--= {key} -->": True,
             f"stall 12.4%<!--= {key} -->": False, f"stall 12%<!--= {key} -->": True,
             f"a (12.3x,<!--= {key} -->": True, "1.6-4.0x<!--= e2e.json spread -->": True,
             "1.6-4.1x<!--= e2e.json spread -->": False, "2.0x<!--= e2e.json spread -->": False,
             "12.3<!--= e2e.json r['comparison']['per_run']['zenflow']['stall_pct'] -->": True,
             "24.7<!--= e2e.json 2 * r['comparison']['per_run']['zenflow']['stall_pct'] -->": True,
             "1.23e1<!--= e2e.json r['comparison']['per_run']['zenflow']['stall_pct'] -->": True,
             "1.24e1<!--= e2e.json r['comparison']['per_run']['zenflow']['stall_pct'] -->": False,
             "the syntax, `x<!--= FILE EXPR -->`, quoted in code": True}
    for text, right in cases.items():
        page.write_text(f"Some prose, {text} more prose.\n")
        assert (docs_results.wrong_figures(page) == []) is right, text


def _results(name: str) -> dict:
    import json

    return json.loads((ROOT / "bench" / "results" / name).read_text())


def _tuned(workload: str, name: str) -> dict:
    """From the tuned comparison's raw runs (studies/results/tuned_{workload}.json), not its summary: the variant's
    final held-out loss over AdamW's, paired by seed, at each one's chosen rate (mean), its rate over AdamW's, and
    the top-10% share ZenFlow measured there."""
    import json
    import statistics

    data = json.loads((ROOT / "studies" / "results" / f"tuned_{workload}.json").read_text())
    best = {n: v["best_lr"] for n, v in data["summary"]["variants"].items()}

    def at_best(n):
        return {r["seed"]: r for r in data["runs"] if r["variant"] == n and r["lr"] == best[n]}

    mine, adamw = at_best(name), at_best("adamw")
    shares = [r["top10_share"] for r in mine.values() if r["top10_share"] is not None]
    return dict(ratio=statistics.fmean(mine[s]["final"] / adamw[s]["final"] for s in mine),
                worst=max(mine[s]["final"] / adamw[s]["final"] for s in mine), lr=best[name] / best["adamw"],
                top10=statistics.fmean(shares) if shares else None, seeds=len(mine))


def _doc_figures() -> list[tuple[str, str]]:
    """(doc, text it must hold) for the figures in docs/ outside the generated sections, each computed here from
    the JSON the text names (deepspeed.md's quality figures: the ablations' JSONs, as docs/benchmarks.md's table)."""
    scale = _results("scale_cpu.json")
    rss = max(abs(r["rss"]["growth_over_run"] - r["rss"]["reported"]) / r["params"] for r in scale["runs"])
    fingerprint = _results("fingerprint_cpu.json")["rows"]
    fingerprint_gbps = [r["fingerprint_gbps"] for r in fingerprint]
    at16 = {r["dtype"]: r["fingerprint_s"] / r["fold_s"] for r in fingerprint if r["n"] == 1 << 24}
    zero = _results("zero_cpu.json")["summary"]["2"]["collective_bytes_per_step"]
    suite = (ROOT / "bench" / "gpu_suite.sh").read_text()
    budgets = sum(int(n) for n in re.findall(r"^\s*stage \w+ (\d+) ", suite, re.MULTILINE))
    ratios = {n: " ".join(f"{_tuned(w, n)['ratio']:.2f}x" for w in ("study_flat", "study_concentrated",
                                                                      "gpt_finetune"))
              for n in ("deepspeed", "zenflow", "host_step_count", "reselect_state", "lr_times_interval")}
    return [
        ("deepspeed.md", "All six choices together** end at {}, {} and {}, where ours end at {}, {} and {}.".format(
            *ratios["deepspeed"].split(), *ratios["zenflow"].split())),
        ("deepspeed.md", f"best learning rate is {_tuned('study_concentrated', 'deepspeed')['lr']:.2g}x AdamW's"),
        ("deepspeed.md", "helps with the energy flat, {} against our {}".format(
            ratios["host_step_count"].split()[0], ratios["zenflow"].split()[0])),
        ("deepspeed.md", "and not otherwise: {} against {} concentrated, {} against {} on the byte GPT".format(
            *(ratios[n].split()[w] for w in (1, 2) for n in ("host_step_count", "zenflow")))),
        ("deepspeed.md", "where ours keeps falling up to {:.0f}x that rate".format(
            _tuned("study_concentrated", "zenflow")["lr"] / _tuned("study_concentrated", "deepspeed")["lr"])),
        ("deepspeed.md", "hurts: {}, {} and {}".format(*ratios["reselect_state"].split())),
        ("deepspeed.md", f"(its best rate {_tuned('study_concentrated', 'reselect_state')['lr']:.2g}x AdamW's with the "
                         "gradient concentrated)"),
        ("deepspeed.md", "ends at {} with the energy flat, the best of ZenFlow's AdamW variants there, but {} with it "
                         "concentrated and {} on the byte GPT".format(*ratios["lr_times_interval"].split())),
        ("torchrun.md", f"the matrices' gradients {zero['gradients'] / 1e6:.2f} MB a step, the selected columns' "
                        f"{zero['selected columns'] / 1e3:.0f} KB, the write-back {zero['write-back'] / 1e3:.0f} KB"),
        ("benchmarks.md", f"(numba, {min(fingerprint_gbps):.0f}-{max(fingerprint_gbps):.0f} GB/s: "
                          "`bench/results/fingerprint_cpu.json`"),
        ("design.md", f"host fingerprint takes {at16['float32']:.2f}x (fp32) and {at16['bfloat16']:.2f}x (bf16) the "
                      "fold's time"),
        ("benchmarks.md", f"RSS grows within {rss:.2f} bytes per parameter of the report in each run of"),
        ("testing.md", f"its stage budgets add up to {budgets} s"),
    ]


def _notebook_output(name: str) -> str:
    """The text a committed notebook printed in its saved (full) run."""
    import json

    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    text = lambda t: t if isinstance(t, str) else "".join(t)  # noqa: E731
    return "".join(text(o["text"]) for c in nb["cells"] for o in c.get("outputs", []) if o["output_type"] == "stream")


def _notebook_figures() -> list[str]:
    """docs/benchmarks.md's figures from the notebooks (its Ablations list), each computed here from what the
    notebook it links printed in its saved run."""
    def grab(pattern: str, text: str) -> list[float]:
        found = re.search(pattern, text)
        assert found, pattern
        return [float(g) for g in found.groups()]

    dyn = _notebook_output("selection_dynamics")
    top1, = grab(r"top 1% of columns: ([\d.]+)%", dyn)
    top10, = grab(r"top 10% of columns: ([\d.]+)% on average", dyn)
    near, rand = grab(r"sets +1 step\(s\) apart: Jaccard ([\d.]+) \(random sets: ([\d.]+)\)", dyn)
    succ, = grab(r"successive selections \(10 steps apart\): Jaccard ([\d.]+) mean", dyn)
    pol = _notebook_output("selection_policy")
    gap = {name: grab(rf"{re.escape(name)} +gap to AdamW ([+-][\d.]+) \(seeds ([+-][\d.]+)\.\.([+-][\d.]+)\)", pol)
           for name in ("top-k by l2", "top-k by l1", "random", "first k", "topk_ratio=0")}
    floor = {name: grab(rf"{re.escape(name)} +gap to AdamW .*?, (\d+)% of the floor's gap; l2 energy at selection "
                        r"([\d.]+)%", pol) for name in ("top-k by l2", "random")}
    per_seed = re.search(r"random - l2, per seed: ([^(]*)\(", pol)  # how much l2 is ahead of random, per seed
    assert per_seed, "selection_policy prints random - l2 per seed"
    ahead = [float(v) for v in per_seed.group(1).replace(",", " ").split()]
    model = _notebook_output("timeline_model")
    host, gpu = grab(r"model: ([\d.]+)x \(host accumulation\), ([\d.]+)x \(GPU accumulation\)", model)
    cost, = grab(r"Adam cost ratio = ([\d.]+)", model)
    g = lambda name, k=0: f"{gap[name][k]:+.4f}"  # noqa: E731
    return [
        f"the top 10% of columns carry {top10:.0f}% of the gradient energy (top 1%: {top1:.1f}%), and top-10% sets "
        f"one step apart overlap with Jaccard {near:.2f} against {rand:.2f} for random sets (successive selections "
        f"10 steps apart: {succ:.2f})",
        f"top-k by l2 {g('top-k by l2')} ({g('top-k by l2', 1)}..{g('top-k by l2', 2)}), l1 {g('top-k by l1')}, "
        f"random columns {g('random')} ({g('random', 1)}..{g('random', 2)}), a fixed set (the first k columns, "
        f"never re-selected) {g('first k')}, no fast columns (`topk_ratio=0`) {g('topk_ratio=0')}",
        f"The l2 columns hold {floor['top-k by l2'][1]:.0f}% of the gradient energy when chosen, random ones "
        f"{floor['random'][1]:.0f}%",
        "Choosing by gradient norm wins " + ("on every seed" if all(v > 0 for v in ahead) else
                                             f"on average but not on every seed (on {sum(v > 0 for v in ahead)} of "
                                             f"{len(ahead)})"),
        f"already removes {100 - floor['random'][0]:.0f}% of the no-fast-path gap (l2: "
        f"{100 - floor['top-k by l2'][0]:.0f}%)",
        f"a modelled {host:.1f}x speed-up at `update_interval=4` with host-side accumulation",
        f"is measured when the notebook runs, {cost:.2f} this time), {gpu:.1f}x if the gradient is accumulated on "
        "the GPU",
    ]


def _notebook_markdown(name: str) -> str:
    """A committed notebook's markdown cells, whitespace collapsed (line breaks as spaces)."""
    import json

    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    return " ".join(" ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown").split())


def _notebook_text_figures() -> list[tuple[str, str]]:
    """(notebook, text its markdown must hold): the figures the notebooks' own text quotes from their saved runs
    (concentration, selection_policy, update_rules; tuned_comparison's sweep hours), each computed here from what the
    notebook printed or the JSON it reads."""
    import json

    pct = lambda x: f"{100 * float(x):.0f}%"  # noqa: E731
    out = []

    # concentration: the table of levels (alpha, top 1%, top 10%, selected, overlap, no overlap, AdamW end/half)
    conc = _notebook_output("concentration")
    table = [line.split() for line in conc.splitlines() if re.fullmatch(r"\s*[\d.]+(\s+[\d.]+){6}\s*", line)]
    assert len(table) == 5, conc
    top10, selected, recovered = ([float(r[i]) for r in table] for i in (2, 3, 4))
    assert max(abs(a - b) for a, b in zip(top10, selected, strict=True)) <= 0.01 + 1e-9  # "within 0.01 of `top 10%`"
    half = [float(r[6]) for r in table]
    out += [("concentration", f"(the top 10% of columns hold {pct(top10[0])} of it: the first layer's flat columns "
                              f"plus the second layer), ZenFlow recovers {pct(recovered[0])} of AdamW's improvement at "
                              f"equal steps; at {pct(top10[1])} in the top 10%, {pct(recovered[1])}; " +
                              "; ".join(f"at {pct(a)}, {pct(b)}" for a, b in zip(top10[2:], recovered[2:],
                                                                                  strict=True))),
            ("concentration", f"its final held-out loss is {min(half):.2f}-{max(half):.2f} of its loss at half the "
                              "steps")]
    study = json.loads((ROOT / "studies" / "results" / "concentration_study.json").read_text())["summary"]
    assert all(hi - lo <= 0.01 for level in study for k in ("zenflow_overlap_recovered_range",
                                                            "zenflow_sync_recovered_range")
               for lo, hi in [level[k]])  # "The seeds agree within 0.01 at every level"
    hours = sum(json.loads(p.read_text())["runs_s"]
                for p in (ROOT / "studies" / "results").glob("tuned_*.json")) / 3600
    out.append(("tuned_comparison", f"The sweeps take about {hours:.1f} hours of training on two cores (the `runs_s` "
                                    "of the four JSONs)"))
    first, = re.findall(r"topk_ratio=0\.1 .*first selection held (\d+)% of the gradient energy",
                        _notebook_output("topk_ratio"))
    out.append(("concentration", f"(its first selection held {first}% of the energy in its top 10%)"))

    # selection_policy: its printed comparison
    pol = _notebook_output("selection_policy")
    line = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(top-k by l2|top-k by l1|random|first k|topk_ratio=0) +[\d.]+ +[\d.-]+ +([+-][\d.]+) +\(([+-][\d.]+)\.\."
        r"([+-][\d.]+)\)(?: +([\d.]+)% +([\d.]+)% +[\d.]+ +([\d.]+))?", pol, re.M)}
    floor = dict(re.findall(r"^(top-k by l2|random) +gap to AdamW .*?, (\d+)% of the floor's gap", pol, re.M))
    ahead = re.search(r"random - l2, per seed: ([^(]*?) \(", pol).group(1)
    diffs = [float(v) for v in ahead.split(", ")]
    sync, = re.findall(r"sync offload against AdamW: largest held-out difference over the seeds ([\d.e+-]+)", pol)
    l2, rnd, l1, fixed = line["top-k by l2"], line["random"], line["top-k by l1"], line["first k"]
    assert round(float(l2[3]) / float(rnd[3])) == 3 and 0.15 < 1 - float(l2[0]) / float(rnd[0]) < 0.25  # "three
    # times the energy buys a gap about a fifth smaller"
    out += [("selection_policy", f"top-k by l2 {l2[0]} nats/byte (seeds {l2[1]}..{l2[2]}), random columns {rnd[0]} "
                                 f"({rnd[1]}..{rnd[2]}); l2 is ahead on {sum(v > 0 for v in diffs)} of the "
                                 f"{len(diffs)} seeds (random - l2: {ahead})"),
            ("selection_policy", f"The l2 columns hold {l2[3]}% of the gradient energy when chosen ({l2[4]}% on "
                                 f"average until the next selection), random ones {rnd[3]}%"),
            ("selection_policy", f"`l1` cannot be told from `l2` ({l1[0]}; its selections overlap l2's with Jaccard "
                                 f"{float(l1[5]):.2f})"),
            ("selection_policy", f"(`topk_ratio=0`) the gap is {line['topk_ratio=0'][0]}; a random 10%, re-drawn every "
                                 f"10 steps, already removes {100 - int(floor['random'])}% of it, top-k by l2 "
                                 f"{100 - int(floor['top-k by l2'])}%"),
            ("selection_policy", f"end at {fixed[0]} ({fixed[1]}..{fixed[2]}), behind random columns re-drawn every 10 "
                                 f"steps. They hold {fixed[3]}% of the energy"),
            ("selection_policy", f"(largest difference {float(sync):.1e} over the seeds)".replace("e-0", "e-")),
            ("selection_policy", "(top 10% of the columns: {:.0f}% of the energy".format(*(
                float(v) for v in re.findall(r"top 10% of columns: ([\d.]+)% on average",
                                             _notebook_output("selection_dynamics")))))]

    # update_rules: the sweep's picks, the comparison at the picks, the extra runs, bf16
    rules = _notebook_output("update_rules")
    short = lambda lr: re.sub(r"e-0(\d)", r"e-\1", lr)  # noqa: E731  (1e-03 as 1e-3)
    pick = {m[0]: short(m[1]) for m in re.findall(r"^(AdamW|Adam|Lion|SGD) .* (\de-\d\d)$", rules, re.M)}
    main = {m[0]: m[1:] for m in re.findall(
        r"^(AdamW|Adam|Lion|SGD) +\S+ +[\d.]+ \+- ([\d.]+) +[\d.]+ \+- ([\d.]+) +(-?\d+)% +([\d.]+) +([\d.]+) ms +"
        r"[\d.]+ +([\d.]+)$", rules, re.M)}
    gain = {m[0]: m[1:] for m in re.findall(r"^(AdamW|Adam|Lion|SGD) +lr \S+: plain improves held-out by \+([\d.]+), "
                                            r"ZenFlow by ([+-][\d.]+)", rules, re.M)}
    extra = {m[0]: m[1:] for m in re.findall(  # lr, ZenFlow, no overlap's %, one lr lower, its ZenFlow and %
        r"^(AdamW|Adam|Lion|SGD) +(\S+) +[\d.]+ +([\d.]+) +\S+ +[\d.]+ +(\S+)% +(\S+) +[\d.]+ +([\d.]+) +(\S+)$",
        rules, re.M)}
    peak, = re.findall(r"along the ZenFlow runs \(mean of seeds\): AdamW [\d.]+ \(\+([\d.]+) vs the start\)", rules)
    bf16 = re.findall(r"^(AdamW|Lion) +(fp32|bf16) +[\d.]+ \+- ([\d.]+) +([\d.]+) ", rules, re.M)
    train = re.findall(r"largest per-step train-loss difference, seed 0: ([\d.e+-]+)", rules)
    params, updates = re.search(r"the host holds ([\d,]+) of the [\d,]+ parameters; (\d+) host updates", rules).groups()
    sds = [float(v) for r in ("AdamW", "Adam", "Lion") for v in main[r][:2]]
    b16_sds = [float(b[2]) for b in bf16]
    loads = [float(v[-1]) for v in main.values()] + [float(v) for v in re.findall(
        r"^(?:AdamW|Lion) +(?:fp32|bf16) .* ms +([\d.]+)$", rules, re.M)]
    times = [float(v[4]) for v in main.values()]
    assert min(times) > 0.5 and max(times) < 3.5  # "about 1-3 ms per update"
    assert max(float(main["SGD"][i]) for i in (0, 1)) < 0.001  # "standard deviations under 0.001"
    assert float(gain["AdamW"][0]) - float(gain["Lion"][0]) < 0.001  # "AdamW and Lion: 0.100"
    e = lambda x: short(f"{float(x):.0e}")  # noqa: E731
    out += [("update_rules", f"AdamW {pick['AdamW']}, Adam {pick['Adam']}, Lion {pick['Lion']} (about 3x below "
                             f"AdamW's, as usual for Lion), SGD {pick['SGD']}"),
            ("update_rules", f"its best plain run improves the held-out loss by {float(gain['SGD'][0]):.3f} (AdamW and "
                             f"Lion: {float(gain['AdamW'][0]):.3f})"),
            ("update_rules", "AdamW recovers {}% of plain AdamW's {:.3f}, Lion {}% of its {:.3f}, Adam {}% of its "
                             "{:.3f}".format(*(v for r in ("AdamW", "Lion", "Adam")
                                               for v in (main[r][2], float(gain[r][0]))))),
            ("update_rules", f"(standard deviations {min(sds):.4f}-{max(sds):.4f})"),
            ("update_rules", f"(AdamW's by {float(peak):.3f} above the start at its highest"),
            ("update_rules", f"ZenFlow recovers {main['SGD'][2]}% of its small gain ({float(gain['SGD'][1]):.4f} of "
                             f"{float(gain['SGD'][0]):.4f}"),
            ("update_rules", f"recovers {extra['AdamW'][2]}%, and with overlap at {short(extra['AdamW'][3])} ZenFlow "
                             f"recovers {extra['AdamW'][5]} of plain AdamW's gain at {short(extra['AdamW'][3])} and "
                             f"ends lower ({extra['AdamW'][4]}) than ZenFlow at {short(extra['AdamW'][0])} "
                             f"({extra['AdamW'][1]})"),
            ("update_rules", f"Without overlap Lion recovers only {extra['Lion'][2]}% at {short(extra['Lion'][0])}; at "
                             f"{short(extra['Lion'][3])} with overlap it recovers {extra['Lion'][5]}"),
            ("update_rules", f"AdamW and Adam {main['AdamW'][3]} bytes per parameter"),
            ("update_rules", f"Lion and SGD with momentum {main['Lion'][3]} (one moment). The host holds all {params} "
                             "parameters"),
            ("update_rules", f"the 1-minute load average was {min(loads):.1f}-{max(loads):.1f} on 2 CPUs"),
            ("update_rules", "saves 4 bytes per parameter for AdamW ({:.0f} to {:.0f}) and 2 for Lion ({:.0f} to "
                             "{:.0f})".format(*(float(b[3]) for b in bf16))),
            ("update_rules", f"(standard deviation over seeds {min(b16_sds):.4f}-{max(b16_sds):.4f})"),
            ("update_rules", f"differ by at most {e(train[0])} (AdamW) and {e(train[1])} (Lion"),
            ("update_rules", f"In these runs the host takes {updates} steps")]
    assert extra["AdamW"][4] < extra["AdamW"][1] and extra["Lion"][4] < extra["Lion"][1]  # "a 3x lower rate did
    # better under ZenFlow for AdamW and Lion (seed 0)"
    return out


def test_the_notebooks_text_quotes_their_saved_runs():
    """The figures the notebooks' markdown quotes from their own saved outputs are what those outputs say (a
    notebook run again with other results fails this until its text follows)."""
    missing = [f"{name}: {text!r}" for name, text in _notebook_text_figures() if text not in _notebook_markdown(name)]
    assert not missing, "\n".join(missing)


def test_notebook_figures_in_the_docs_are_what_the_notebooks_printed():
    """docs/benchmarks.md's Ablations list quotes the saved notebooks: each figure is recomputed here from the
    output it comes from (a notebook run again with other results fails this until the text follows)."""
    page = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    missing = [text for text in _notebook_figures() if text not in page]
    assert not missing, missing


def _readme_figures() -> list[str]:
    """The README's figures outside its generated section: the tuned comparison's (from its raw runs) and the
    demo's time."""
    r = _tuned
    flat, conc, gpt = (lambda n, w=w: r(w, n) for w in ("study_flat", "study_concentrated", "gpt_finetune"))
    return [
        f"ended at {conc('zenflow')['ratio']:.2f}x tuned AdamW's final held-out loss on an MLP whose top 10% of "
        f"columns held {conc('zenflow')['top10']:.0%} of the gradient's energy, {flat('zenflow')['ratio']:.2f}x with "
        f"the energy flat ({flat('zenflow')['top10']:.0%}), and {gpt('zenflow')['ratio']:.2f}x fine-tuning a byte GPT "
        "on a new corpus.",
        f"ended at {flat('lr_times_interval')['ratio']:.2f}x with the energy flat but "
        f"{conc('lr_times_interval')['ratio']:.2f}x with it concentrated",
        f"at {flat('deepspeed')['ratio']:.2f}x and {conc('deepspeed')['ratio']:.2f}x.",
        f"(ZenFlow's SGD did on the flat MLP, {flat('zenflow_sgd')['ratio']:.2f}x, where plain SGD ends at "
        f"{flat('sgd')['ratio']:.2f}x)",
        "`topk_ratio` 0.05, `update_interval` 2, re-selection every 4 steps "
        "({:.2f}x, {:.2f}x, {:.2f}x, {:.2f}x;".format(
            *(_tuned(w, "topk0.05_ui2")["ratio"] for w in ("study_flat", "study_concentrated", "gpt_finetune",
                                                            "gpt_classify"))),
        f"its run took {_results('e2e.json')['total_s']:.0f} s in bench/results/e2e.json",
    ]


def test_the_readmes_verdicts_on_the_tuned_comparison_hold_on_its_runs():
    """"No ZenFlow variant of AdamW ended below tuned AdamW on every seed of any workload (ZenFlow's SGD did on the
    flat MLP), and one setting beat it [the base setting] on all four workloads": checked on every variant of the raw
    runs."""
    import json

    below, wins = [], {}
    paths = sorted((ROOT / "studies" / "results").glob("tuned_*.json"))
    for path in paths:
        data = json.loads(path.read_text())
        workload, variants = data["summary"]["workload"], data["summary"]["variants"]
        for name, v in variants.items():
            if name in ("adamw", "offload", "lion", "sgd"):
                continue
            if _tuned(workload, name)["worst"] < 1:
                below.append((workload, name))
            if v["family"] == "adam" and name != "zenflow":
                wins.setdefault(name, []).append(_tuned(workload, name)["ratio"] < _tuned(workload, "zenflow")["ratio"])
    assert below == [("study_flat", "zenflow_sgd")], below
    # of the variants run on all four workloads, one beats the base setting on all four
    assert len(paths) == 4 and [n for n, w in wins.items() if len(w) == 4 and all(w)] == ["topk0.05_ui2"], wins
    assert _tuned("gpt_finetune", "topk0.05_ui2")["ratio"] / _tuned("gpt_finetune", "zenflow")["ratio"] > 0.99
    # run on the two MLP workloads only, gradient_scale wins on both, by under 1% (noise, not quoted)
    assert {n for n, w in wins.items() if len(w) == 2 and all(w)} == {"gradient_scale"}, wins
    assert max(_tuned(w, "gradient_scale")["ratio"] / _tuned(w, "zenflow")["ratio"]
               for w in ("study_flat", "study_concentrated")) > 0.99


def test_the_suite_time_the_readme_states_is_the_recorded_one():
    """The README's `make test` line gives the suite's time as bench/results/suite_time.json recorded it (whole
    minutes of make test's wall time, the install not counted) and that run passed."""
    result = _results("suite_time.json")
    assert result["returncode"] == 0 and result["counts"]["passed"] > 0, result["log_tail"][-2000:]
    minutes = round(result["wall_s"] / 60)
    first_lines = "\n".join(README.splitlines()[:8])
    assert f"about {minutes} minutes on 2 cores" in first_lines, (minutes, first_lines)


def test_figures_in_the_readme_are_what_their_results_say():
    page = " ".join(README.split())
    missing = [text for text in _readme_figures() if text not in page]
    assert not missing, missing


def test_figures_in_the_docs_are_what_their_results_say():
    """The docs' figures outside the generated sections that name their JSON (RSS against host_bytes(), the
    fingerprint's rates, the collective bytes): recomputed here from those JSONs."""
    missing = []
    for doc, text in _doc_figures():
        page = " ".join((ROOT / "docs" / doc).read_text().split())  # (line breaks as spaces)
        if text not in page:
            missing.append(f"{doc}: {text!r}")
    assert not missing, "\n".join(missing)
