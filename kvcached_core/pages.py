"""Page and block bookkeeping for one model: which pages are mapped, which slots are used.

Placement keeps a request's blocks together: whole pages for whole-page runs, the best-fitting
in-use page for the rest, else an empty page, and only as a last resort the emptiest in-use
pages. Best fit finds the in-use page with the fewest free slots that still takes the run, so
partly used pages fill up and empty pages stay empty (and can be returned).
"""

from __future__ import annotations

import heapq


class PageTable:
    """Pure bookkeeping, no I/O; the allocator holds its lock around every call."""

    def __init__(self, pages_total: int, blocks_per_page: int, num_blocks: int) -> None:
        self.pages_total = pages_total
        self.bpp = blocks_per_page
        self.cap = [blocks_per_page] * pages_total
        if pages_total:
            self.cap[-1] = num_blocks - (pages_total - 1) * blocks_per_page
        self.used = [0] * pages_total
        self.cached = [0] * pages_total
        self.mapped = bytearray(pages_total)
        self.slots: list[list[int] | None] = [None] * pages_total
        self.unmapped = list(range(pages_total))  # a heap: low page ids first keeps the map compact
        self.reserved: list[int] = []  # mapped, no block used (the warm pool), LIFO
        self.inflight = 0  # taken from ``unmapped`` and being mapped right now
        self.partial: list[set[int]] = [set() for _ in range(blocks_per_page + 1)]  # by free slots
        self.pages_inuse = 0
        self.blocks_used = 0
        self.block_used = bytearray(pages_total * blocks_per_page)  # 1 while handed out

    # -- page states -------------------------------------------------------------------------
    @property
    def mapped_pages(self) -> int:
        return self.pages_inuse + len(self.reserved)

    def take_unmapped(self, count: int) -> list[int]:
        pages = [heapq.heappop(self.unmapped) for _ in range(min(count, len(self.unmapped)))]
        self.inflight += len(pages)
        return pages

    def finish_mapping(self, asked: list[int], mapped: list[int]) -> None:
        """Mapped pages join the pool; those the backend refused go back to ``unmapped``."""
        self.inflight -= len(asked)
        done = set(mapped)
        for page in asked:
            if page in done:
                self.mapped[page] = 1
                self.slots[page] = list(range(self.cap[page] - 1, -1, -1))
                self.reserved.append(page)
            else:
                heapq.heappush(self.unmapped, page)

    def take_reserved(self) -> int | None:
        return self.reserved.pop() if self.reserved else None

    def release_reserved(self, count: int) -> list[int]:
        """Remove up to ``count`` pool pages (coldest first) for unmapping."""
        count = min(count, len(self.reserved))
        pages, self.reserved = self.reserved[:count], self.reserved[count:]
        return pages

    def mark_unmapped(self, pages: list[int]) -> None:
        for page in pages:
            self.mapped[page] = 0
            self.slots[page] = None
            heapq.heappush(self.unmapped, page)

    # -- blocks ------------------------------------------------------------------------------
    def free_slots(self, page: int) -> int:
        return self.cap[page] - self.used[page]

    def take_blocks(self, page: int, count: int) -> list[int]:
        """Use ``count`` free slots of a mapped page; returns block ids."""
        before = self.used[page]
        if before == 0:
            self.pages_inuse += 1
        else:
            self.partial[self.cap[page] - before].discard(page)
        slots = self.slots[page]
        assert slots is not None and len(slots) >= count
        base = page * self.bpp
        ids = [base + slots.pop() for _ in range(count)]
        flags = self.block_used
        for block in ids:
            flags[block] = 1
        self.used[page] = before + count
        self.blocks_used += count
        left = self.cap[page] - self.used[page]
        if left:
            self.partial[left].add(page)
        return ids

    def free_block(self, block: int) -> int:
        """Return one block's slot; returns its page (now empty when ``used[page] == 0``)."""
        page, slot = divmod(block, self.bpp)
        self.block_used[block] = 0
        before = self.used[page]
        if before != self.cap[page]:
            self.partial[self.cap[page] - before].discard(page)
        self.slots[page].append(slot)  # type: ignore[union-attr]
        self.used[page] = before - 1
        self.blocks_used -= 1
        if before == 1:
            self.pages_inuse -= 1
        else:
            self.partial[self.cap[page] - before + 1].add(page)
        return page

    def is_used(self, block: int) -> bool:
        """True when ``block`` is currently handed out."""
        return 0 <= block < len(self.block_used) and self.block_used[block] == 1

    def best_fit(self, count: int) -> int | None:
        """The in-use page with the fewest free slots that still holds ``count`` blocks."""
        for free in range(count, self.bpp + 1):
            bucket = self.partial[free]
            if bucket:
                return min(bucket)
        return None

    def emptiest(self) -> int | None:
        for free in range(self.bpp, 0, -1):
            bucket = self.partial[free]
            if bucket:
                return min(bucket)
        return None

    def free_in_mapped(self) -> int:
        """Blocks that can be handed out without mapping anything."""
        partial = sum(free * len(b) for free, b in enumerate(self.partial))
        return partial + sum(self.cap[p] for p in self.reserved)
