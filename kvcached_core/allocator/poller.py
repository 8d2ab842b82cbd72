"""One background thread per process serves every allocator's controls, idle return and heartbeat.

A controller that writes a segment's CONTROL block pokes its allocator: one datagram to an
abstract unix socket named after the segment's random wake token (:func:`poke`), so a limit or
trim is applied at once without anyone polling. Without a poke (a controller in another network
namespace, a socket name taken by someone else), the request is seen at the next heartbeat tick,
every ``HEARTBEAT_INTERVAL_S``. An idle allocator costs that tick and nothing else, however many
allocators the process holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

HEARTBEAT_INTERVAL_S = 0.5  # a sixth of the 3 s after which a heartbeat is late
UNREGISTER_WAIT_S = 5.0  # the most unregister waits for a tick of its allocator to end
_WAKE_PREFIX = b"\0kvcached-wake-"


def wake_address(token: int) -> bytes:
    return _WAKE_PREFIX + f"{token:016x}".encode()


def poke(token: int) -> None:
    """Ask the allocator whose segment carries wake ``token`` to look at its CONTROL block now (best effort)."""
    if not token:
        return
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.sendto(b"!", wake_address(token))


class _Entry:
    """One served allocator: a weak reference, its wake socket and what its tick remembers."""

    __slots__ = ("ref", "sock", "state", "lock", "poked", "removed", "failed")

    def __init__(self, ref: weakref.ref, sock: socket.socket | None, state: Any) -> None:
        self.ref, self.sock, self.state = ref, sock, state
        self.lock = threading.RLock()  # held while a tick runs; unregister waits on it
        self.poked = True  # a first tick at once: apply what controllers asked before we listened
        self.removed = False
        self.failed = False


class Poller:
    """Runs ``tick(manager, state)`` for every registered manager when poked and every heartbeat interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._retired: list[_Entry] = []
        self._thread: threading.Thread | None = None
        self._selector: selectors.BaseSelector | None = None
        self._bell_r, self._bell_w = socket.socketpair()  # wakes the thread when entries change
        self._bell_r.setblocking(False)
        self._bell_w.setblocking(False)

    def register(self, manager: Any, token: int, tick: Callable[[Any, Any], bool], state: Any) -> _Entry:
        """Serve ``manager`` (held weakly); ``tick`` returns False once the manager is closed."""
        new = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock: socket.socket | None = new
        try:
            new.setblocking(False)
            new.bind(wake_address(token))
        except OSError:  # the name is taken: no pokes, the heartbeat tick still serves it
            new.close()
            sock = None
        entry = _Entry(weakref.ref(manager), sock, (tick, state))
        with self._lock:
            self._entries.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvc-poller", daemon=True)
                self._thread.start()
        self._ring()
        return entry

    def unregister(self, entry: _Entry) -> None:
        """Stop serving ``entry``; returns once no tick of it runs (at once from inside one)."""
        held = entry.lock.acquire(timeout=UNREGISTER_WAIT_S)  # bounded: a lock inherited held across fork()
        entry.removed = True
        if held:
            entry.lock.release()
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)
            self._retired.append(entry)  # the thread closes its socket (it may be listening on it)
            if self._thread is None:
                self._close_retired(None)
        self._ring()

    def _close_retired(self, selector: selectors.BaseSelector | None) -> None:
        """Close the sockets of unregistered entries (called with ``self._lock`` held)."""
        for entry in self._retired:
            if entry.sock is not None:
                fd = entry.sock.fileno()  # -1 once closed
                if selector is not None and fd >= 0 and fd in selector.get_map():
                    selector.unregister(entry.sock)
                entry.sock.close()
        self._retired.clear()

    def _ring(self) -> None:
        with contextlib.suppress(OSError):
            self._bell_w.send(b"!")

    def _sync(self, selector: selectors.BaseSelector, entries: list[_Entry]) -> None:
        """Listen on the sockets of ``entries`` and of nothing else (closing the sockets of removed ones)."""
        with self._lock:
            self._close_retired(selector)
        wanted = {e.sock.fileno(): e for e in entries if e.sock is not None and not e.removed}
        for key in list(selector.get_map().values()):
            if key.data is not None and wanted.get(key.fd) is not key.data:
                selector.unregister(key.fileobj)  # removed by its tick (the manager went away)
                key.data.sock.close()
        registered = selector.get_map()
        for fd, entry in wanted.items():
            if fd not in registered and entry.sock is not None:
                selector.register(entry.sock, selectors.EVENT_READ, entry)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._bell_r, selectors.EVENT_READ, None)
        next_beat = 0.0
        try:
            while True:
                with self._lock:
                    entries = list(self._entries)
                    if not entries:
                        self._thread = None
                        self._close_retired(selector)
                        return
                self._sync(selector, entries)
                timeout = 0.0 if any(e.poked for e in entries) else max(0.0, next_beat - time.monotonic())
                for key, _ in selector.select(timeout):
                    _drain(key.fileobj)
                    if key.data is not None:
                        key.data.poked = True
                now = time.monotonic()
                beat = now >= next_beat  # every allocator at once: one wake-up per interval, however many
                if beat:
                    next_beat = now + HEARTBEAT_INTERVAL_S
                for entry in entries:
                    if beat or entry.poked:
                        self._tick(entry)
                if any(e.removed for e in entries):
                    with self._lock:
                        self._entries = [e for e in self._entries if not e.removed]
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None  # (also after an error: the next register starts another)
            for key in list(selector.get_map().values()):
                if key.data is not None:
                    key.data.sock.close()
            selector.close()

    @staticmethod
    def _tick(entry: _Entry) -> None:
        entry.poked = False
        with entry.lock:
            if entry.removed:
                return
            manager = entry.ref()
            if manager is None:
                entry.removed = True
                return
            tick, state = entry.state
            try:
                alive = tick(manager, state)
                entry.failed = False
            except BaseException as exc:  # noqa: BLE001 - nothing one allocator (or its engine's handler) raises,
                # SystemExit and KeyboardInterrupt included, stops the thread that serves the process's others
                alive = _failed(entry, manager, exc)
            if not alive:
                entry.removed = True
            del manager  # (its last reference may go here: __del__ closes it, re-entering this lock)


def on_poller_thread() -> bool:
    """True on the thread that serves this process's allocators (where a handler's SystemExit must not end it)."""
    return threading.current_thread() is _poller._thread


def _failed(entry: _Entry, manager: Any, exc: BaseException) -> bool:
    """A tick raised: False when its manager is closed under it (its segment unmapped: done with it), else say
    so (once until a tick succeeds again) and keep serving it (True)."""
    if isinstance(exc, (ValueError, OSError)) and getattr(manager, "_closed", True):
        return False
    if not entry.failed:
        entry.failed = True
        logging.getLogger(__name__).error("serving %s failed; retried at each tick",
                                          getattr(manager, "name", "an allocator"), exc_info=exc)
    return True


def _drain(sock: Any) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(64):
            pass


_poller = Poller()


def _after_fork() -> None:  # the thread did not come along: a child starts afresh
    global _poller
    _poller = Poller()


os.register_at_fork(after_in_child=_after_fork)


def register(manager: Any, token: int, tick: Callable[[Any, Any], bool], state: Any) -> _Entry:
    return _poller.register(manager, token, tick, state)


def unregister(entry: _Entry) -> None:
    _poller.unregister(entry)
