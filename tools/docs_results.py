"""The measured results in README.md and docs/*.md, kept true to the committed JSONs.

Two forms, each checked against the data itself:

- **Tables** between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``: rendered from the JSON by
  ``SECTIONS[NAME]`` (``tools/results_tables.py``), one line naming the result's file, machine and commit, then a
  table of its figures. ``python -m tools.docs_results`` rewrites them; ``--check`` exits 1 when one differs.
- **Figures in prose**, each followed at once by ``<!--= FILE EXPR -->``: ``EXPR`` is evaluated with the JSON
  ``FILE`` as ``r`` (``a.b.c`` is short for ``r["a"]["b"]["c"]``), and the figure as written must be that value
  rounded to the digits written (a span ``1.6-4.0x`` is the min and max of a list). ``--check`` lists every figure
  that is not.

Prose outside both says no figure (tests/test_readme.py holds the figures it checks by hand).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tools.results_tables import REPO, SECTIONS, load

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def begin(name: str) -> str:
    return f"<!-- results:{name}: from its JSON by `python -m tools.docs_results`; edit tools/results_tables.py -->"


def end(name: str) -> str:
    return f"<!-- /results:{name} -->"


def section(name: str) -> str:
    """A section as it stands in its page: the markers around its text, lines other than a table's wrapped at 116
    characters (a list item's continued under its text)."""
    import textwrap

    lines = []
    for line in SECTIONS[name][1]().split("\n"):
        indent = "  " if line.startswith("- ") else ""
        lines += [line] if line.startswith("|") or not line else textwrap.wrap(
            line, 116, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)
    return f"{begin(name)}\n" + "\n".join(lines) + f"\n{end(name)}"


def current(text: str, name: str) -> str:
    start, stop = text.find(f"<!-- results:{name}:"), text.find(end(name))
    if start < 0 or stop < start:
        raise SystemExit(f"no results markers for {name!r} ({begin(name)!r} ... {end(name)!r})")
    return text[start:stop + len(end(name))]


# -- figures in prose ---------------------------------------------------------------------------------------------

FIGURE = re.compile(r"(\S+?)<!--=\s+(\S+)\s+(.+?)\s*-->", re.S)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?")


def value_of(name: str, expr: str):
    """``expr`` on the result ``name``: a dotted path of keys, or a Python expression of ``r``."""
    r = load(name)
    if re.fullmatch(r"[\w^\-]+(\.[\w^\-]+)*", expr):
        for key in expr.split("."):
            r = r[int(key)] if isinstance(r, list) else r[key]
        return r
    return eval(expr, {"r": r, "min": min, "max": max, "sum": sum, "len": len, "abs": abs, "sorted": sorted})


def _written(text: str) -> list[tuple[float, float]]:
    """The numbers in a figure as written, each with half its last digit's unit (``1.6-4.0x``: two of them;
    ``5.6e-7``: 0.05e-7)."""
    numbers = NUMBER.findall(text.replace("\u2212", "-"))
    numbers = [n.lstrip("-") if i and n.startswith("-") else n for i, n in enumerate(numbers)]  # 1.6-4.0: a span
    out = []
    for n in numbers:
        mantissa, _, exponent = n.replace(",", "").partition("e")
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        out.append((float(n.replace(",", "")), 10 ** (int(exponent or 0) - digits) / 2))
    return out


def wrong_figures(page: Path) -> list[str]:
    """Every annotated figure of ``page`` that is not its value rounded as written, as ``page: figure (value)``."""
    wrong = []
    text = re.sub(r"`[^`\n]*<!--[^`\n]*`", "``", page.read_text())  # (the syntax quoted in code is not a figure)
    for figure, name, expr in FIGURE.findall(text):
        value = value_of(name, " ".join(expr.split()))
        values = sorted(value) if isinstance(value, (list, tuple)) else [value]
        written = _written(figure)
        want = [values[0], values[-1]] if len(written) == 2 else [values[0]] if len(set(values)) == 1 else None
        if want is None or len(written) != len(want) or not all(
                abs(v - w) <= half * (1 + 1e-9) for (w, half), v in zip(written, want, strict=True)):
            wrong.append(f"{page.relative_to(REPO)}: {figure} from {name} {expr} (the data: {value!r})")
    return wrong


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tools.docs_results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a table or a figure differs from its data")
    args = ap.parse_args(argv)
    problems = []
    for name, (path, _) in SECTIONS.items():
        text = path.read_text()
        old, new = current(text, name), section(name)
        if old != new:
            problems.append(f"{path.relative_to(REPO)}: table {name} differs from its data")
            if not args.check:
                path.write_text(text.replace(old, new))
    problems += [w for page in PAGES for w in wrong_figures(page)]
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
