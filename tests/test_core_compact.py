"""Compaction on real host mmap memory: confirmed moves carry their bytes, emptied pages return their RSS."""

from __future__ import annotations

import os

import pytest
from conftest import configured

from kvcached_core import KVCacheManager
from kvcached_core.allocator.compact import Move, host_copy
from kvcached_core.settings import Settings

MiB = 1024 * 1024
# 2 MiB pages x 8 layers x K/V: one page id costs 32 MiB; 8 blocks a page.
MODEL = dict(num_blocks=16 * 8, block_bytes=256 * 1024, num_layers=8, page_size=2 * MiB)
BUNDLE = 32 * MiB
BPP = 8


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


# No warm pool and no idle return, so every page a test sees is one its blocks hold (children get the same).
ENV = {"KVCACHED_IDLE_RETURN_S": "-1", "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0"}


def cfg() -> Settings:
    return configured(ENV)


def pattern(block: int, layer: int, kv: int) -> bytes:
    return bytes([(block * 7 + layer * 3 + kv + 1) % 251]) * MODEL["block_bytes"]


def write(m: KVCacheManager, block: int, data_of: int) -> None:
    size = m.block_bytes
    for layer in range(m.num_layers):
        for kv in range(m.num_kv_buffers):
            off = (block // BPP) * m.page_size + (block % BPP) * size
            m.buffer(layer, kv)[off:off + size] = pattern(data_of, layer, kv)


def holds(m: KVCacheManager, block: int, data_of: int) -> bool:
    size = m.block_bytes
    off = (block // BPP) * m.page_size + (block % BPP) * size
    return all(bytes(m.buffer(layer, kv)[off:off + size]) == pattern(data_of, layer, kv)
               for layer in range(m.num_layers) for kv in range(m.num_kv_buffers))


def scattered(m: KVCacheManager) -> list[int]:
    """Pages 0-3 keep 6 of 8 blocks, pages 4-7 keep 2; every kept block cached and holding its pattern."""
    ids = [m.alloc(1)[0] for _ in range(8 * BPP)]  # type: ignore[index]
    assert sorted(b // BPP for b in ids) == sorted(list(range(8)) * BPP)
    for block in ids:
        write(m, block, block)
    drop = [b for b in ids if (b // BPP < 4 and b % BPP < 2) or (b // BPP >= 4 and b % BPP >= 2)]
    m.free(drop)
    kept = [b for b in ids if b not in drop]
    assert m.mark_cached(kept) == []
    return kept


def test_compaction_moves_the_bytes_and_returns_the_emptied_pages_rss() -> None:
    with KVCacheManager("compact", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        kept = scattered(m)
        assert m.pages.pages_inuse == 8
        m.set_compact_handler(lambda moves: host_copy(m.backend, m.block_bytes, moves))
        before = rss()
        result = m.compact()
        after = rss()
        assert len(result.moves) == result.planned == 8
        assert result.bytes_returned == 4 * BUNDLE
        assert result.bytes_copied == 8 * m.block_bytes * m.num_layers * m.num_kv_buffers
        assert m.pages.pages_inuse == 4 and m.pages.mapped_pages == 4
        assert before - after >= 0.95 * 4 * BUNDLE, f"RSS fell by {(before - after) / MiB:.0f} MiB only"
        remap = dict(result.moves)
        assert all(src // BPP >= 4 and dst // BPP < 4 for src, dst in remap.items())
        for block in kept:
            where = remap.get(block, block)
            assert where in m.cache.blocks and m.pages.is_used(where)
            assert holds(m, where, block), f"block {block} moved to {where} lost its bytes"
        assert m.compact().moves == ()  # dense now: nothing more to move


def test_only_confirmed_moves_happen() -> None:
    with KVCacheManager("compact-part", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        kept = scattered(m)

        def half(moves: list[Move]) -> list[Move]:
            done = host_copy(m.backend, m.block_bytes, moves[:4])
            return done + [(moves[5][0], moves[4][1])]  # a move never planned is not taken as confirmed

        m.set_compact_handler(half)
        result = m.compact()
        assert result.planned == 8 and len(result.moves) == 4
        assert m.pages.blocks_used == len(kept) == len(m.cache)
        remap = dict(result.moves)
        for block in kept:
            where = remap.get(block, block)
            assert m.pages.is_used(where) and holds(m, where, block)
        assert m.pages.pages_inuse == 6


def test_a_failing_handler_changes_nothing() -> None:
    with KVCacheManager("compact-fail", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        kept = scattered(m)

        def boom(moves: list[Move]) -> list[Move]:
            raise OSError("copy failed")

        m.set_compact_handler(boom)
        used = list(m.pages.used)
        with pytest.raises(OSError):
            m.compact()
        assert list(m.pages.used) == used and sorted(m.cache.blocks) == sorted(kept)
        assert all(holds(m, b, b) for b in kept)


def test_without_a_handler_compact_refuses() -> None:
    with KVCacheManager("compact-none", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        scattered(m)
        with pytest.raises(RuntimeError, match="set_compact_handler"):
            m.compact()
        assert m.pages.pages_inuse == 8


def test_the_segment_counts_compactions_and_kvctl_frag_shows_them() -> None:
    import json
    import time

    from conftest import kvctl

    from kvcached_core import snapshot

    with KVCacheManager("compact-count", policy="best-fit", settings=cfg(), **MODEL) as m:  # type: ignore[arg-type]
        scattered(m)
        fresh = snapshot("compact-count").compaction
        assert fresh is not None and not fresh.capable and fresh.compactions == 0
        assert "its engine registered no compact handler" in kvctl("frag", "compact-count").stdout

        def slow_copy(moves: list[Move]) -> list[Move]:
            time.sleep(0.02)  # so the duration is measurably the handler's too
            return host_copy(m.backend, m.block_bytes, moves)

        m.set_compact_handler(slow_copy)
        assert snapshot("compact-count").compaction.capable  # type: ignore[union-attr]
        result = m.compact()
        assert m.compact().moves == ()  # nothing to move: not counted
        info = snapshot("compact-count").compaction
        assert info is not None and info.capable
        assert (info.compactions, info.blocks_moved) == (1, 8)
        assert (info.bytes_copied, info.bytes_returned) == (result.bytes_copied, result.bytes_returned) \
            == (8 * m.block_bytes * 16, 4 * BUNDLE)
        assert 0.02 <= info.took_s < 5
        out = json.loads(kvctl("frag", "compact-count", "--json").stdout)["compaction"]
        assert out == {"capable": True, "compactions": 1, "blocks_moved": 8, "bytes_copied": 8 * m.block_bytes * 16,
                       "bytes_returned": 4 * BUNDLE, "last_took_s": round(info.took_s, 6)}
        text = kvctl("frag", "compact-count").stdout
        assert "1 done, 8 blocks moved: 128.0 MiB returned, 32.0 MiB copied" in text, text
        assert "kvctl compact compact-count" in text


SCATTER = f"""
from kvcached_core.allocator.compact import host_copy
BPP = {BPP}
ids = [m.alloc(1)[0] for _ in range(8 * BPP)]
drop = [b for b in ids if (b // BPP < 4 and b % BPP < 2) or (b // BPP >= 4 and b % BPP >= 2)]
m.free(drop)
m.mark_cached([b for b in ids if b not in drop])
"""


def test_kvctl_compact_returns_pages_and_refuses_a_failing_engine(spawn_allocator) -> None:
    import json

    from conftest import kvctl, send
    from test_docs_reference import assert_documented, key_table

    from kvcached_core import snapshot

    proc = spawn_allocator("cc", env=ENV, policy="best-fit", script=SCATTER + """
def boom(moves):
    raise OSError("copy failed")
m.set_compact_handler(boom)
""", **MODEL)
    before = snapshot("cc")
    assert before.pages_inuse == 8 and before.compaction is not None and before.compaction.capable
    failed = kvctl("compact", "cc")
    assert failed.exit_code == 1 and "compaction failed" in failed.stderr and failed.stderr.count("\n") == 1
    after = snapshot("cc")
    assert (after.pages_inuse, after.blocks_used, after.blocks_cached) == (8, 32, 32)
    assert after.compaction is not None and after.compaction.compactions == 0

    send(proc, "m.set_compact_handler(lambda moves: host_copy(m.backend, m.block_bytes, moves))")
    done = kvctl("compact", "cc", "--json")
    assert done.exit_code == 0, done.stderr
    answer = json.loads(done.stdout)
    assert_documented(answer, key_table("Compaction"), "kvctl compact --json")
    assert answer["status"] == "compacted"
    assert answer["bytes_returned"] == 4 * BUNDLE and answer["bytes_copied"] == 8 * MODEL["block_bytes"] * 16
    now = snapshot("cc")
    assert (now.pages_inuse, now.blocks_cached, now.mapped_bytes) == (4, 32, 4 * BUNDLE)
    again = kvctl("compact", "cc")  # dense now: nothing moves, 0 bytes, exit 0
    assert again.exit_code == 0 and "returned 0 B (0 bytes), copied 0 B (0 bytes)" in again.stdout, again.stdout
    asked = kvctl("compact", "cc", "--wait", "0", "--json")  # as limit and trim's --wait: 0 asks, does not wait
    assert asked.exit_code == 0 and json.loads(asked.stdout)["status"] == "pending", asked.stdout
