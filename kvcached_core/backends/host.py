"""Host backend: real process memory from one anonymous MAP_NORESERVE mapping.

Layer-separated layout: buffer ``b`` of layer ``l`` is the range starting at
``((l * num_kv_buffers) + b) * range_bytes``, so every layer's K (or V) is one single-stride
array over blocks. Mapping a page commits its memory in each range with MADV_POPULATE_WRITE
(it counts in RSS, as GPU memory would count on a GPU); unmapping drops it with MADV_DONTNEED,
and RSS falls at once. On the host the cost is per byte (zeroing), so the layout costs nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from ..config import available_ram_bytes, host_capacity_bytes, shm_dir
from ..segment import layout as L
from ..segment.liveness import writer_alive
from ..segment.names import SEGMENT_PREFIX
from .base import Backend, BackendError, Geometry

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap lacks the name but passes the number
RAM_MARGIN = 256 * 1024 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _madvise(address: int, length: int, advice: int) -> None:
    """madvise(2) through ctypes, which releases the GIL: committing a page costs about as much as
    writing it, and mmap.madvise would hold every other thread (the engine's alloc) for that long."""
    if _libc.madvise(address, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
LOCK_NAME = ".kvc-host-capacity.lock"
LOCK_WAIT_S = 2.0  # the most _lock waits by default; claims take it without waiting


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


class HostCapacityLedger:
    """Shares ``KVCACHED_HOST_CAPACITY`` between processes.

    Each allocator records the bytes it holds in its own segment (CLAIMED); a process that wants
    more records the larger claim first, then sums the claims of live segments and backs off if
    they exceed the capacity. A flock on one owner-only lock file, taken without waiting, keeps
    claimers from backing off each other needlessly; a held lock (a stopped holder) or one that
    is not ours is skipped, never waited on. Only growth claims, and only in the background
    thread or on a pool miss, never on the alloc hot path.
    """

    def __init__(self, capacity: int, directory: Path | None = None) -> None:
        self.capacity = capacity
        self.directory = directory or shm_dir()
        self.claimed = 0
        self._set_claimed = None  # callback into our segment
        self._own: tuple[int, int] | None = None  # our segment's (st_dev, st_ino): counted as self.claimed

    def bind(self, set_claimed, own_segment: tuple[int, int] | None = None) -> None:  # noqa: ANN001
        self._set_claimed = set_claimed
        self._own = own_segment

    def _others(self) -> int:
        """Bytes the other live host allocators claim: only claims that can be verified count.

        A claim counts when its segment is an owner-only regular file, its writer is alive by the
        one liveness verdict (a process of the file's owner, or a fresh heartbeat across pid
        namespaces), and it claims no more than the whole capacity (no allocator can).
        """
        total = 0
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0
        for name in names:
            if not name.startswith(SEGMENT_PREFIX):
                continue
            try:
                fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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
            mine = (st.st_dev, st.st_ino) == self._own if self._own else head["pid"] == os.getpid()
            if L.decode_text(head["backend"]) != "host" or mine:
                continue
            claimed = L.U64.unpack_from(raw, L.CLAIMED_OFF)[0]
            if claimed <= self.capacity and writer_alive(head, raw, st.st_uid):
                total += claimed
        return total

    def claim(self, nbytes: int) -> bool:
        """Claim ``nbytes`` more; False when the shared capacity or the machine's RAM says no."""
        available = available_ram_bytes()
        if available and available < nbytes + RAM_MARGIN:
            return False
        fd = self._lock(wait=0)  # alloc may be waiting on this: never wait on another process
        try:
            # Announce first, then count the others: two claimers that could not both take the lock
            # (held by a stopped process, or not ours to use) still see each other, and both back off.
            self._announce(self.claimed + nbytes)
            if self._others() + self.claimed + nbytes > self.capacity:
                self._announce(self.claimed)
                return False
            self.claimed += nbytes
            return True
        finally:
            if fd >= 0:
                self._unlock(fd)

    def _lock(self, wait: float = LOCK_WAIT_S) -> int:
        """The lock file, created and flocked within ``wait`` s; -1 when it is held longer or not ours to use.

        The file lives only while a claim is made: its holder unlinks it before unlocking, so a
        process that was waiting on that inode sees the name gone or pointing elsewhere, and retries.
        """
        path = self.directory / LOCK_NAME
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
                os.unlink(self.directory / LOCK_NAME)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _announce(self, nbytes: int) -> None:
        if self._set_claimed:
            self._set_claimed(nbytes)

    def release(self, nbytes: int) -> None:
        self.claimed = max(0, self.claimed - nbytes)
        self._announce(self.claimed)

    def free_bytes(self) -> int:
        return max(0, self.capacity - self._others() - self.claimed)


class HostBackend(Backend):
    name = "host"

    def __init__(self, geometry: Geometry, device: int = 0, ledger: HostCapacityLedger | None = None) -> None:
        super().__init__(geometry, device)
        self.ledger = ledger or HostCapacityLedger(host_capacity_bytes())
        self._ranges = geometry.num_layers * geometry.num_kv_buffers
        size = geometry.range_bytes * self._ranges
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        try:
            self.mm = mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise BackendError(f"cannot reserve {size} bytes of address space: {exc}") from None
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self._populate = self._probe_populate()

    def _probe_populate(self) -> bool:
        try:
            _madvise(self._base, mmap.PAGESIZE, MADV_POPULATE_WRITE)
            _madvise(self._base, mmap.PAGESIZE, mmap.MADV_DONTNEED)
            return True
        except OSError:
            return False

    def _offsets(self, page: int):
        g = self.geometry
        for r in range(self._ranges):
            yield r * g.range_bytes + page * g.page_size

    def _claim(self, count: int) -> int:
        """Claim capacity for up to ``count`` pages: all at once, else one at a time until refused."""
        bundle = self.geometry.bundle_bytes
        if count > 1 and self.ledger.claim(bundle * count):
            return count
        claimed = 0
        while claimed < count and self.ledger.claim(bundle):
            claimed += 1
        return claimed

    def map_pages(self, pages: Sequence[int]) -> list[int]:
        claimed = self._claim(len(pages))
        bundle = self.geometry.bundle_bytes
        size = self.geometry.page_size
        done: list[int] = []
        try:
            for page in pages[:claimed]:
                try:
                    for off in self._offsets(page):
                        if self._populate:
                            _madvise(self._base + off, size, MADV_POPULATE_WRITE)
                        else:
                            ctypes.memset(self._base + off, 0, size)
                except OSError as exc:
                    self._drop(page)
                    if exc.errno == errno.ENOMEM:  # the machine said no: a miss
                        break
                    raise BackendError(f"madvise(MADV_POPULATE_WRITE) on page {page} failed: {exc}") from None
                done.append(page)
        finally:
            self.ledger.release(bundle * (claimed - len(done)))  # what we claimed but did not map
        return done

    def _drop(self, page: int) -> None:
        for off in self._offsets(page):
            _madvise(self._base + off, self.geometry.page_size, mmap.MADV_DONTNEED)

    def unmap_pages(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._drop(page)
        self.ledger.release(self.geometry.bundle_bytes * len(pages))

    def bind_claims(self, set_claimed, own_segment: tuple[int, int] | None = None) -> None:  # noqa: ANN001
        self.ledger.bind(set_claimed, own_segment)

    def buffer(self, layer: int, kv: int) -> memoryview:
        """A writable view of one layer's one KV buffer (valid where pages are mapped)."""
        g = self.geometry
        start = (layer * g.num_kv_buffers + kv) * g.range_bytes
        return memoryview(self.mm)[start:start + g.range_bytes]

    def capacity_bytes(self) -> int:
        return self.ledger.capacity

    def free_bytes(self) -> int:
        return self.ledger.free_bytes()

    def close(self) -> None:
        if not self.mm.closed:
            # Return the memory even while views are still exported (e.g. torch tensors): they
            # then read zeros, and the address space itself goes with the process.
            self.mm.madvise(mmap.MADV_DONTNEED, 0, len(self.mm))
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.ledger.release(self.ledger.claimed)
