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

def scale() -> str:
    return _old('scale')


def tuned() -> str:
    return _old('tuned')


def concentration() -> str:
    return _old('concentration')


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
