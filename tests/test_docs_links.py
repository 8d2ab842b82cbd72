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
