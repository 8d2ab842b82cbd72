"""ARCHITECTURE.md's table of the core's parts names every module where it is, and no module that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "kvcached_core"


def table_rows() -> dict[str, str]:
    """The package table's rows: the part's folder ('' for the top level) -> the row's text."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text[text.index("| part | modules |"):text.index("Outside the core:")]
    rows = {}
    for line in section.splitlines()[2:]:
        cells = line.split("|")
        if len(cells) < 3:
            continue
        part = re.match(r"\s*`([a-z_]+)(/|\.py)`", cells[1])
        rows["" if part is None else part.group(1) + ("/" if part.group(2) == "/" else ".py")] = line
    return rows


def named(row: str) -> set[str]:
    return set(re.findall(r"`([A-Za-z_]+\.(?:py|c|h))`", row))


def test_every_module_of_the_core_is_in_its_part_row_and_every_name_there_exists() -> None:
    rows = table_rows()
    folders = sorted(p for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert {f"{p.name}/" for p in folders} <= set(rows), sorted(rows)
    for folder in folders:
        row = rows[f"{folder.name}/"]
        present = {p.name for p in folder.rglob("*") if p.suffix in (".py", ".c", ".h") and p.name != "__init__.py"}
        assert named(row) <= present, (folder.name, sorted(named(row) - present))
        assert present <= named(row), (folder.name, "not in ARCHITECTURE.md:", sorted(present - named(row)))
    top = {p.name for p in CORE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    said = set().union(*(named(row) for part, row in rows.items() if not part.endswith("/")))
    assert top <= said, ("top-level modules not in ARCHITECTURE.md:", sorted(top - said))
