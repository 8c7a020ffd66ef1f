"""The tables of measured results in README.md and docs/*.md, each rendered from the JSON it names
(``python -m tools.docs_results`` writes them between their markers; ``--check`` compares)."""

from __future__ import annotations

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
    return _old('nvme')


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
