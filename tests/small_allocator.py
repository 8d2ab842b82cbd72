"""A small host allocator for the limit tests, and stamps that show a block kept its contents.

64 blocks of 16 KiB, four to a 64 KiB page, one layer (K and V), 2-4 reserved pages, never returned idle.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

import kvcached_core as kc

KiB = 1024
PAGE = 64 * KiB
BLOCK = 16 * KiB
BPP = PAGE // BLOCK
BUNDLE = PAGE * 2  # one layer, K and V


@contextmanager
def small_manager(monkeypatch: pytest.MonkeyPatch, name: str, **env: str) -> Iterator[kc.KVCacheManager]:
    """The allocator, named ``name``; ``env``: more KVCACHED_* settings for it."""
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "2")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "4")
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with kc.KVCacheManager(name, name=name, num_blocks=64, block_bytes=BLOCK, num_layers=1, page_size=PAGE) as m:
        yield m


def _offset(block: int) -> int:
    return (block // BPP) * PAGE + (block % BPP) * BLOCK


def stamp(m: kc.KVCacheManager, blocks: Sequence[int], kvs: Sequence[int] = (0, 1)) -> None:
    """Write each block's id + 1 into its first bytes, in the buffers ``kvs`` (0: K, 1: V)."""
    for kv in kvs:
        with m.buffer(0, kv) as view:
            for b in blocks:
                view[_offset(b):_offset(b) + 4] = (b + 1).to_bytes(4, "little")  # never zero: unmapped reads as 0


def assert_stamped(m: kc.KVCacheManager, blocks: Sequence[int], kvs: Sequence[int] = (0, 1)) -> None:
    for kv in kvs:
        with m.buffer(0, kv) as view:
            for b in blocks:
                got = bytes(view[_offset(b):_offset(b) + 4])
                assert got == (b + 1).to_bytes(4, "little"), f"block {b} lost its contents"
