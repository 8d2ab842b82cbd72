"""Fragmentation summary of the selected model."""

from __future__ import annotations

from textual.widgets import Static

from kvcached_core.snapshot import ModelSnapshot
from kvtop.view import frag_table


class FragSummary(Static):
    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.border_title = "fragmentation"
        self._key: tuple | None = None

    def show(self, m: ModelSnapshot | None) -> None:
        key = None if m is None else (m.name, m.status, m.blocks_used, m.pages_inuse, m.pages_reserved,
                                      m.blocks_cached, m.limit_bytes, m.limit_status, m.requested_limit,
                                      m.pages is not None and bytes(m.pages))
        if key == self._key and key is not None:
            return
        self._key = key
        self.update(frag_table(m))
