"""The prefix cache's index: full blocks of finished sequences, found again by the tokens they hold.

A block is keyed by a SHA-256 digest of every token up to its end (a chain: block ``i``'s key hashes
block ``i-1``'s key with its own tokens; 128 bits of it, so two prefixes never share a key in
practice, where Python's 64-bit ``hash()`` could serve one prefix another's K/V), so a later prompt that begins with the same tokens finds the
same blocks. The blocks themselves are the allocator's *cached* blocks (``mark_cached``): it may
evict them (the ids it returns are dropped here) or, through compaction, move them (the remap list
is applied here by :meth:`PrefixIndex.remap`, after the cache copied their K/V).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """hash of a token prefix -> the cached block holding its last ``block_tokens`` tokens, and back."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.hash_of)

    def keys(self, tokens: Sequence[int], blocks: int) -> list[int]:
        """The chain keys of the first ``blocks`` full blocks of ``tokens``."""
        bt, digest, out = self.block_tokens, b"", []
        for i in range(blocks):
            digest = hashlib.sha256(digest + array("q", tokens[i * bt:(i + 1) * bt]).tobytes()).digest()[:16]
            out.append(int.from_bytes(digest, "little"))
        return out

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest run of ``tokens``'s full blocks, leaving at least one token to feed
        (the model needs one to produce the next token's logits)."""
        found: list[int] = []
        for key in self.keys(tokens, (len(tokens) - 1) // self.block_tokens):
            block = self.by_hash.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def add(self, key: int, block: int) -> bool:
        """Index ``block`` under ``key``; False when another block already holds that prefix (free this one)."""
        if key in self.by_hash:
            return False
        self.by_hash[key] = block
        self.hash_of[block] = key
        return True

    def forget(self, blocks: Iterable[int]) -> None:
        """The blocks left the cache (reused by a request, evicted, dropped)."""
        for block in blocks:
            key = self.hash_of.pop(block, None)
            if key is not None:
                del self.by_hash[key]

    def remap(self, moves: Iterable[tuple[int, int]]) -> None:
        """Compaction moved these blocks (source, destination): their keys follow them. A destination was a free
        slot: whatever is still indexed under its id (a block the same call evicted) goes first."""
        for src, dst in moves:
            self.forget((dst,))
            key = self.hash_of.pop(src)
            self.by_hash[key] = dst
            self.hash_of[dst] = key

    def clear(self) -> list[int]:
        blocks = list(self.hash_of)
        self.by_hash.clear()
        self.hash_of.clear()
        return blocks
