"""The prefix-cache ledger: which used blocks are cached (evictable), and since when.

A block's age is the moment it was last cached (``mark_cached``; a ``reuse`` takes it out and
the next ``mark_cached`` makes it young again), so age order is least-recently-used order.
Both dicts keep insertion order, which *is* age order: the oldest cached block is the first
key of ``blocks`` and a page's oldest and newest cached blocks are the first and last keys of
its ``by_page`` entry, without a search. The ledger only records; the placement policy
(:mod:`kvcached_core.allocator.placement`) chooses victims and the allocator frees them.
"""

from __future__ import annotations

from itertools import count, islice


class PrefixCache:
    def __init__(self, blocks_per_page: int, budget: int | None) -> None:
        self.bpp = blocks_per_page
        self.budget = budget  # None: unlimited; 0: off
        self._age = count()
        self.blocks: dict[int, int] = {}  # block -> age, oldest first
        self.by_page: dict[int, dict[int, int]] = {}  # page -> {block: age}, oldest first

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def add(self, block: int) -> None:
        age = next(self._age)
        self.blocks[block] = age
        on_page = self.by_page.get(block // self.bpp)
        if on_page is None:
            self.by_page[block // self.bpp] = {block: age}
        else:
            on_page[block] = age

    def remove(self, block: int) -> None:
        del self.blocks[block]
        page = block // self.bpp
        on_page = self.by_page[page]
        del on_page[block]
        if not on_page:
            del self.by_page[page]

    def over_budget(self) -> int:
        if self.budget is None:
            return 0
        return max(0, len(self.blocks) - self.budget)

    def oldest(self, n: int) -> list[int]:
        """Up to ``n`` cached blocks, least recently cached first (plain LRU)."""
        out: list[int] = []
        for block in self.blocks:
            if len(out) == n:
                break
            out.append(block)
        return out

    def age_of_oldest(self, k: int) -> int:
        """The age of the ``k``-th oldest cached block (of the newest, when fewer are cached)."""
        age = -1
        for age in islice(self.blocks.values(), k):  # noqa: B007 - the last one is the answer
            pass
        return age
