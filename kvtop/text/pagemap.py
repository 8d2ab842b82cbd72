"""Page-map cells for the screen: glyphs and legend over the core's folded cells.

The folding itself (and every page state) is :data:`kvcached_core.pagemap`, shared by ``kvctl show``
(characters) and the kvtop page-map widget (colours).
"""

from __future__ import annotations

from kvcached_core import pagemap as core

Cell = core.Cell
fold = core.fold  # the cell API, as the screen modules import it
FREE, RESERVED, CACHED, LOW, MID, HIGH, FULL = core.FREE, core.RESERVED, core.CACHED, core.LOW, core.MID, core.HIGH, \
    core.FULL

GLYPHS = {FREE: "·", RESERVED: "○", CACHED: "c", LOW: "░", MID: "▒", HIGH: "▓", FULL: "█"}
LEGEND = (
    (FREE, "free (unmapped)"), (RESERVED, "reserved (mapped, empty)"), (CACHED, "cached prefix only"),
    (LOW, "in use <34%"), (MID, "in use <67%"), (HIGH, "in use <100%"), (FULL, "full"),
)


def grid_lines(cells: list[Cell], width: int) -> list[str]:
    """Cells as rows of glyphs, ``width`` per row."""
    glyphs = "".join(GLYPHS[c.state] for c in cells)
    return [glyphs[i:i + width] for i in range(0, len(glyphs), max(1, width))]
