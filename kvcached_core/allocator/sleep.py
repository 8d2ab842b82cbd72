"""Sleep and wake, the allocator's side: a model gives back its whole KV memory and takes it again.

A controller writes a sleep request into the CONTROL block (``layout.SLEEP_CTL``: revision,
action, after-idle policy, check); the process's poller sees it at its next tick and hands it to
the engine's sleep handler. The engine stops scheduling, lets running requests finish (or
preempts them for ``now``), frees every block and calls :meth:`SleepControl.ready`; the
allocator then unmaps every page and publishes ``asleep`` with the bytes released and how long it
took (``layout.SLEEP``). Only the KV cache sleeps: weights and everything else stay.

The after-idle policy is held here, in the allocator: after that long without an alloc, a free or
an engine step (``publish_traffic``) the model sleeps by itself; the engine wakes it when a
request arrives (:meth:`wake`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..segment import layout as L

if TYPE_CHECKING:
    from .manager import KVCacheManager

# handler(action): action is "sleep", "sleep_now" or "wake"; called from the poller thread, it must
# return at once and have its engine call ready() (after a sleep) once no block is in use.
SleepHandler = Callable[[str], None]


class SleepControl:
    """One allocator's sleep state, policy and acknowledgement (written to the segment's SLEEP words)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._m = manager
        self.handler: SleepHandler | None = None
        self.state = L.SLEEP_AWAKE
        self.acked_revision = 0
        self.after_idle_s: float | None = None
        self.slept_bytes = 0
        self.took_ns = 0
        self._started = 0
        self._mapped_at_start = 0
        self._awake_since = time.monotonic()  # the idle clock restarts at each wake
        self._lock = threading.RLock()  # the poller and the engine's thread both move the state
        self._write()

    def _write(self) -> None:
        """Publish the SLEEP words, sealed: a reader sees all of them as of one call, never a mix or zeros."""
        self._m.segment.publish_sleep(int(self.handler is not None), self.state, self.acked_revision,
                                      -1 if self.after_idle_s is None else round(self.after_idle_s * 1000),
                                      self.slept_bytes, self.took_ns)

    def set_handler(self, handler: SleepHandler | None) -> None:
        with self._lock:
            self._m._check_open()
            self.handler = handler
            self._write()

    def read_request(self) -> tuple[int, int, int] | None:
        """(revision, action, after_idle_ms) of a controller's request not yet taken; None when there is none
        (or it is half-written)."""
        revision, action, after_idle_ms, check = L.SLEEP_CTL.unpack_from(self._m.segment._buf, L.SLEEP_CTL_OFF)
        if revision <= self.acked_revision or check != L.sleep_check(action, after_idle_ms, revision):
            return None
        return revision, action, after_idle_ms

    def tick(self, idle_s: float) -> None:
        """From the poller: take a controller's request, or sleep by the policy after ``idle_s`` without traffic."""
        with self._lock:
            if self._m._closed:
                return
            self._tick(min(idle_s, time.monotonic() - self._awake_since))

    def _tick(self, idle_s: float) -> None:
        request = self.read_request()
        if request is not None:
            revision, action, after_idle_ms = request
            if after_idle_ms != L.SLEEP_IDLE_KEEP:
                self.after_idle_s = None if after_idle_ms == L.SLEEP_IDLE_OFF else after_idle_ms / 1000
            self.acked_revision = revision
            if self.handler is None:
                self._write()  # answered: the controller sees capable 0 and says so
            elif action in (L.SLEEP_SOON, L.SLEEP_NOW):
                self.sleep(now=action == L.SLEEP_NOW)
            elif action == L.SLEEP_WAKE:
                self.wake()
            else:
                self._write()
            return
        if (self.after_idle_s is not None and self.handler is not None and self.state == L.SLEEP_AWAKE
                and idle_s >= self.after_idle_s):
            self.sleep(now=False)

    def sleep(self, *, now: bool = False) -> None:
        """Start sleeping: the engine drains, then calls :meth:`ready` (at once when nothing is in use)."""
        with self._lock:
            self._m._check_open()
            handler = self.handler
            if handler is None:
                raise RuntimeError(f"{self._m.name}: no sleep handler registered: its engine cannot sleep")
            if self.state == L.SLEEP_ASLEEP:
                self._write()
                return
            if self.state == L.SLEEP_AWAKE:
                self._started = time.monotonic_ns()
                self._mapped_at_start = self._m.backend_mapped_bytes()
                self.state = L.SLEEP_DRAINING
            # The handler first, then the answer: a controller that reads "draining" may send requests at
            # once, and the engine has stopped admitting new ones by then (the handler does that first).
            handler("sleep_now" if now else "sleep")
            self._write()

    def ready(self) -> int:
        """The engine holds no block: unmap every page; returns the bytes released since the sleep began."""
        with self._lock:
            self._m._check_open()
            if self.state != L.SLEEP_DRAINING:
                return 0
            self._m.release_all()
            self.slept_bytes = max(0, self._mapped_at_start - self._m.backend_mapped_bytes())
            self.took_ns = time.monotonic_ns() - self._started
            self.state = L.SLEEP_ASLEEP
            self._write()
            return self.slept_bytes

    def wake(self) -> None:
        """Lift sleep (a controller's wake, or the engine's first request after it): the engine schedules again."""
        with self._lock:
            self._m._check_open()
            self._awake_since = time.monotonic()
            if self.state == L.SLEEP_AWAKE:
                self._write()
                return
            self.state = L.SLEEP_AWAKE
            self._write()
            if self.handler is not None:
                self.handler("wake")
