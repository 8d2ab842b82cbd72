"""Compaction: move relocatable blocks out of sparse pages into holes of dense ones.

A block is relocatable when it is cached and no running request holds it. ``plan`` picks moves
(source block -> free destination slot) that empty whole pages, sparsest first; the engine copies
the KV data for the moves it accepts and confirms them; only confirmed sources are freed, so a
block the engine did not confirm never moves. This module plans and copies; the allocator
(:meth:`kvcached_core.allocator.manager.KVCacheManager.compact`) holds its lock and does the bookkeeping.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..segment import layout as L
from .pages import PageTable
from .prefix_cache import PrefixCache

Move = tuple[int, int]  # (source block, destination block)
# The engine's copy: given the remap list, copy each source block's KV data to its destination
# (every layer, every KV buffer) and return the moves it completed; the rest stay where they are.
# A destination is a free slot; during idle packing it may be a block the same ``mark_cached`` call
# evicted (that id is then not in the call's evicted list): the engine drops what it still records
# for a destination before recording the move there.
CompactHandler = Callable[[list[Move]], Sequence[Move]]


@dataclass(frozen=True)
class CompactResult:
    """What one compaction did: the confirmed remap list and the bytes copied and returned."""

    moves: tuple[Move, ...]
    planned: int
    bytes_copied: int
    bytes_returned: int


class CompactStats:
    """The allocator's compaction figures, as the segment's COMPACT words carry them (``layout.COMPACT_FIELDS``,
    then the last ``layout.COMPACT_ANSWERS`` answers to controllers)."""

    __slots__ = (*L.COMPACT_FIELDS, "answers")  # values() follows this order; a field __init__ does not set fails

    def __init__(self) -> None:
        self.capable = False
        self.status = L.COMPACT_DONE
        self.acked_seq = self.compactions = self.blocks_moved = self.bytes_copied = self.bytes_returned = 0
        self.took_ns = 0
        self.answers: deque[tuple[int, int, int, int, int]] = deque(maxlen=L.COMPACT_ANSWERS)  # newest first

    def count(self, result: CompactResult, took_ns: int) -> None:
        """Add one compaction that moved blocks."""
        self.compactions += 1
        self.blocks_moved += len(result.moves)
        self.bytes_copied += result.bytes_copied
        self.bytes_returned += result.bytes_returned
        self.took_ns = took_ns

    def answer(self, seq: int, status: int, copied: int = 0, returned: int = 0) -> None:
        """Answer every controller request up to ``seq`` not answered yet with one compaction's outcome: the
        requests that arrived together are folded into it, and each controller finds its own in ``answers``."""
        self.answers.appendleft((self.acked_seq + 1, seq, status, copied, returned))
        self.status, self.acked_seq = status, seq

    def values(self) -> tuple[int, ...]:
        head = tuple(int(getattr(self, name)) for name in L.COMPACT_FIELDS)
        answers = [*self.answers, *[(0, 0, 0, 0, 0)] * (L.COMPACT_ANSWERS - len(self.answers))]
        return head + tuple(word for answer in answers for word in answer)


def plan(pages: PageTable, cache: PrefixCache) -> list[Move]:
    """Moves that empty in-use pages holding only cached blocks, sparsest first, into the densest holes.

    A page is emptied only when all its blocks fit holes on pages that stay; no move is planned
    that leaves its source page in use.
    """
    used, cap, bpp = pages.used, pages.cap, pages.bpp
    movable = [p for p, on_page in cache.by_page.items() if len(on_page) == used[p] and used[p] > 0]
    movable.sort(key=lambda p: (used[p], p))
    sources: set[int] = set()
    holes = sum(cap[p] - used[p] for p in range(len(used)) if used[p] > 0)
    for page in movable:  # sparsest first; a source's own holes are no destination
        need = used[page]
        if holes - (cap[page] - used[page]) - need < 0:
            break
        holes -= (cap[page] - used[page]) + need
        sources.add(page)
    if not sources:
        return []
    targets = [p for p in range(len(used)) if used[p] > 0 and p not in sources and used[p] < cap[p]]
    targets.sort(key=lambda p: (-used[p], p))  # densest first: the page that fills up stays
    free_slots: list[int] = []
    flags = pages.block_used
    for page in targets:
        base = page * bpp
        free_slots.extend(base + s for s in range(cap[page]) if not flags[base + s])
    moves: list[Move] = []
    slot = iter(free_slots)
    for page in sorted(sources, key=lambda p: (used[p], p)):
        for block in cache.by_page[page]:
            moves.append((block, next(slot)))
    return moves


def host_copy(backend: object, block_bytes: int, moves: Sequence[Move]) -> list[Move]:
    """Copy each move's KV data between the host backend's mapped regions (memmove in every range)."""
    geometry = backend.geometry  # type: ignore[attr-defined]
    base: int = backend._base  # type: ignore[attr-defined]  # the host backend's mapping
    bpp = geometry.page_size // block_bytes
    ranges = geometry.num_layers * geometry.num_kv_buffers
    for src, dst in moves:
        s_off = (src // bpp) * geometry.page_size + (src % bpp) * block_bytes
        d_off = (dst // bpp) * geometry.page_size + (dst % bpp) * block_bytes
        for r in range(ranges):
            start = base + r * geometry.range_bytes
            ctypes.memmove(start + d_off, start + s_off, block_bytes)
    return list(moves)


def device_copy(backend: object, block_bytes: int, moves: Sequence[Move]) -> list[Move]:
    """Copy each move's KV data on the CUDA backend's device, in every layer's every KV buffer at once
    (``CudaBackend.all_blocks``): one kernel that reads each block once and writes it once
    (:mod:`kvcached_core.backends.cuda_copy`), or, where it cannot be had (or is still being built: the first
    compaction of a process starts that in the background), one gather and one scatter. Then
    wait for the copy, since the sources are freed (and may be unmapped) as soon as the handler returns."""
    if not moves:
        return []
    import torch  # the CUDA path only; torch is optional

    from ..backends.cuda_copy import move_if_able

    rows = backend.all_blocks(block_bytes)  # type: ignore[attr-defined]
    if not move_if_able(rows, moves):
        gather_scatter(rows, moves)
    torch.cuda.synchronize(rows.device)
    return list(moves)


def gather_scatter(rows: object, moves: Sequence[Move]) -> None:
    """torch's indexed copy of the moves over ``rows`` (``[ranges, pages, blocks_per_page, block_bytes]``
    bytes): a gather into a temporary, then a scatter out of it (on the current stream, not waited for)."""
    import torch

    view: Any = rows
    if view.shape[3] % 8 == 0:
        view = view.view(torch.int64)  # 8-byte words: the same bytes, fewer and wider loads and stores
    bpp = view.shape[2]
    index = torch.tensor(moves, dtype=torch.long).to(view.device, non_blocking=True)
    src, dst = index[:, 0], index[:, 1]
    view[:, dst // bpp, dst % bpp] = view[:, src // bpp, src % bpp]


def copy_blocks(backend: object, block_bytes: int, moves: Sequence[Move]) -> list[Move]:
    """The copy for the allocator's own backend: memmove on the host backend, one batched copy on a CUDA device.
    An engine whose KV tensors are the allocator's memory can hand this to ``set_compact_handler`` (after
    rewriting its own block ids for the moves it returns)."""
    name = getattr(backend, "name", "")
    if name == "host":
        return host_copy(backend, block_bytes, moves)
    if name == "cuda":
        return device_copy(backend, block_bytes, moves)
    raise ValueError(f"no block copy for the {name!r} backend (tensor parallelism: each rank copies its own shard)")
