"""Page map of the selected model: one cell per page or per group of pages, zoomable and scrollable.

Only the rows on screen are folded (``kvtop.text.pagemap.fold``), and a refresh whose page map is
byte-for-byte the one already drawn folds nothing: a 100k-page model costs what its visible
cells cost.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kvcached_core import ModelSnapshot, format_bytes
from kvtop.screen.view import STATE_STYLES, fit_per_cell
from kvtop.text.pagemap import GLYPHS, Cell, fold

GUTTER_MIN_WIDTH = 40


class _Geometry(NamedTuple):
    width: int
    gutter: int
    cells: int  # cells per row
    fit: int  # pages per cell that fit the whole map on screen
    per: int  # pages per cell now
    rows: int


class PageMapView(ScrollView, can_focus=False):
    """``z`` halves the pages per cell (down to one page per cell), ``Z`` doubles it back to "fit"."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.detail: ModelSnapshot | None = None
        self.zoom: int | None = None  # pages per cell; None = fit the whole map on screen
        self._pages: array | None = None
        self._rows: dict[int, list[Cell]] = {}
        self._styles = {state: Style.parse(style) for state, style in STATE_STYLES.items()}
        self._geom_key: tuple | None = None
        self._geom = _Geometry(0, 0, 1, 1, 1, 0)
        self._base = Style()
        self.folds = 0  # rows folded so far (the benchmark and tests watch it)
        self.border_title = "page map"

    # -- geometry ------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self._pages) if self._pages is not None else 0

    def _geometry(self) -> _Geometry:
        """Width, gutter, cells per row, pages per cell and rows; cached, render_line asks per line."""
        key = (self.size, self.virtual_size, self.total, self.zoom)
        if self._geom_key != key:
            region = self.scrollable_content_region
            digits = len(str(max(0, self.total - 1)))
            gutter = digits + 1 if region.width >= GUTTER_MIN_WIDTH and self.total else 0
            cells = max(1, region.width - gutter)
            fit = fit_per_cell(self.total, cells * max(1, region.height))
            per = self.zoom or fit
            rows = -(-self.total // (cells * per)) if self.total else 0
            self._geom = _Geometry(region.width, gutter, cells, fit, per, rows)
            self._geom_key = key
        return self._geom

    @property
    def gutter_width(self) -> int:
        """Columns taken by the page numbers on the left."""
        return self._geometry().gutter

    @property
    def row_cells(self) -> int:
        return self._geometry().cells

    def fit(self) -> int:
        return self._geometry().fit

    @property
    def per_cell(self) -> int:
        return self._geometry().per

    @property
    def rows(self) -> int:
        return self._geometry().rows

    def _relayout(self) -> None:
        self._rows.clear()
        self.virtual_size = Size(self.scrollable_content_region.width, max(1, self.rows))
        self._retitle()
        self.refresh()

    def on_resize(self) -> None:
        self._relayout()

    # -- data ----------------------------------------------------------------------------------
    def show(self, detail: ModelSnapshot | None) -> None:
        """Take a new snapshot of the selected model; folds again only if its page map changed."""
        switched = (detail is None) != (self.detail is None) or (
            detail is not None and self.detail is not None and detail.name != self.detail.name)
        self.detail = detail
        pages = detail.pages if detail is not None else None
        if switched:
            self.scroll_home(animate=False)
        if not switched and pages is not None and self._pages is not None and pages == self._pages:
            self._retitle()
            return
        resized = (len(pages) if pages is not None else 0) != self.total
        self._pages = pages
        if resized or switched:
            self._relayout()
        else:
            self._rows.clear()
            self._retitle()
            self.refresh()

    def zoom_in(self) -> bool:
        """Halve the pages per cell; False (nothing changed) at one page per cell or with no map."""
        if self._pages is None or self.per_cell <= 1:
            return False
        self.zoom = max(1, self.per_cell // 2)
        self._relayout()
        return True

    def zoom_out(self) -> bool:
        """Double the pages per cell, back to fit; False (nothing changed) when already at fit."""
        if self._pages is None or self.zoom is None:
            return False
        per = self.per_cell * 2
        self.zoom = None if per >= self.fit() else per
        self._relayout()
        return True

    def _retitle(self) -> None:
        """``page map · NAME · pages per cell (zoom) · pages × bundle`` (one line: short screens have no bottom border)."""
        m = self.detail
        if m is None:
            self.border_title = "page map"
            return
        title = f"page map · {m.name}"
        if self._pages is not None:
            per = self.per_cell
            title += f" · {per}/cell" + (" (zoom)" if self.zoom is not None else "")  # else fit: the default
            if self.rows > self.size.height:
                per_row = self.row_cells * per
                first = self.scroll_offset.y * per_row
                last = min(self.total, first + self.size.height * per_row) - 1
                title += f" · pages {first:,}–{last:,} of {self.total:,}"
            else:
                title += f" · {self.total:,} pages"
            title += f" × {format_bytes(m.bundle_bytes)} bundle"  # a page id costs its bundle, not page_size
        self.border_title = title

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self._retitle()

    # -- drawing -------------------------------------------------------------------------------
    def _row(self, row: int) -> list[Cell]:
        cells = self._rows.get(row)
        if cells is None:
            assert self.detail is not None and self._pages is not None
            per = self.per_cell
            width = self.row_cells
            cells = fold(self._pages, self.detail.blocks_per_page, width, start=row * width * per, pages_per_cell=per)
            self._rows[row] = cells
            self.folds += 1
        return cells

    def render_lines(self, crop: Region) -> list[Strip]:
        self._base = self.rich_style  # once per paint, not once per line
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        base = self._base
        geom = self._geometry()
        row = self.scroll_offset.y + y
        if self._pages is None or self.detail is None:
            if y == 0:
                text = self._message()
                text.stylize(base)
                return Strip(list(text.render(self.app.console)), text.cell_len).crop_extend(0, geom.width, base)
            return Strip.blank(geom.width, base)
        if row >= geom.rows:
            return Strip.blank(geom.width, base)
        segments: list[Segment] = []
        if geom.gutter:
            first = row * geom.cells * geom.per
            segments.append(Segment(f"{first:>{geom.gutter - 1}} ", base + Style(color="grey42")))
        run_state, run = "", 0  # no state yet: run is 0 until the first cell
        for cell in self._row(row):
            if cell.state != run_state and run:
                segments.append(Segment(GLYPHS[run_state] * run, base + self._styles[run_state]))
                run = 0
            run_state = cell.state
            run += 1
        if run:
            segments.append(Segment(GLYPHS[run_state] * run, base + self._styles[run_state]))
        return Strip(segments).crop_extend(0, geom.width, base)

    def _message(self) -> Text:
        m = self.detail
        if m is None:
            return Text("no model selected", style="grey50")
        if m.legacy:
            return Text("upstream kvcached segment: no page map", style="cyan")
        return Text("reading page map…", style="grey50")
