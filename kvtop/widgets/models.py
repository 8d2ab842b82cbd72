"""Model table: one row per model, sortable and filterable, updated in place between refreshes."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from kvcached_core.snapshot import ModelSnapshot
from kvtop.history import History
from kvtop.view import COLUMNS, model_cells


class ModelTable(DataTable):
    """Rows are keyed by segment name. Cells that did not change are not touched."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)
        self.border_title = "models"
        self._order: list[str] = []
        self._cells: dict[str, dict[str, Text]] = {}

    def on_mount(self) -> None:
        for key, header, width, right in COLUMNS:
            label = header.rjust(width) if right else header.ljust(width)
            self.add_column(Text(label, justify="right" if right else "left"), key=key)

    @property
    def order(self) -> list[str]:
        return list(self._order)

    def show(self, models: Sequence[ModelSnapshot], history: History, selected: str | None,
             names: Sequence[str] = ()) -> None:
        """``names``: every model's name (filtered out too), so a model keeps its colour."""
        rows = {m.name: model_cells(m, history, names) for m in models}
        order = [m.name for m in models]
        if order != self._order:
            self.clear()
            for name in order:
                self.add_row(*(_aligned(rows[name][k], r) for k, _h, _w, r in COLUMNS), key=name)
            self._order, self._cells = order, rows
            if selected in order:
                self.move_cursor(row=order.index(selected), animate=False)
            return
        for name, cells in rows.items():
            old = self._cells.get(name, {})
            for key, _h, _w, right in COLUMNS:
                if key not in old or _signature(old[key]) != _signature(cells[key]):
                    self.update_cell(name, key, _aligned(cells[key], right), update_width=True)
        self._cells = rows


def _aligned(text: Text, right: bool) -> Text:
    if right:
        text = text.copy()
        text.justify = "right"
    return text


def _signature(text: Text) -> tuple:
    return text.plain, str(text.style), tuple(text.spans)
