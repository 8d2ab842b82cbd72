"""The prefix-cache ledger: which used blocks are cached (evictable) and in what order.

Eviction is page-aware: it frees the cached blocks of pages that hold nothing else first
(those pages empty and return), then pages with the fewest active blocks; oldest first among
equals. The ledger only chooses; the allocator frees.
"""

from __future__ import annotations

from itertools import count


class PrefixCache:
    def __init__(self, blocks_per_page: int, budget: int | None) -> None:
        self.bpp = blocks_per_page
        self.budget = budget  # None: unlimited; 0: off
        self._age = count()
        self.blocks: dict[int, int] = {}  # block -> age (insertion order = age order)
        self.by_page: dict[int, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def add(self, block: int) -> None:
        age = next(self._age)
        self.blocks[block] = age
        self.by_page.setdefault(block // self.bpp, {})[block] = age

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

    def choose(self, n: int, used_per_page: list[int]) -> list[int]:
        """Pick up to ``n`` cached blocks to evict, whole pages first, oldest first among equals."""
        if n <= 0 or not self.blocks:
            return []
        ranked = sorted(
            self.by_page.items(),
            key=lambda item: (used_per_page[item[0]] - len(item[1]), min(item[1].values())),
        )
        victims: list[int] = []
        for _page, on_page in ranked:
            for block, _age in sorted(on_page.items(), key=lambda kv: kv[1]):
                victims.append(block)
                if len(victims) == n:
                    return victims
        return victims
