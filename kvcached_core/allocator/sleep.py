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

Asleep means nothing mapped, and the published state never says otherwise:

- :meth:`SleepControl.ready` while the engine still holds blocks (cached ones included) raises
  RuntimeError and the model stays draining: the engine frees every block, then calls it again.
- an ``alloc`` (or ``try_to_reserve``) that must map a page while the model is asleep wakes it, as
  the engine's first request would: ``awake`` is published before the page is mapped, and the
  engine's handler hears ``wake`` from the poller at once (not from inside the alloc), as after a
  controller's wake.
- a handler that raises (anything, SystemExit included) refuses the request: the model stays as it
  was (awake, refilling its pool), the failure is logged, and a controller's request is answered
  with ``refused_revision`` set to its revision, so the controller says so at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..segment import layout as L
from . import poller

if TYPE_CHECKING:
    from .parts import Allocator

# handler(action): action is "sleep", "sleep_now" or "wake"; called from the poller thread, it must
# return at once and have its engine call ready() (after a sleep) once no block is in use.
SleepHandler = Callable[[str], None]


class SleepControl:
    """One allocator's sleep state, policy and acknowledgement (written to the segment's SLEEP words)."""

    def __init__(self, manager: Allocator) -> None:
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
        self.refused_revision = 0  # the last controller request whose handler raised
        self._wake_owed = False  # an alloc woke the model: its handler hears "wake" at the poller's next tick
        # Serialises sleep, wake, ready and the handler calls (the poller and the engine's thread both move
        # the state). A state change and the SLEEP words also hold the manager's lock (taken after this one):
        # an alloc that wakes the model holds only that one.
        self._lock = threading.RLock()
        self._write()

    def _write(self) -> None:
        """Publish the SLEEP words, sealed: a reader sees all of them as of one call, never a mix or zeros."""
        with self._m._lock:  # the words of the latest state, never an older one after it
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
        (or it is half-written: its check does not match). A whole request whose revision is not the one last
        taken is new, even a lower one: a record left damaged (its revision word 0) must not make the next
        requests look old."""
        request = self._m.segment.read_sleep_request()
        if request is None or request[0] == self.acked_revision:
            return None
        return request

    def tick(self, idle_s: float) -> None:
        """From the poller: take a controller's request, or sleep by the policy after ``idle_s`` without traffic.

        A handler that raises (SystemExit included: this thread serves the process's other allocators) is
        logged; a controller's request it served is answered refused (``refused_revision``)."""
        with self._lock:
            if self._m._closed:
                return
            if self._wake_owed:
                self._tell_woken()
            taken = self.acked_revision
            try:
                self._tick(min(idle_s, time.monotonic() - self._awake_since))
            except BaseException:  # the handler's failure: said, answered, and the poller goes on
                logging.getLogger(__name__).exception("%s: the engine's sleep handler failed", self._m.name)
                self._awake_since = time.monotonic()  # the policy tries again after another idle period
                if self.acked_revision != taken:  # a controller's request: it learns it was refused
                    self.refused_revision = self.acked_revision
                    self._m.segment.publish_sleep_refused(self.refused_revision)  # before the acknowledgement
                self._write()

    def _tell_woken(self) -> None:
        """An alloc woke the model (:meth:`alloc_woke`): its handler hears ``wake`` now (from the poller)."""
        self._wake_owed = False
        handler = self.handler
        if handler is not None and self.state == L.SLEEP_AWAKE:
            try:
                handler("wake")
            except BaseException:  # the allocator is awake; the engine's log says why it is not
                logging.getLogger(__name__).exception("%s: the engine's sleep handler failed to wake", self._m.name)

    def _tick(self, idle_s: float) -> None:
        request = self.read_request()
        if request is not None:
            revision, action, after_idle_ms = request
            if after_idle_ms == L.SLEEP_IDLE_OFF:
                self.after_idle_s = None
            elif L.SLEEP_IDLE_MIN_MS <= after_idle_ms <= L.MAX_AFTER_IDLE_MS:  # else kept: no controller writes it
                self.after_idle_s = after_idle_ms / 1000
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
        """Start sleeping: the engine drains, then calls :meth:`ready` (at once when nothing is in use).

        The handler first, then the answer: a controller that reads "draining" may send requests at once,
        and the engine has stopped admitting new ones by then (the handler does that first). A handler
        that raises changes nothing (the model stays as it was, nothing is published) and the error is
        raised here."""
        m = self._m
        with self._lock:
            with m._lock:
                m._check_open()
                handler = self.handler
                if handler is None:
                    raise RuntimeError(f"{m.name}: no sleep handler registered: its engine cannot sleep")
                if self.state == L.SLEEP_ASLEEP:
                    self._write()
                    return
                was = self.state
                if was == L.SLEEP_AWAKE:
                    self._started = time.monotonic_ns()
                    self._mapped_at_start = m.backend_mapped_bytes()
                    self.state = L.SLEEP_DRAINING
            try:
                handler("sleep_now" if now else "sleep")
            except BaseException:
                with m._lock:
                    if self.state == L.SLEEP_DRAINING:  # (a ready() from inside the handler has gone on)
                        self.state = was
                raise
            self._write()

    def ready(self) -> int:
        """The engine holds no block: unmap every page; returns the bytes released since the sleep began.

        0 when no sleep is under way. Raises RuntimeError, and the model stays draining, while the engine
        still holds blocks (cached ones too): asleep means nothing mapped."""
        m = self._m
        with self._lock, m._lock:
            m._check_open()
            if self.state != L.SLEEP_DRAINING:
                return 0
            self._refuse_while_held()
            m.release_all()  # (it may wait for a refill batch in flight, letting allocs in meanwhile)
            self._refuse_while_held()
            self.slept_bytes = max(0, self._mapped_at_start - m.backend_mapped_bytes())
            self.took_ns = time.monotonic_ns() - self._started
            self.state = L.SLEEP_ASLEEP
            self._write()
            return self.slept_bytes

    def _refuse_while_held(self) -> None:
        held = self._m.pages.blocks_used
        if held:
            cached = len(self._m.cache)
            raise RuntimeError(f"{self._m.name}: ready() while the engine holds {held} blocks ({cached} of them "
                               f"cached): free every block first; the model stays draining")

    def alloc_woke(self) -> None:
        """An alloc must map a page while the model is asleep (the manager's lock held, from inside placement):
        the model is awake from now on, published before the page is mapped; the handler hears ``wake`` from
        the poller, poked at once."""
        self.state = L.SLEEP_AWAKE
        self._awake_since = time.monotonic()
        self._wake_owed = self.handler is not None
        self._write()
        poller.poke(self._m.segment.wake_token)

    def wake(self) -> None:
        """Lift sleep (a controller's wake, or the engine's first request after it): the engine schedules again."""
        m = self._m
        with self._lock:
            with m._lock:
                m._check_open()
                self._awake_since = time.monotonic()
                tell = self.state != L.SLEEP_AWAKE or self._wake_owed  # (an alloc woke it: its handler has not heard)
                self.state = L.SLEEP_AWAKE
                self._wake_owed = False
                self._write()
            if tell and self.handler is not None:
                self.handler("wake")
