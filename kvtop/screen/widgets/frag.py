"""Fragmentation summary of the selected model."""

from __future__ import annotations

from rich.console import RenderableType
from textual.widget import Widget

from kvcached_core import ModelSnapshot
from kvtop.screen.view import frag_table


class FragSummary(Widget):
    """Recomputed only when the model's counters or page map changed (the page-map walk costs)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "fragmentation"
        self._key: tuple | None = None
        self._body: RenderableType = frag_table(None)

    def show(self, m: ModelSnapshot | None) -> None:
        key = None if m is None else (m.name, m.status, m.blocks_used, m.pages_inuse, m.pages_reserved,
                                      m.blocks_cached, m.limit_bytes, m.limit_status, m.requested_limit,
                                      m.compaction, m.pressure,
                                      m.pages is not None and m.pages.tobytes())
        if key == self._key and key is not None:
            return
        self._key = key
        self._body = frag_table(m)
        self.refresh()

    def render(self) -> RenderableType:
        return self._body
