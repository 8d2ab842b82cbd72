"""Every relative link in the README, ARCHITECTURE.md and docs/ names a file that exists, and an anchor
that one of its headings makes (GitHub's rule: lower case, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

import pytest
from conftest import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            base, n = slug, 1
            while slug in found:
                slug, n = f"{base}-{n}", n + 1
            found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        file_part, _, anchor = target.partition("#")
        path = (page.parent / urllib.parse.unquote(file_part)).resolve() if file_part else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


# -- words a newcomer meets: defined (bold) where first used, or the README's Words linked before --

TERMS = ("upstream", "legacy", "block bundle", "page bundle")


def first_use(path: Path, term: str) -> tuple[list[str], int, int] | None:
    """(the page's lines outside code fences, line index, column) of ``term``'s first use, or None."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    for i, line in enumerate(lines):
        at = line.lower().find(term)
        if at >= 0:
            return lines, i, at
    return None


@pytest.mark.parametrize("term", TERMS)
def test_the_readme_defines_each_term_where_it_first_uses_it(term: str) -> None:
    found = first_use(ROOT / "README.md", term)
    assert found, f"README.md never says {term!r}"
    lines, i, at = found
    assert lines[i][at - 2:at] == "**", f"README.md line {i + 1}: {term!r} used before it is defined: {lines[i]!r}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in ("README.md", "BENCHMARKS.md")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_defines_or_links_each_term_before_using_it(page: Path) -> None:
    for term in TERMS:
        found = first_use(page, term)
        if found is None:
            continue
        lines, i, at = found
        defined = lines[i][at - 2:at] == "**"
        end = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))  # its paragraph
        linked = any("README.md#words" in line for line in lines[:end])
        assert defined or linked, (f"{page.name} line {i + 1}: {term!r} before a link to the README's Words "
                                   f"(or a **definition**): {lines[i]!r}")


# -- Python names the pages give (`kvcached_core.segment.frag.fragmentation`) exist ------------------------

PY_NAME = re.compile(r"`((?:kvcached_core|kvtop|kvcached_transformers|kvcached_vllm)(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_name_a_page_gives_exists(page: Path) -> None:
    import importlib

    from kvcached_core import native

    built = {part.module for part in native.PARTS.values()}  # present where built: test_native_build checks
    absent, missing = object(), []
    for name in sorted(set(PY_NAME.findall(page.read_text())) - built):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attribute in parts[i:]:
                obj = getattr(obj, attribute, absent)
            break
        else:
            obj = absent
        if obj is absent:
            missing.append(name)
    assert not missing, f"{page.name}: no such Python names {missing}"
