"""The allocator under adversity: handlers that fail, engines that misuse sleep, calls after close."""

from __future__ import annotations

import pytest

from kvcached_core import KVCacheManager, snapshot
from kvcached_core.allocator.compact import Move

MiB = 1024 * 1024
SMALL = dict(num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)


def test_sleep_and_wake_after_close_say_the_manager_is_closed() -> None:
    m = KVCacheManager("closed", **SMALL)  # type: ignore[arg-type]
    m.set_sleep_handler(lambda action: None)
    m.close()
    for call in (m.sleep.sleep, m.sleep.wake, m.sleep.ready, lambda: m.set_sleep_handler(None)):
        with pytest.raises(RuntimeError, match="'closed' is closed"):
            call()


# -- compaction: what a handler answers is checked before any accounting changes -------------------------------
def _accounting_holds(m: KVCacheManager, held: set[int]) -> None:
    """The page table, its counters and the published segment agree with the blocks the engine holds."""
    pages = m.pages
    assert {b for b in range(len(pages.block_used)) if pages.block_used[b]} == held
    assert pages.blocks_used == sum(pages.used) == len(held)
    assert all(m.pages.is_used(b) for b in m.cache.blocks)
    assert snapshot(m.name).blocks_used == len(held)


@pytest.mark.parametrize("mistake", ["frees its sources", "not a move", "not a list", "frees a destination"])
def test_a_compact_handlers_mistake_moves_nothing_and_keeps_the_accounting(
        mistake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_core_compact import MODEL, scattered

    for var in ("KVCACHED_MIN_RESERVED_PAGES", "KVCACHED_MAX_RESERVED_PAGES"):
        monkeypatch.setenv(var, "0")
    with KVCacheManager("compact", policy="best-fit", **MODEL) as m:  # type: ignore[arg-type]
        held = set(scattered(m))
        freed: set[int] = set()

        def handler(moves: list[Move]) -> list:
            if mistake == "frees its sources":
                sources = [s for s, _ in moves[:3]]
                m.free(sources)
                freed.update(sources)
                return moves
            if mistake == "frees a destination":
                m.free([moves[0][1]])
                return moves
            if mistake == "not a move":
                return [*moves[:2], (*moves[2], 0)]
            return None  # type: ignore[return-value]

        m.set_compact_handler(handler)
        with pytest.raises(ValueError, match="compact handler .*nothing moved"):
            m.compact()
        held -= freed
        _accounting_holds(m, held)
        m.free(sorted(held))  # every block the engine holds goes back, and nothing else
        _accounting_holds(m, set())

