"""BENCHMARKS.md's headline table is what benchmarks/_headline.py makes of the same file's detail rows.

So the headline cannot be edited by hand, cannot mix a C figure with a Python peer unnoticed
(each pair names its two rows), and follows a renamed row or a new run.
"""

from __future__ import annotations

import re

from conftest import ROOT

from benchmarks._headline import PAIRS, Figures, headline

BENCHMARKS = ROOT / "BENCHMARKS.md"


def sections(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def figures_in(parts: dict[str, list[str]]) -> Figures:
    """The detail rows of every module section, as the run produced them."""
    figures: Figures = {}
    for module, lines in parts.items():
        for line in lines:
            row = cells(line) if line.startswith("| ") else []
            if module == "fragmentation" and len(row) == 11 and row[4].endswith("x"):
                workload = row[0].removesuffix(" (tuned on)")
                figures[(module, f"fragmentation [{workload}] {row[1]}: idle pinned / packed floor")] = (
                    float(row[4][:-1]), "x")
            elif len(row) == 4 and row[0] not in ("figure", "---"):
                try:
                    figures[(module, row[0])] = (float(row[1].replace(",", "")), row[2])
                except ValueError:
                    continue
    return figures


def test_headline_is_computed_from_the_rows_below_it():
    parts = sections(BENCHMARKS.read_text())
    assert list(parts)[0] == "Headline", "the headline table comes first"
    shown = [line for line in parts["Headline"] if line.startswith("|")]
    expected = [line for line in headline(figures_in(parts), ROOT / "benchmarks" / "results") if line.startswith("|")]
    assert shown == expected


def test_every_pair_names_two_rows_with_the_same_unit():
    figures = figures_in(sections(BENCHMARKS.read_text()))
    for pair in PAIRS:
        ours, peer = figures.get((pair.module, pair.ours)), figures.get((pair.module, pair.peer))
        assert ours and peer, f"{pair.what}: {pair.ours!r} or {pair.peer!r} is not a row of {pair.module}"
        assert ours[1] == peer[1], f"{pair.what}: {ours[1]} against {peer[1]}"


def test_every_benchmark_and_every_recorded_result_is_in_benchmarks_md():
    """A new module of benchmarks/ or a new file in benchmarks/results/ fails until BENCHMARKS.md is regenerated."""
    import pkgutil

    import benchmarks

    parts = sections(BENCHMARKS.read_text())
    modules = sorted(info.name for info in pkgutil.iter_modules(benchmarks.__path__)
                     if not info.name.startswith("_") and not info.ispkg)
    summary = {cells(line)[0] for line in parts["Summary"] if line.startswith("| [")}
    assert summary == {f"[{m}](#{m})" for m in modules}, "the summary table names every module of benchmarks/"
    missing = [m for m in modules if m not in parts]
    assert not missing, f"benchmarks without a section in BENCHMARKS.md (run python -m benchmarks): {missing}"
    recorded = "\n".join(parts.get("Recorded on device", []))
    results = sorted(p.name for p in (ROOT / "benchmarks" / "results").glob("*.md"))
    missing = [name for name in results if f"### {name}" not in recorded]
    assert not missing, f"benchmarks/results files not in BENCHMARKS.md (python -m benchmarks --copy-results): {missing}"


def test_each_recorded_result_is_copied_as_it_stands():
    """The "Recorded on device" copies follow their files, so an added or edited result fails until
    ``python -m benchmarks --copy-results`` (or a whole run) copies it anew."""
    from benchmarks.__main__ import RECORDED, recorded_section

    text = BENCHMARKS.read_text()
    assert text[text.index("\n" + RECORDED + "\n") + 1:].rstrip() == "\n".join(recorded_section()).rstrip()


def test_every_benchmark_module_imports() -> None:
    """A benchmark that no longer imports (a name moved in the package under it) fails here, not on the day it is
    run: every module of benchmarks/ and benchmarks/fair/, the frozen twins (``_reader_9b05ad6``) included."""
    import importlib
    import pkgutil

    import benchmarks
    import benchmarks.fair

    for package in (benchmarks, benchmarks.fair):
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
