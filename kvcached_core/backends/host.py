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
import fcntl
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from .. import layout as L
from ..config import available_ram_bytes, host_capacity_bytes, shm_dir
from ..names import SEGMENT_PREFIX
from ..procinfo import is_alive
from .base import Backend, BackendError, Geometry

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap lacks the name but passes the number
RAM_MARGIN = 256 * 1024 * 1024
LOCK_NAME = ".kvc-host-capacity.lock"


class HostCapacityLedger:
    """Shares ``KVCACHED_HOST_CAPACITY`` between processes.

    Each allocator records the bytes it holds in its own segment (CLAIMED); a process that wants
    more takes a flock on one lock file, sums the claims of live segments and claims its share
    before committing memory. Only growth takes the lock, and only in the background thread or
    on a pool miss, never on the alloc hot path.
    """

    def __init__(self, capacity: int, directory: Path | None = None) -> None:
        self.capacity = capacity
        self.directory = directory or shm_dir()
        self.claimed = 0
        self._set_claimed = None  # callback into our segment

    def bind(self, set_claimed) -> None:  # noqa: ANN001
        self._set_claimed = set_claimed

    def _others(self) -> int:
        total = 0
        me = os.getpid()
        try:
            names = os.listdir(self.directory)
        except OSError:
            return 0
        for name in names:
            if not name.startswith(SEGMENT_PREFIX):
                continue
            try:
                fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                raw = os.pread(fd, L.PAGE_MAP_OFF, 0)
            except OSError:
                continue
            finally:
                os.close(fd)
            if len(raw) < L.PAGE_MAP_OFF or raw[:8] != L.MAGIC:
                continue
            head = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0), strict=False))
            if L.decode_text(head["backend"]) != "host" or head["pid"] == me:
                continue
            if is_alive(head["pid"], head["start_time"]):
                total += L.U64.unpack_from(raw, L.CLAIMED_OFF)[0]
        return total

    def claim(self, nbytes: int) -> bool:
        """Claim ``nbytes`` more; False when the shared capacity or the machine's RAM says no."""
        if available_ram_bytes() and available_ram_bytes() < nbytes + RAM_MARGIN:
            return False
        lock_path = self.directory / LOCK_NAME
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            fd = -1  # a lock owned by someone else: fall back to an unlocked estimate
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_EX)
            if self._others() + self.claimed + nbytes > self.capacity:
                return False
            self.claimed += nbytes
            if self._set_claimed:
                self._set_claimed(self.claimed)
            return True
        finally:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def release(self, nbytes: int) -> None:
        self.claimed = max(0, self.claimed - nbytes)
        if self._set_claimed:
            self._set_claimed(self.claimed)

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
        self._populate = self._probe_populate()
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def _probe_populate(self) -> bool:
        try:
            self.mm.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
            self.mm.madvise(mmap.MADV_DONTNEED, 0, mmap.PAGESIZE)
            return True
        except OSError:
            return False

    def _offsets(self, page: int):
        g = self.geometry
        for r in range(self._ranges):
            yield r * g.range_bytes + page * g.page_size

    def map_pages(self, pages: Sequence[int]) -> list[int]:
        done: list[int] = []
        bundle = self.geometry.bundle_bytes
        size = self.geometry.page_size
        for page in pages:
            if not self.ledger.claim(bundle):
                break
            try:
                for off in self._offsets(page):
                    if self._populate:
                        self.mm.madvise(MADV_POPULATE_WRITE, off, size)
                    else:
                        ctypes.memset(self._base + off, 0, size)
            except OSError as exc:
                self._drop(page)
                self.ledger.release(bundle)
                if exc.errno in (12,):  # ENOMEM: the machine said no, a miss
                    break
                raise BackendError(f"madvise(MADV_POPULATE_WRITE) on page {page} failed: {exc}") from None
            done.append(page)
        return done

    def _drop(self, page: int) -> None:
        for off in self._offsets(page):
            self.mm.madvise(mmap.MADV_DONTNEED, off, self.geometry.page_size)

    def unmap_pages(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._drop(page)
            self.ledger.release(self.geometry.bundle_bytes)

    def bind_claims(self, set_claimed) -> None:  # noqa: ANN001
        self.ledger.bind(set_claimed)

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
