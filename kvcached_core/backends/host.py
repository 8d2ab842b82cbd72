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
import mmap
import os
from collections.abc import Sequence

from ..settings import Settings
from ..settings import settings as process_settings
from .base import Backend, BackendError, Geometry
from .ledger import BUDGET_MAX_AGE_S, CapacityLedger

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap lacks the name but passes the number

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _madvise(address: int, length: int, advice: int) -> None:
    """madvise(2) through ctypes, which releases the GIL: committing a page costs about as much as
    writing it, and mmap.madvise would hold every other thread (the engine's alloc) for that long."""
    if _libc.madvise(address, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class HostBackend(Backend):
    name = "host"

    def __init__(self, geometry: Geometry, device: int = 0, ledger: CapacityLedger | None = None, *,
                 settings: Settings | None = None) -> None:
        super().__init__(geometry, device)
        cfg = settings or process_settings()
        self.ledger = ledger or CapacityLedger(cfg.host_capacity_bytes, cfg.shm_dir)
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

    def bind_claims(self, set_claimed, own_segment: tuple[int, int] | None = None) -> None:
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

    def budget_free_bytes(self) -> int | None:
        return self.ledger.free_bytes(BUDGET_MAX_AGE_S)

    def close(self) -> None:
        if not self.mm.closed:
            # Return the memory even while views are still exported (e.g. torch tensors): they
            # then read zeros, and the address space itself goes with the process.
            self.mm.madvise(mmap.MADV_DONTNEED, 0, len(self.mm))
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.ledger.release(self.ledger.claimed)
