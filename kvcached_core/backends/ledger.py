"""One KV budget per device, shared by every allocator on it, across processes.

Each allocator records the bytes it holds in its own segment (the LIVENESS block's CLAIMED
word); a process that wants more records the larger claim first, then sums the claims of the
other live segments of the same backend and device, and backs off if they exceed the budget.
The same scan counts the others' warm pools a reclaim could take (:meth:`CapacityLedger.takeable_bytes`),
which admission counts as room, and the working memory the engines registered and do not hold yet
(:meth:`DeviceScan.working_bytes`), which the CUDA backend keeps free beside its headroom, with or without a
budget (a :class:`DeviceScan` alone then).

The host backend's budget is ``KVCACHED_HOST_CAPACITY``; the CUDA backend's is
``KVCACHED_DEVICE_BUDGET`` when set (without it the driver's own out-of-memory is the budget).

Memory given back to the budget (a warm pool overflowing, idle return, a trim, a reclaim answered, a model
closing) raises ``released`` and calls ``on_release``; :meth:`CapacityLedger.waiters` then finds, in one scan, the
wake tokens of the segments on the budget that publish ``wanted_bytes > 0`` (a growth or an admission the budget
refused), which the allocator pokes (:mod:`kvcached_core.allocator.serving`).

A flock on one owner-only lock file per budget, taken without waiting, keeps claimers from
backing off each other needlessly; a held lock (a stopped holder) or one that is not ours is
skipped, never waited on. Only growth claims, and only in the background thread or on a pool
miss, never on the alloc hot path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..hostmem import available_ram_bytes
from ..segment import layout as L
from ..segment.liveness import writer_alive
from ..segment.names import SEGMENT_PREFIX
from ..settings import settings

LOCK_NAME = ".kvc-host-capacity.lock"  # the host budget's lock file; a device budget's: lock_name("cuda", device)
LOCK_WAIT_S = 2.0  # the most _lock waits by default; claims take it without waiting
RAM_MARGIN = 256 * 1024 * 1024  # the host budget also leaves this much of the machine's RAM free
# Backend.budget_free_bytes: how old the others' claims may be. Every scan refreshes them (a claim's, a wake's), so
# the age only bounds how late a model that neither grows nor waits for room sees what the others gave back: one
# that waits is poked and scans at once (allocator/serving.py). 10 ms was a scan about every engine step.
BUDGET_MAX_AGE_S = 0.1
ALIVE_KEEP_S = 1.0  # a writer found alive is taken as alive this long without asking /proc again (per scan)


def lock_name(backend: str, device: int | None) -> str:
    """The lock file of one budget: the host's (every device shares the machine's RAM) or one device's."""
    return LOCK_NAME if backend == "host" else f".kvc-{backend}{device}-budget.lock"


def _flock_within(fd: int, wait: float) -> bool:
    """flock ``fd`` exclusively, polling for at most ``wait`` s; False when another process holds it longer."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)


class DeviceScan:
    """What the live allocators of ``backend`` (on ``device``) publish, counted in one scan of the segment directory:
    the others' claims (bounded by ``capacity``), the others' warm pools a reclaim can take, and the working memory
    the engines of every one of them, this process's too, still need (:func:`_outstanding`, no more than
    ``working_max`` each). Kept for the readers of the figures; :meth:`working_bytes` is what the CUDA backend's
    headroom keeps free beside its own (``KVCACHED_DEVICE_HEADROOM``).

    ``device`` None counts every device of the backend (the host backend: one machine's RAM).
    """

    def __init__(self, capacity: int, directory: Path | None = None, *, backend: str = "host",
                 device: int | None = None, working_max: int | None = None) -> None:
        self.capacity = capacity
        self.directory = directory or settings().shm_dir
        self.backend = backend
        self.device = device
        self.working_max = capacity if working_max is None else working_max
        self._own: tuple[int, int] | None = None  # our segment's (st_dev, st_ino): counted as self.claimed
        self._others_cached, self._others_at = 0, float("-inf")  # see free_bytes
        self._takeable_cached = 0  # see takeable_bytes: counted in the same scan
        self._working_cached = 0  # see working_bytes: counted in the same scan
        self._alive: dict[tuple[int, int, int, int], float] = {}  # a writer found alive: until when it is believed
        self.scans = 0  # directory scans made (every one refreshes the figures free_bytes counts)

    def _mine(self, head: dict, st: os.stat_result) -> bool:
        """Whether a segment is our own (before :meth:`bind` names it: any of this process)."""
        return (st.st_dev, st.st_ino) == self._own if self._own else head["pid"] == os.getpid()

    def _shares(self, head: dict) -> bool:
        """Whether a segment with this header is on our budget (its backend and device)."""
        if L.decode_text(head["backend"]) != self.backend:
            return False
        return self.device is None or head["device"] == self.device

    def _refresh(self, waiters: list[int] | None = None) -> int:
        """One scan, kept for :meth:`free_bytes`, :meth:`takeable_bytes` and :meth:`working_bytes`; the others'
        claims."""
        (others, self._takeable_cached, self._working_cached), self._others_at = self._scan(waiters), time.monotonic()
        self._others_cached = others
        return others

    def working_bytes(self, max_age_s: float = 0.0) -> int:
        """The working memory the engines on this budget still need (:func:`_outstanding`, ours included), counted
        at most ``max_age_s`` ago."""
        if max_age_s <= 0 or time.monotonic() - self._others_at > max_age_s:
            self._refresh()
        return self._working_cached

    def _scan(self, waiters: list[int] | None = None) -> tuple[int, int, int]:
        """Bytes the other live allocators on this budget claim, of those the bytes of their warm pools a reclaim can
        take (:func:`_takeable`), and the working memory every live one's engine still needs (:func:`_outstanding`).
        Only claims that can be verified count. ``waiters``, when given, receives the wake tokens of the others that
        wait for room (:func:`_waits`).

        A segment counts when it is an owner-only regular file and its writer is alive by the one liveness verdict
        (a process of the file's owner, or a fresh heartbeat across pid namespaces); a claim counts when it is no
        more than the whole capacity (no allocator can hold more).
        """
        self.scans += 1
        try:  # each segment opened relative to the directory's fd: no path built and resolved per segment
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return 0, 0, 0
        try:
            return self._scan_in(dfd, waiters)
        finally:
            os.close(dfd)

    def _scan_in(self, dfd: int, waiters: list[int] | None) -> tuple[int, int, int]:
        """:meth:`_scan` over the directory open as ``dfd``."""
        total = takeable = working = 0
        try:
            names = os.listdir(dfd)
        except OSError:
            return 0, 0, 0
        now = time.monotonic()
        for name in names:
            if not name.startswith(SEGMENT_PREFIX):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                raw = os.pread(fd, L.PAGE_MAP_OFF, 0)
            except OSError:
                continue
            finally:
                os.close(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or len(raw) < L.PAGE_MAP_OFF or raw[:8] != L.MAGIC:
                continue
            head = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0), strict=False))
            if not self._shares(head):
                continue
            if self._mine(head, st):
                working += _outstanding(raw, self.working_max)  # our claim is self.claimed; our engine's needs count
                continue
            if not self._writer_alive(head, raw, st.st_uid, now):
                continue
            working += _outstanding(raw, self.working_max)
            claimed = L.U64.unpack_from(raw, L.CLAIMED_OFF)[0]
            if claimed <= self.capacity:
                total += claimed
                takeable += min(claimed, _takeable(raw))
                if waiters is not None and head["wake_token"] and _waits(raw):
                    waiters.append(head["wake_token"])
        return total, takeable, working

    def _writer_alive(self, head: dict, raw: bytes, uid: int, now: float) -> bool:
        """The liveness verdict, a live one kept :data:`ALIVE_KEEP_S` (reading /proc for each segment at every scan
        was most of a scan's cost); a writer gone since counts its claim that much longer, never less."""
        key = (head["pid"], head["start_time"], head.get("pid_ns", 0), uid)
        if self._alive.get(key, 0.0) > now:
            return True
        if not writer_alive(head, raw, uid):
            self._alive.pop(key, None)
            return False
        if len(self._alive) > 256:
            self._alive = {k: t for k, t in self._alive.items() if t > now}
        self._alive[key] = now + ALIVE_KEEP_S
        return True


class CapacityLedger(DeviceScan):
    """Shares one budget of ``capacity`` bytes between the allocators of ``backend`` (on ``device``)."""

    def __init__(self, capacity: int, directory: Path | None = None, *, backend: str = "host",
                 device: int | None = None, working_max: int | None = None) -> None:
        super().__init__(capacity, directory, backend=backend, device=device, working_max=working_max)
        self.claimed = 0
        # The threads of one process (the refill thread mapping, alloc growing on a miss, an unmap under the
        # manager's lock) change ``claimed`` one at a time: a claim reads it, scans the others, then sets it,
        # and a release between the two was lost (the ledger then held more than was mapped, for good).
        self._mutex = threading.RLock()
        self._set_claimed: Callable[[int], None] | None = None  # callback into our segment
        # Memory went back to the budget since the last waiters() (a plain flag: set by release and settle).
        self.released = False
        # Called (no lock of the ledger held) at each release, with whether a wake was already due: the allocator
        # has the waiters poked (allocator/serving.py).
        self.on_release: Callable[[bool], None] | None = None

    def bind(self, set_claimed: Callable[[int], None] | None, own_segment: tuple[int, int] | None = None) -> None:
        self._set_claimed = set_claimed
        self._own = own_segment

    def _others(self) -> int:
        """Bytes the other live allocators on this budget claim (see :meth:`_scan`), now; :meth:`free_bytes` counts the
        figure too."""
        return self._refresh()

    def claim(self, nbytes: int) -> bool:
        """Claim ``nbytes`` more; False when the shared budget (or, on the host, the machine's RAM) says no."""
        with self._mutex:
            return self.claim_total(self.claimed + nbytes)

    def claim_total(self, total: int) -> bool:
        """Hold ``total`` bytes in all (at least what is held now); False, with nothing changed, when it does not fit."""
        with self._mutex:  # another thread of this process waits at most one scan of the directory
            grow = total - self.claimed
            if grow <= 0:
                return True
            if self.backend == "host":
                available = available_ram_bytes()
                if available and available < grow + RAM_MARGIN:
                    return False
            fd = self._lock(wait=0)  # alloc may be waiting on this: never wait on another process
            try:
                # Announce first, then count the others: two claimers that could not both take the lock
                # (held by a stopped process, or not ours to use) still see each other, and both back off.
                self._announce(total)
                if self._others() + total > self.capacity:
                    self._announce(self.claimed)
                    return False
                self.claimed = total
                return True
            finally:
                if fd >= 0:
                    self._unlock(fd)

    def _lock(self, wait: float = LOCK_WAIT_S) -> int:
        """The lock file, created and flocked within ``wait`` s; -1 when it is held longer or not ours to use.

        The file lives only while a claim is made: its holder unlinks it before unlocking, so a
        process that was waiting on that inode sees the name gone or pointing elsewhere, and retries.
        """
        path = self.directory / lock_name(self.backend, self.device)
        for _ in range(64):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError:
                return -1  # e.g. another user's file by that name
            try:
                mine = os.fstat(fd)
                if mine.st_uid != os.getuid() or mine.st_mode & 0o077:
                    os.close(fd)
                    return -1  # never use a lock another user owns or may open
                if not _flock_within(fd, wait):
                    os.close(fd)
                    return -1  # held, perhaps by a stopped process: claim() is safe unlocked, never waits
                now = os.lstat(path)
                if (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
                    return fd
            except OSError:
                pass  # unlinked by its last holder while we waited
            os.close(fd)
        return -1

    def _unlock(self, fd: int) -> None:
        """Unlink the lock file (still the inode we locked: nobody else can replace it meanwhile), then unlock."""
        try:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / lock_name(self.backend, self.device))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _announce(self, nbytes: int) -> None:
        if self._set_claimed:
            self._set_claimed(nbytes)

    def release(self, nbytes: int) -> None:
        with self._mutex:
            before = self.claimed
            self.claimed = max(0, self.claimed - nbytes)
            self._announce(self.claimed)
        if self.claimed < before:
            self._released()

    def settle(self, held: int | Callable[[], int]) -> None:
        """What is held now, after a change that needs no claim (memory given back, a claim not used).

        A callable is asked under the ledger's lock: a figure read before it could be older than what
        another thread settled meanwhile, and would overwrite it."""
        with self._mutex:
            before = self.claimed
            self.claimed = max(0, held() if callable(held) else held)
            self._announce(self.claimed)
        if self.claimed < before:
            self._released()

    def _released(self) -> None:
        """Memory went back to the budget: tell the hook whether a wake was already due (``released`` was up)."""
        due, self.released = self.released, True
        hook = self.on_release
        if hook is not None:
            hook(due)

    def waiters(self) -> list[int]:
        """After memory went back to the budget: the wake tokens of the other models on it that wait for room
        (``wanted_bytes > 0``), for the allocator to poke. One directory scan (which also refreshes what
        :meth:`free_bytes` counts), no lock taken; clears ``released``."""
        self.released = False
        found: list[int] = []
        self._refresh(found)
        return found

    def free_bytes(self, max_age_s: float = 0.0) -> int:
        """What the budget leaves; the others' claims counted at most ``max_age_s`` ago (a directory scan each time
        they are counted: an engine that asks every scheduling pass takes a figure up to :data:`BUDGET_MAX_AGE_S`
        old, or the one its last claim or wake counted)."""
        if max_age_s <= 0 or time.monotonic() - self._others_at > max_age_s:
            self._refresh()
        return max(0, self.capacity - self._others_cached - self.claimed)

    def takeable_bytes(self) -> int:
        """Of the others' claims, the bytes of their warm pools (reserved pages, above their ``min``) that a reclaim
        gives first and at once: counted by the scan of the last :meth:`free_bytes`."""
        return self._takeable_cached


def _waits(raw: bytes) -> bool:
    """Whether one segment (its header up to the page map) publishes bytes a refused growth or admission waits for
    (PRESSURE's ``wanted_bytes``: one aligned word, read alone)."""
    return L.U64.unpack_from(raw, _WANTED_OFF)[0] > 0


_WANTED_OFF = L.PRESSURE_OFF + 8 + 8 * L.PRESSURE_FIELDS.index("wanted_bytes")  # after the block's sequence


def _outstanding(raw: bytes, most: int) -> int:
    """The working memory one segment's engine registered and does not hold yet (``layout.WORKING_*``: the peak
    less what its process holds now); 0 for a peak past ``most`` (the device's memory: no engine's can be)."""
    peak, now = L.U64.unpack_from(raw, L.WORKING_PEAK_OFF)[0], L.U64.unpack_from(raw, L.WORKING_NOW_OFF)[0]
    return max(0, peak - now) if peak <= most else 0


def _takeable(raw: bytes) -> int:
    """The reserved bytes a reclaim could take from one segment (its header up to the page map): its warm pool,
    never below its ``min``; 0 while its counters are being published (an odd sequence)."""
    if L.U64.unpack_from(raw, L.SEQ_OFF)[0] & 1:
        return 0
    counters = L.COUNTERS.unpack_from(raw, L.COUNTERS_OFF)
    inuse, reserved, mapped = counters[0], counters[1], counters[4]
    if not reserved or mapped <= 0:
        return 0
    bundle = mapped // (inuse + reserved)
    floor = L.PRESSURE.unpack_from(raw, L.PRESSURE_OFF + 8)[1]  # min_bytes (after the block's sequence); -1: none
    floor = -(-floor // bundle) * bundle if floor > 0 and bundle else 0  # whole pages, as reclaim keeps them
    return max(0, min(bundle * reserved, mapped - floor))

