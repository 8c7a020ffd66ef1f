"""The tables of measured results in README.md and docs/*.md, each rendered from the JSON it names
(``python -m tools.docs_results`` writes them between their markers; ``--check`` compares)."""

from __future__ import annotations

import statistics

from tools.docs_results import REPO, link, load, source, table, where  # noqa: F401

README = REPO / "README.md"
DOCS = REPO / "docs"


# -- README.md -----------------------------------------------------------------------------------------------------

def readme() -> str:
    return _old('readme')


# -- docs/benchmarks.md: kernels and host passes ------------------------------------------------------------------

def kernels_gpu() -> str:
    return _old('kernels_gpu')


def step_overhead() -> str:
    return _old('step_overhead')


def rules_step() -> str:
    return _old('rules_step')


def seam() -> str:
    return _old('seam')


def cpu_adam() -> str:
    return _old('cpu_adam')


def kernels_cpu() -> str:
    return _old('kernels_cpu')


def cpu_rules() -> str:
    return _old('cpu_rules')


def stochastic_rounding() -> str:
    return _old('stochastic_rounding')


# -- docs/benchmarks.md: whole runs (e2e, ZeRO, overlap, FSDP2, the sums' crossing) --------------------------------

def e2e() -> str:
    return _old('e2e')


def zero() -> str:
    return _old('zero')


def overlap() -> str:
    return _old('overlap')


def fsdp2() -> str:
    return _old('fsdp2')


def nvme_timeline() -> str:
    return _old('nvme_timeline')


# -- docs/benchmarks.md: scale; quality (tuned comparison, concentration); docs/nvme.md -------------------------------

def _wrap(text: str) -> str:
    """A source line wrapped at 120 characters, as the pages are."""
    import textwrap
    return textwrap.fill(text, 120, break_long_words=False, break_on_hyphens=False)


def _grid(header: list[str], cols: list, rows: list[tuple[str, object]]) -> str:
    """A table with one column per ``cols`` entry: each row a label and a function of the column's item."""
    return table(header, [[label] + [f(c) for c in cols] for label, f in rows])


def scale() -> str:
    r = load("scale_cpu.json")
    top = max(x["params"] for x in r["runs"])
    at = [next(x for x in r["runs"] if x["params"] == top and x["config"] == c) for c in ("overlap", "sync", "devacc")]
    g, pt = r["growth"], r["per_tensor"]["summary"]
    mem = (r.get("record") or r)["machine"]["memory_gib"] * 2**30
    stale = r["record"]["started_utc"] < "2026-12-04T19:02:50Z"  # 1f58ea0 changed what a step reads
    return "\n\n".join([_wrap(source("scale_cpu.json", command="python -m bench.scale")), _grid(
        [f"{top / 1e6:.0f} M parameters ({at[0]['size']}, {at[0]['tensors']} tensors)", "overlap", "no overlap",
         "`device_accumulation`"], at, [
            ("host buffers (`host_bytes()`), bytes per parameter", lambda x: f"{x['bytes_per_param']['total']:.1f}"
             + (f" + {x['bytes_per_param']['device_sums']:.1f} device-side sums" if x["host_bytes"]["device_sums"]
                else "")),
            ("fast path's state, bytes per parameter", lambda x: f"{x['bytes_per_param']['fast_state']:.1f}"),
            ("RSS growth over the run / peak RSS, bytes per parameter",
             lambda x: f"{x['rss']['growth_per_param']:.1f} / {x['rss']['peak_per_param']:.1f}"),
            (f"parameters its {mem / 2**30:g} GiB would hold (peak RSS over the process's base)",
             lambda x: f"{mem / x['rss']['peak_over_base_per_param'] / 1e6:.0f} M"),
            ("first `step()` (cold)", lambda x: f"{x['times']['cold_first_step_s']:.1f} s"),
            ("`step()` between update boundaries / at one; fast path alone",
             lambda x: f"{x['times']['between_boundaries_median_s']:.2f} / {x['times']['boundary_median_s']:.2f}; "
                       f"{x['fast_path_median_s']:.2f} s"),
            ("host update alone (threads), fraction of the roofline",
             lambda x: f"{x['host_update']['last_s']:.2f} s ({x['host_threads']}"
                       f"{', fused' if x['host_update']['pattern'].startswith('fused') else ''}), "
                       f"{x['host_update']['fraction_of_roofline_last']:.2f}"),
            ("mean `step()` over all sizes: ns per parameter (exponent)",
             lambda x: "{ns_per_param:.2f} ({exponent:.2f})".format(**g[x["config"]]["mean_step"])),
            ("other processes' CPU share, most over the sizes", lambda x: "{:.0%}".format(max(
                y["other_processes_cpu_fraction"] for y in r["runs"] if y["config"] == x["config"]))),
        ]), table(["`step()` per tensor" + (" (recorded before 1f58ea0; not this version's)" if stale else ""),
                   "ms at 150 tensors", "ms at 300", "us per added tensor"],
                  [[f"`{n}`", pt[n]["ms_at_150"], pt[n]["ms_at_300"], f"{pt[n]['us_per_tensor']:.0f}"]
                   for n in ("torch_adamw_foreach", "zenflow_cpu_link", "zenflow_async_link")])])


def tuned() -> str:
    from studies import findings

    res = findings.load_results()
    s = {w: x["summary"] for w, x in res.items()}
    v = lambda w, n: s[w]["variants"].get(n)  # noqa: E731
    base = lambda n: "-" if v(next(iter(s)), n)["family"] != "adam" or n == "zenflow" else (  # noqa: E731
        "yes" if findings.wins_everywhere(s, n) else "no")

    def cell(w: str, n: str) -> str:
        if v(w, n) is None:
            return "-"
        steps, bound = findings.steps_ratio(s[w], n), v(w, n)["steps_over_adamw_at_least"]
        reach = f"{steps:.2f}" if steps is not None else f">={bound:.2f}" if bound is not None else "-"
        star = "*" if findings.beats_adamw(s[w], n) else ""
        lr = v(w, n)["lr_over_adamw"]
        return f"{findings.final_ratio(s[w], n)['mean']:.2f}{star} / {reach} / {lr:.2g}x".replace(
            f"{lr:.2g}x", f"{lr:.2g}x" if lr < 10 else f"{lr:.0f}x")

    def best(w: str) -> str:
        n = min((n for n in s[w]["variants"] if v(w, n)["family"] == "adam" and n not in ("adamw", "offload")),
                key=lambda n: findings.final_ratio(s[w], n)["mean"])
        return f"`{n}`"
    z = lambda w: findings.final_ratio(s[w], "zenflow")  # noqa: E731
    head = [["ZenFlow's top-10% share", *(v(w, "zenflow")["top10_share"] for w in s)],
            ["AdamW's best rate; its held-out gain", *(f"{s[w]['adamw_best_lr']:.2g}; "
             f"{1 - v(w, 'adamw')['final']['mean'] / s[w]['initial_heldout']:.1%}" for w in s)],
            ["runs", *(len(res[w]["runs"]) for w in s)],
            ["`zenflow`'s final over AdamW's, seeds' range", *(f"{z(w)['min']:.2f}-{z(w)['max']:.2f}" for w in s)],
            ["lowest final among ZenFlow's AdamW variants", *(best(w) for w in s)]]
    names = ["zenflow", "overlap", "deepspeed", "host_step_count", "reselect_state", "lr_times_interval",
             "topk0.05_ui2", "topk0.05_ui8", "topk0.25_ui2", "bf16_nearest", "bf16_stochastic", "lion",
             "zenflow_lion", "sgd", "zenflow_sgd"]
    tt = load("time_to_target.json")["tables"]
    shown = ("offload", "zenflow", "overlap", "deepspeed", "lr_times_interval", "topk0.25_ui2")
    ttc = lambda t, n: "-" if t["rows"].get(n, {}).get("time_vs_" + t["base"]) is None else (  # noqa: E731
        f"{'>=' if t['rows'][n]['at_least'] else ''}{t['rows'][n]['time_vs_' + t['base']]:.2f}")
    resumed = any("--resume" in x["record"]["command"] for x in res.values())
    return "\n\n".join([
        _wrap(", ".join(link(f"tuned_{w}.json") for w in s) + ", `python -m studies.tuned_comparison --workload W"
              + (" --resume`, the summaries written from the runs' log (the runs came from earlier commits)"
                 if resumed else "`") + "; " + "; ".join(sorted({where(x) for x in res.values()})) + "."),
        table(["", *s, "beats `zenflow` on every workload"],
              [h + [""] for h in head] + [[f"`{n}`", *(cell(w, n) for w in s), base(n)] for n in names]),
        _wrap(source("time_to_target.json") + f" Assumed: {load('time_to_target.json')['assumption']}."),
        table(["time to target over AdamW's", *(f"`{n}`" for n in shown)],
              [[k, *(ttc(t, n) for n in shown)] for k, t in tt.items()])])


def concentration() -> str:
    r = load("concentration_study.json")
    c, z = r["config"], r["config"]["zenflow"]
    rec = lambda x, k: f"{x[k]:.3f} ({x[k + '_range'][0]:.3f}-{x[k + '_range'][1]:.3f})"  # noqa: E731
    return "\n\n".join([
        _wrap(source("concentration_study.json", command="python -m studies.concentration_study")),
        table(["steps", "lr", "`topk_ratio`", "`update_interval`", "`select_interval`", "seeds"],
              [[c["steps"], f"{c['lr']:g}", str(z["topk_ratio"]), z["update_interval"], z["select_interval"],
                len(c["seeds"])]]),
        table(["exponent", "top 1%", "top 10%", "selected", "recovered, overlap (seeds)",
               "recovered, no overlap (seeds)", "AdamW's final over its half-way loss"],
              [[f"{x['alpha']:g}" + (" (flat)" if x["alpha"] == 0 else ""), x["top1_share"], x["top10_share"],
                x["selected_share"], rec(x, "zenflow_overlap_recovered"), rec(x, "zenflow_sync_recovered"),
                x["adamw_end_over_half"]]
               for x in r["summary"]])])


def nvme() -> str:
    one, two = load("nvme_cpu.json"), load("nvme_cpu_repeat.json")
    cfgs, goal, size = one["run_config"]["configs"], one["goal_streamed_over_roofline"], one["run_config"]["stall_size"]
    m = lambda p: f"{p / 1e9:.2f} B" if p >= 1e9 else f"{p / 1e6:.0f} M"  # noqa: E731
    both = lambda f, xs: " / ".join(f(x) for x in xs)  # noqa: E731 (the first run / the second)
    each = lambda f, xs: ", ".join(f(x) for x in xs)  # noqa: E731
    store = {(r["mode"], r["size_m"]): [] for r in one["results"]}
    for r in one["results"] + two["results"]:
        store[r["mode"], r["size_m"]].append(r)
    disk, inmem = (lambda c: one["memory"][c + " nvme"]), (lambda c: one["memory"][c + " cpu"])
    ups = lambda res, c: [x["host_update"]["roofline_over_last"] for x in res["runs"]  # noqa: E731
                          if x["config"] == c and x["offload"] == "nvme" and x["host_update"].get("roofline_over_last")]
    plain = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}x, {sum(x >= goal for x in xs)} of {len(xs)} met"  # noqa: E731
    same = lambda res, c: "{} of {}".format(*(f([w["identical"] for w in res["weights_identical"]  # noqa: E731
                                                 if w["config"] == c]) for f in (sum, len)))
    cache = lambda c: max(p["growth_max"] for p in one["page_cache"]  # noqa: E731
                          if p["config"] == c and p["offload"] == "nvme") / 2**20
    big = {r["config"]: r for r in one["billion"]}
    b = big[cfgs[0]]
    skip = {s["config"]: s["predicted_memory_bytes"] / 2**30 for s in one["skipped_runs"] if s["offload"] == "cpu"}
    run = {(r["config"], r["offload"], r["update_interval"]): r for r in one["runs"] if r["size"] == size}
    again = {s["update_interval"]: s["disk_over_memory"] for s in two["stall"]}
    rate = lambda r: statistics.median(r["host_update"]["disk_traffic_bytes"] / s  # noqa: E731
                                       for s in r["host_update"]["seconds"]) / 1e9
    stall = [(s, run["overlap", "nvme", s["update_interval"]], run["overlap", "cpu", s["update_interval"]])
             for s in one["stall"]]
    return "\n\n".join([
        _wrap(source("nvme_cpu.json", command="python -m bench.nvme") + " Repeated: "
              + source("nvme_cpu_repeat.json", command="python -m bench.nvme --attempts 3")),
        table(["storage pass (first run / second)", "streamed over plain pass", "streamed GB/s",
               "page cache growth, most (MiB)"],
              [[f"{n} M, {mode}", both(lambda r: f"{r['streamed_over_roofline']:.2f}x", rs),
                both(lambda r: f"{r['streamed']['gb_per_s']:.1f}", rs),
                both(lambda r: f"{max(r['streamed']['cache_growth_bytes'] + [0]) / 2**20:.0f}", rs)]
               for (mode, n), rs in sorted(store.items())]),
        table([f"bytes per parameter ({each(lambda s: m(s['params']), disk('overlap')['sizes'])})",
               "host side on disk, slope", "goal", "met", "host side at each size", "`host_bytes()` at each size",
               "device side, largest", "peak RSS beyond the reported buffers, MiB", "host side in memory, slope",
               "whole RSS on disk, slope", "second run: host side on disk"],
              [[c, disk(c)["host_side_rss_growth_slope"], f"<= {one['run_config']['goal_bytes_per_param'][c]}",
                "met" if disk(c)["goal_met"] else "missed",
                each(lambda s: f"{s['host_side_rss_growth']:.2f}", disk(c)["sizes"]),
                each(lambda s: f"{s['host_buffers_reported']:.2f}", disk(c)["sizes"]),
                disk(c)["sizes"][-1]["device_side_reported"],
                each(lambda s: f"{s['peak_unreported_bytes'] / 2**20:.0f}", disk(c)["sizes"]),
                inmem(c)["host_side_rss_growth_slope"], disk(c)["rss_growth_slope"],
                two["memory"][c + " nvme"]["host_side_rss_growth_slope"]] for c in cfgs]),
        table([f"{m(b['params'])} ({b['size']}, {b['steps']} steps, `update_interval` {b['update_interval']}, file "
               f"{b['disk_bytes'] / 1e9:.1f} GB), on disk", "mean `step()`", "cold first step", "host updates",
               "last over plain pass", "peak RSS", "in memory", "page cache growth, most over its disk runs (MiB)",
               f"every disk run: update over plain pass (goal >= {goal}), first run / second",
               "weights identical on disk and in memory, first / second"],
              [[c, f"{big[c]['mean_step_s']:.2f} s", f"{big[c]['cold_first_step_s']:.0f} s",
                each(lambda x: f"{x:.1f}", big[c]["host_update_s"]) + " s", f"{big[c]['roofline_over_last']:.2f}x",
                f"{big[c]['rss_peak'] / 2**30:.1f} GiB", f"skipped (predicted {skip[c]:.1f} GiB)" if c in skip
                else "run", f"{cache(c):.0f}", both(plain, [ups(one, c), ups(two, c)]),
                f"{same(one, c)} / {same(two, c)}"] for c in cfgs]),
        table([f"`update_interval` S ({size}, {m(stall[0][1]['params'])}, overlap)", "disk: mean `step()`",
               "at boundaries", "between", "memory: mean `step()`", "disk over memory", "second run: disk over memory",
               "B, GB/s (median update)", "rule: S >= 24 N / (B step)", "other processes' CPU, disk / memory run"],
              [[s["update_interval"], *(f"{1e3 * s['nvme'][x]:.0f} ms" for x in ("mean_step_s", "boundary_mean_s",
                                                                               "between_mean_s")),
                f"{1e3 * s['cpu']['mean_step_s']:.0f} ms", f"{s['disk_over_memory']:.2f}x",
                f"{again[s['update_interval']]:.2f}x" if s["update_interval"] in again else "not run",
                rate(d), f"{24 * d['params'] / (rate(d) * 1e9 * s['nvme']['between_mean_s']):.1f}",
                both(lambda r: f"{r['other_processes_cpu_fraction']:.0%}", [d, c])] for s, d, c in stall])])


# -- docs/deepspeed.md ----------------------------------------------------------------------------------------------

def deepspeed_choices() -> str:
    return _old('deepspeed_choices')


def deepspeed_rounding() -> str:
    return _old('deepspeed_rounding')


def _old(name: str) -> str:
    """The section as bench.readme_results wrote it (until this module renders it)."""
    from bench.readme_results import section
    return section(name).split("\n", 1)[1].rsplit("\n", 1)[0]


BENCHMARKS = DOCS / "benchmarks.md"
SECTIONS = {"readme": (README, readme), "kernels_gpu": (BENCHMARKS, kernels_gpu),
            "step_overhead": (BENCHMARKS, step_overhead), "rules_step": (BENCHMARKS, rules_step),
            "seam": (BENCHMARKS, seam), "cpu_adam": (BENCHMARKS, cpu_adam), "kernels_cpu": (BENCHMARKS, kernels_cpu),
            "cpu_rules": (BENCHMARKS, cpu_rules), "stochastic_rounding": (BENCHMARKS, stochastic_rounding),
            "e2e": (BENCHMARKS, e2e), "zero": (BENCHMARKS, zero), "overlap": (BENCHMARKS, overlap),
            "fsdp2": (BENCHMARKS, fsdp2), "nvme_timeline": (BENCHMARKS, nvme_timeline), "scale": (BENCHMARKS, scale),
            "tuned": (BENCHMARKS, tuned), "concentration": (BENCHMARKS, concentration),
            "nvme": (DOCS / "nvme.md", nvme), "deepspeed_choices": (DOCS / "deepspeed.md", deepspeed_choices),
            "deepspeed_rounding": (DOCS / "deepspeed.md", deepspeed_rounding)}
