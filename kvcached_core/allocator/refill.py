"""The warm pool's refill: one background thread per allocator maps pages ahead of need, outside the lock,
so an alloc never waits on the device (the pool's bounds: ``KVCACHED_MIN/MAX_RESERVED_PAGES``).

The thread holds its allocator only while a look runs (:func:`loop`); the state it shares with ``alloc``
(``_refill_requested``, ``_refill_polling``, ``_refill_wanted``) stays on the allocator, where the C path reads it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from ..backends import BackendError
from ..segment import layout as L
from .pressure import LATE_LOOK_S

if TYPE_CHECKING:
    from .served import Served

# While traffic keeps draining the pool, the refill thread looks for work every REFILL_POLL_S
# instead of being woken: waking a thread costs the waker a futex syscall and a GIL hand-off
# inside alloc (benchmarks/vmm.py: with polling, grow and nogrow p99 agree). After REFILL_LINGER_S
# without a request it sleeps until an alloc wakes it again.
REFILL_POLL_S = 0.0005
REFILL_LINGER_S = 0.25
RELEASE_CHECK_S = 5.0  # an idle refill thread looks again this often, waiting without holding its manager
# The refill thread runs this much nicer than the engine: on a busy host, mapping ahead (a whole warm
# pool right after a wake) must not take CPU from the step that serves the request (benchmarks/sleep.py).
REFILL_NICE = 10
IDLE = -1.0  # step(): nothing to do until an alloc asks
MIN_WAIT_S = 0.001  # the shortest unwoken wait: a re-ask due now still lets the engine run between looks


def step(m: Served, linger_until: float) -> float | None:
    """One look of the refill thread (see :func:`loop`): the new ``linger_until``, None once
    closed, or ``IDLE`` when there is nothing to do until an alloc wakes it.

    Keeps the pool at its minimum, mapping outside the lock so alloc never waits on it.
    """
    if m.pressure.late:
        m.pressure.collect_late()
    given = m.pressure.relieve() if m.pressure.wanted else 0
    if given:
        with m._lock:  # other models gave memory: map what the refused growth needed now
            m._refill_requested = True
            asked = None if m.pressure.fixed_pace else take_given(m, given)
        if asked:
            return map_asked(m, asked, time.monotonic() + m.refill_linger_s)
        m._room_came()  # nothing to map here (the warm pool's refill maps it): the budget has room all the same
    if not (m._refill_requested or m._closed) and time.monotonic() < linger_until:
        time.sleep(REFILL_POLL_S)  # nothing asked: look again without touching the lock
        return linger_until
    with m._lock:
        while not m._closed and not due(m):
            if time.monotonic() < linger_until:
                break  # traffic was here lately: look again soon, unwoken
            m._refill_polling = False
            return IDLE  # the loop waits for the wake-up without holding the manager (see wait_s)
        if m._closed:
            return None
        if not due(m):
            asked = None
        else:
            asked = m.pages.take_unmapped(need(m))
            m._refill_requested = False
            linger_until = time.monotonic() + m.refill_linger_s
    if asked is None:
        time.sleep(REFILL_POLL_S)
        return linger_until
    return map_asked(m, asked, linger_until)


def take_given(m: Served, nbytes: int) -> list[int]:
    """The pages that ``nbytes`` given by other models back (lock held), taken to be mapped at once: the budget
    has them free now, and a third model's growth would take them first if they waited for the warm pool's
    refill. As many as the limit leaves; none while the model sleeps."""
    if m._closed or m.sleep.state != L.SLEEP_AWAKE:
        return []
    return m.pages.take_unmapped(min(nbytes // m.bundle_bytes, m._headroom()))


def map_asked(m: Served, asked: list[int], linger_until: float) -> float:
    """Map ``asked`` (taken from the unmapped pages) outside the lock, then settle them under it."""
    try:
        mapped = m.backend.map_pages(asked) if asked else []
    except BackendError:
        mapped = []  # a failed device (or lost rank) is a miss here; alloc's own map reports it
    with m._lock:
        m.pages.finish_mapping(asked, mapped)
        m._dirty.update(mapped)
        if m.sleep.state == L.SLEEP_ASLEEP:  # the model fell asleep while we mapped: nothing stays mapped
            m._unmap_reserved(len(m.pages.reserved))
        if m.limit_pages is not None:  # the limit fell while we mapped
            m._unmap_excess(newest=True)
            if m.limit_status == L.LIMIT_DEFERRED:
                m._update_limit_status()
        m._mapping_done.notify_all()
        if not m._closed:
            m._publish()
        if mapped and len(mapped) == len(asked):
            m.pressure.satisfied()
        if len(mapped) < len(asked):
            # The device said no. While a refused growth waits, ask the other models again (next step); a warm
            # pool alone never takes memory from another model. Then wait for the next alloc.
            if m.pressure.wanted:
                m.pressure.note_refused((len(asked) - len(mapped)) * m.bundle_bytes)
            linger_until = 0.0
            m._refill_polling = False
            m._refill_wanted.wait(timeout=0.05)
            m._refill_polling = True
    if mapped:
        m._room_came()  # an engine that waits for room admits at once (lock not held)
    return linger_until


def wait_s(m: Served) -> float:
    """How long an idle refill thread waits unwoken: until a refused growth that still waits may ask the other
    models again (:meth:`Pressure.next_ask_in`), until a donor's overdue answer is due another look
    (:meth:`Pressure.collect_late`), else until its next release check."""
    wait = LATE_LOOK_S if m.pressure.late else RELEASE_CHECK_S
    ask = m.pressure.next_ask_in()
    return wait if ask is None else min(wait, max(ask, MIN_WAIT_S))


def due(m: Served) -> bool:
    """An alloc asked for a refill and there is room to map; a stale request is dropped."""
    if m._refill_requested and need(m) > 0:
        return True
    m._refill_requested = False
    return False


def need(m: Served) -> int:
    if m.sleep.state != L.SLEEP_AWAKE or m.pressure.holding():
        return 0  # draining or asleep, or it just gave memory to another model: nothing is mapped ahead of need
    pool = len(m.pages.reserved) + m.pages.inflight
    want = m.min_reserved - pool
    if want > 0:  # a batch when the backend asks for one, never past the pool's maximum
        want = max(want, min(m.backend.refill_batch, m.max_reserved - pool))
    return min(want, m._headroom())


def lower_priority() -> None:
    """Linux gives each thread its own nice value: this one yields the CPU to the engine's threads."""
    with contextlib.suppress(AttributeError, OSError):  # no per-thread priority here: the thread runs as it did
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + REFILL_NICE))


# The background threads (the refill thread, the process's poller) hold their manager only while
# a step runs: a manager dropped without close() is then collected like any object (its __del__
# closes it), threads, memory and segment too.
def loop(ref: weakref.ref[Served]) -> None:
    lower_priority()
    linger_until = 0.0
    while True:
        manager = ref()
        if manager is None:
            return
        looked = step(manager, linger_until)
        if looked is None:
            return
        if looked == IDLE:
            wanted = manager._refill_wanted
            del manager  # (its last reference may go here: __del__ closes it, and the wait below ends)
            with wanted:  # an alloc that asked since the step returned has notified nobody: look first
                manager = ref()
                asked = manager is not None and (manager._refill_requested or manager._closed)
                timeout = RELEASE_CHECK_S if manager is None else wait_s(manager)
                del manager
                if not asked:
                    wanted.wait(timeout)
            manager = ref()
            if manager is not None:
                manager._refill_polling = True
        else:
            linger_until = looked
        del manager
