"""What the process's poller does for one allocator at each tick (:mod:`kvcached_core.allocator.poller`):
apply a controller's limit, answer a trim or a compaction, return an idle model's warm pool, serve the memory
pressure and the sleep requests, and keep the heartbeat fresh.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..segment import layout as L
from .poller import HEARTBEAT_INTERVAL_S

if TYPE_CHECKING:
    from .served import Served


class WatchState:
    """What the watcher remembers between ticks."""

    __slots__ = ("activity", "active_at", "idle_after", "last_beat")

    def __init__(self, idle_after: float | None) -> None:
        self.last_beat = 0.0
        self.activity: tuple | None = None
        self.active_at = time.monotonic()
        self.idle_after = idle_after  # KVCACHED_IDLE_RETURN_S; None: never


def tick(m: Served, state: WatchState) -> bool:
    """One tick of the process's poller (poked by a controller, or every heartbeat interval): apply
    controllers' limit and trim requests, return an idle pool, keep the heartbeat fresh; False once closed."""
    if m._closed:
        return False
    # Look without the lock first (plain reads; the control block is the controllers' to
    # write): most ticks find nothing to do and must not make an alloc wait.
    now = time.monotonic()
    seen = (m.alloc_count, m.free_count, m.pages.blocks_used, len(m.cache), m.traffic_published)
    if seen != state.activity:
        state.activity, state.active_at = seen, now
    idle_after = state.idle_after
    idle = idle_after is not None and now - state.active_at >= idle_after and bool(m.pages.reserved)
    request = m.segment.read_control()
    asked = request is not None and (request.limit_revision > m.applied_revision
                                     or request.trim_seq > m.trim_ack_seq
                                     or request.compact_seq > m.compaction.acked_seq)
    if idle or asked:
        serve_controls(m, idle)
    if m.pressure.pending():
        with m._lock:
            if not m._closed:
                m.pressure.tick()
    elif m.limit_status == L.LIMIT_DEFERRED and m._evict_handler is not None and m.cache.blocks:
        with m._lock:  # still deferred: the engine may have cached blocks since (an idle one evicts nothing)
            m._ask_evict()
    m.sleep.tick(now - state.active_at)
    now = time.monotonic()
    if now - state.last_beat >= HEARTBEAT_INTERVAL_S * 0.9:  # every tick: ticks come at the interval
        m.segment.heartbeat()
        state.last_beat = now
    return True


def serve_controls(m: Served, idle: bool) -> None:
    """Apply a new limit, answer a trim, or return an idle model's pool (the watcher found one)."""
    with m._lock:
        if m._closed:
            return
        if idle and m.pages.reserved:
            return_idle_pool(m)
        request = m.segment.read_control()
        changed = False
        if request is not None and request.limit_revision > m.applied_revision:
            m._apply_limit(request.limit_bytes)
            m.applied_revision = request.limit_revision
            changed = True
        if request is not None and request.trim_seq > m.trim_ack_seq:
            freed = m._unmap_reserved(len(m.pages.reserved))
            m.backend.trim_pool(0)
            m.trimmed_total += freed
            m.trim_bytes = freed
            m.trim_ack_seq = request.trim_seq
            changed = True
        if changed:
            m._publish()
        if request is not None and request.compact_seq > m.compaction.acked_seq:
            serve_compact(m, request.compact_seq)


def serve_compact(m: Served, seq: int) -> None:
    """Answer a controller's compact request (lock held): compacted with its bytes, no handler, or failed."""
    stats = m.compaction
    if m._compact_handler is None and m.staged.poke is not None:
        m.staged.request(seq)  # answered when the engine's two-phase compaction ends
        return
    if m._compact_handler is None:
        stats.answer(seq, L.COMPACT_NO_HANDLER)
    else:
        try:
            result = m._compact()
        except BaseException:  # the engine's copy failed (SystemExit included): nothing moved,
            # the controller is told, and the poller goes on serving the process's other allocators
            logging.getLogger(__name__).exception("%s: the engine's compact handler failed", m.name)
            stats.answer(seq, L.COMPACT_FAILED)
        else:
            stats.answer(seq, L.COMPACT_DONE, result.bytes_copied, result.bytes_returned)
    m.segment.publish_compaction(stats.values())


def return_idle_pool(m: Served) -> None:
    """No traffic for a while: the warm pool goes back too (it refills when traffic resumes)."""
    freed = m._unmap_reserved(len(m.pages.reserved))
    m.backend.trim_pool(0)
    m.idle_returned += freed
    m._publish()
