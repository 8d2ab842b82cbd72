"""What the process's poller does for one allocator at each tick (:mod:`kvcached_core.allocator.poller`):
apply a controller's limit, answer a trim or a compaction, return an idle model's warm pool, serve the memory
pressure and the sleep requests, and keep the heartbeat fresh.

Under a budget shared with other models (``backend.ledger``) it also carries room between them: memory this model
gave back to the budget pokes the models that wait for room (:func:`wake_waiters`), and a model poked while its
engine waits for room calls the engine's room handler when its room grew (:func:`look_for_room`). Neither waits on
a lock another process can hold, and the handler runs with no lock held.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from ..segment import layout as L
from .poller import HEARTBEAT_INTERVAL_S, on_poller_thread, poke

if TYPE_CHECKING:
    from .served import Served


class WatchState:
    """What the watcher remembers between ticks."""

    __slots__ = ("activity", "active_at", "idle_after", "last_beat", "ledger", "room_seen")

    def __init__(self, idle_after: float | None) -> None:
        self.last_beat = 0.0
        self.activity: tuple | None = None
        self.active_at = time.monotonic()
        self.idle_after = idle_after  # KVCACHED_IDLE_RETURN_S; None: never
        self.ledger: Any = None  # the shared budget's ledger, once its release hook is set (first tick)
        self.room_seen = -1  # the budget's room (bytes) at the last look while the engine waited for room; -1: none


def tick(m: Served, state: WatchState) -> bool:
    """One tick of the process's poller (poked by a controller, or every heartbeat interval): apply
    controllers' limit and trim requests, return an idle pool, keep the heartbeat fresh; False once closed."""
    if m._closed:
        return False
    ledger = state.ledger
    if ledger is None:
        ledger = state.ledger = bind_release(m)
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
    if ledger is not False:
        if ledger.released:
            wake_waiters(ledger)
        look_for_room(m, ledger, state)
    now = time.monotonic()
    if now - state.last_beat >= HEARTBEAT_INTERVAL_S * 0.9:  # every tick: ticks come at the interval
        m.segment.heartbeat()
        state.last_beat = now
    return True


def bind_release(m: Served) -> Any:
    """Have memory this model gives back to a shared budget wake the models that wait for room: the ledger's release
    hook pokes this model's poller (which then pokes them: :func:`wake_waiters`), or, once the model is closed (no
    tick of it comes any more), pokes them itself. The ledger, or False where the backend shares no budget."""
    ledger = getattr(m.backend, "ledger", None)
    if ledger is None:
        return False
    ref, token = weakref.ref(m), m.segment.wake_token

    def released(due: bool) -> None:
        manager = ref()
        if manager is None or manager._closed:
            wake_waiters(ledger)  # closing (its lock may be held: wake_waiters takes none)
        elif not due and not on_poller_thread():
            poke(token)  # (on the poller, the tick under way wakes them when it ends; a due wake is poked already)

    ledger.on_release = released
    return ledger


def wake_waiters(ledger: Any) -> None:
    """Memory went back to the budget: poke every other model on it that waits for room (one scan, one datagram
    each)."""
    for token in ledger.waiters():
        poke(token)


def look_for_room(m: Served, ledger: Any, state: WatchState) -> None:
    """While the engine waits for room (:meth:`~.admission.Admission.room_refused`), call its room handler (no lock
    held) when the budget's room (free, and the others' warm pools a reclaim takes at once) grew since the last
    look to at least a page: another model gave memory back and poked this one, or a heartbeat found it."""
    if not m._room_wanted or m._room_handler is None:
        state.room_seen = -1
        return
    room = ledger.free_bytes() + ledger.takeable_bytes()  # a fresh scan: the poke came after the release
    grew = room > state.room_seen and room >= m.bundle_bytes
    state.room_seen = room
    if grew:
        m._room_came()


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
