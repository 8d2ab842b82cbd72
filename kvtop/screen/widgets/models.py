"""Model table: one row per model, with a header that stays put and a cursor on the selected model.

A Line-API widget rather than a DataTable: a DataTable repaints every row when any cell
changes, and at four refreshes a second with sixteen busy models that repaint was most of
kvtop's CPU. Here a row is rendered again only when one of its cells changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kvcached_core import ModelSnapshot
from kvtop.frames.history import History
from kvtop.screen.view import COLUMNS, model_cells, unpublished_columns

GAP = 2
# Which columns a narrow terminal keeps, first to last; they are drawn in COLUMNS order.
PRIORITY = ("name", "status", "mapped", "limit", "waste", "held", "reserved", "cached", "rate", "spark",
            "pid", "engine", "device", "toks", "waiting", "reqs", "preempt", "idle", "tokspark", "prio", "min")


def choose_columns(widths: dict[str, int], width: int,
                   hidden: frozenset[str] = frozenset()) -> tuple[tuple[str, str, int, bool], ...]:
    """The columns that fit ``width``, taken by :data:`PRIORITY` (a narrow one may pass a wide one), but not
    ``hidden`` ones (those the models cannot fill)."""
    chosen: set[str] = set()
    used = 1
    for key in PRIORITY + tuple(c[0] for c in COLUMNS if c[0] not in PRIORITY):  # a new column still shows
        if key in hidden:
            continue
        need = widths[key] + (GAP if chosen else 0)
        if not chosen or used + need <= width:
            chosen.add(key)
            used += need
    return tuple(c for c in COLUMNS if c[0] in chosen)


def _signature(cells: dict[str, Text]) -> tuple:
    return tuple((t.plain, str(t.style), tuple(t.spans)) for t in cells.values())


class ModelTable(ScrollView, can_focus=False):
    """Rows keyed by segment name; the app owns the selection and hands it in with each frame."""

    COMPONENT_CLASSES = {"model-table--header", "model-table--cursor"}
    DEFAULT_CSS = """
    ModelTable > .model-table--header { text-style: bold; color: $text-muted; }
    ModelTable > .model-table--cursor { background: $block-cursor-background; color: $block-cursor-foreground; }
    """

    class Clicked(Message):
        """A row was clicked (``double``: a second click on the same row)."""

        def __init__(self, name: str, double: bool) -> None:
            super().__init__()
            self.name = name
            self.double = double

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "models"
        self._order: list[str] = []
        self._cells: dict[str, dict[str, Text]] = {}
        self._sigs: dict[str, tuple] = {}
        self._strips: dict[tuple, Strip] = {}
        self._cell_cache: dict[tuple, list[Segment]] = {}
        self._widths = {key: max(width, len(header)) for key, header, width, _right in COLUMNS}
        self.selected: str | None = None
        self._base = Style()
        self._width = 0
        self._columns: tuple[tuple[str, str, int, bool], ...] = COLUMNS  # those that fit the width, see choose_columns
        # The columns are chosen again only when the set of models, what they publish or the width changes (see
        # _fit_columns): never because this frame's figures are wider or narrower than the last one's.
        self._models_key: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self._fitted: tuple | None = None

    @property
    def order(self) -> list[str]:
        return list(self._order)

    @property
    def headers(self) -> list[str]:
        """The headers of the columns shown, left to right."""
        return [header for _key, header, _width, _right in self._columns]

    # -- data ------------------------------------------------------------------------------------
    def show(self, models: Sequence[ModelSnapshot], history: History, selected: str | None,
             names: Sequence[str] = ()) -> None:
        """``names``: every model's name (filtered out too), so a model keeps its colour."""
        cells = {m.name: model_cells(m, history, names) for m in models}
        sigs = {name: _signature(c) for name, c in cells.items()}
        widened = False
        for row in cells.values():
            for key, text in row.items():
                if text.cell_len > self._widths[key]:
                    self._widths[key] = text.cell_len
                    widened = True
        if widened:
            self._strips.clear()
        self._models_key = (frozenset(cells), unpublished_columns(models))
        self._fit_columns(self.scrollable_content_region.width)
        order = [m.name for m in models]
        changed = widened or order != self._order or selected != self.selected or sigs != self._sigs
        self._order, self._cells, self._sigs = order, cells, sigs
        moved = selected != self.selected
        self.selected = selected
        self.virtual_size = Size(self.total_width, len(order) + 1)
        if len(self._strips) > 4 * len(order) + 16:
            self._strips.clear()
        if changed:
            self.refresh()
        if moved:
            self.scroll_to_selected()

    @property
    def total_width(self) -> int:
        return 1 + sum(self._widths[c[0]] for c in self._columns) + GAP * (len(self._columns) - 1)

    def _fit_columns(self, width: int) -> None:
        """Choose the columns for the models shown and the width, once: a figure that widens its column later
        widens the row (the table scrolls sideways) but never swaps one column for another."""
        fitted = (self._models_key, width)
        if fitted == self._fitted:
            return
        self._fitted = fitted
        hidden = self._models_key[1]
        columns = choose_columns(self._widths, width, hidden) if width > 0 else \
            tuple(c for c in COLUMNS if c[0] not in hidden)
        if columns != self._columns:
            self._columns = columns
            self._strips.clear()
            self.virtual_size = Size(self.total_width, len(self._order) + 1)

    def on_resize(self) -> None:
        self._fit_columns(self.scrollable_content_region.width)

    def scroll_to_selected(self) -> None:
        if self.selected in self._order:
            row = self._order.index(self.selected)
            # Row r sits on virtual line r + 1, and the header covers the top line of the view:
            # keep lines r and r + 1 in view so the row is never hidden under the header.
            self.scroll_to_region(Region(0, row, 1, 2), animate=False, immediate=True, x_axis=False)

    # -- drawing ---------------------------------------------------------------------------------
    def _cell(self, key: str, text: Text, right: bool) -> list[Segment]:
        """One cell padded to its column, as segments; cached, since most cells repeat frame to frame."""
        width = self._widths[key]
        cache_key = (key, text.plain, str(text.style), tuple(text.spans), width, right)
        segments = self._cell_cache.get(cache_key)
        if segments is None:
            pad = " " * (width - text.cell_len)
            padded = Text(no_wrap=True, end="")
            padded.append(pad if right else "")
            padded.append_text(text)
            padded.append("" if right else pad)
            segments = [seg for seg in padded.render(self.app.console) if seg.text]
            if len(self._cell_cache) > 4096:
                self._cell_cache.clear()
            self._cell_cache[cache_key] = segments
        return segments

    def _line(self, texts: list[Text], style: Style) -> Strip:
        segments = [Segment(" ", style)]
        gap = Segment(" " * GAP, style)
        for i, ((key, _header, _width, right), text) in enumerate(zip(self._columns, texts, strict=True)):
            if i:
                segments.append(gap)
            segments.extend(Segment(seg.text, style + seg.style if seg.style else style)
                            for seg in self._cell(key, text, right))
        return Strip(segments, self.total_width)

    def _header(self) -> Strip:
        style = self._base + self.get_component_rich_style("model-table--header")
        key = ("header", tuple(self._widths.values()), style)
        strip = self._strips.get(key)
        if strip is None:
            strip = self._strips[key] = self._line([Text(h) for _k, h, _w, _r in self._columns], style)
        return strip

    def _row(self, name: str) -> Strip:
        cursor = name == self.selected
        style = self._base
        if cursor:
            style = style + self.get_component_rich_style("model-table--cursor")
        key = (name, self._sigs[name], cursor, style)
        strip = self._strips.get(key)
        if strip is None:
            cells = self._cells[name]
            strip = self._strips[key] = self._line([cells[k] for k, *_ in self._columns], style)
        return strip

    def render_lines(self, crop: Region) -> list[Strip]:
        self._base = self.rich_style  # once per paint, not once per line
        self._width = self.scrollable_content_region.width
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width, base = self._width, self._base
        if y == 0:
            strip = self._header()
        else:
            index = scroll_y + y - 1
            if index >= len(self._order):
                return Strip.blank(width, base)
            strip = self._row(self._order[index])
        return strip.crop_extend(scroll_x, scroll_x + width, base)

    # -- mouse -----------------------------------------------------------------------------------
    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y == 0:
            return
        index = self.scroll_offset.y + offset.y - 1
        if 0 <= index < len(self._order):
            name = self._order[index]
            self.post_message(self.Clicked(name, double=event.chain > 1))
