"""The decoded page map (kvcached_core.pagemap) is what the front ends read; none of them knows the bits."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcached_core as kc
from kvcached_core import KVCacheManager, pagemap
from kvcached_core import layout as L

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = [ROOT / "kvtop"]  # kvtop, kvctl (kvtop/cli) and the exporter
BIT_NAMES = {"PAGE_MAPPED", "PAGE_FIELD_MASK", "PAGE_CACHED_SHIFT", "MAX_BLOCKS_PER_PAGE", "page_entry", "decode_page"}
SMALL = dict(num_blocks=64, block_bytes=16 * 1024, num_layers=1, page_size=64 * 1024)


def bit_layout_uses(path: Path) -> list[str]:
    """Where ``path`` imports or reads the page-map bit layout of kvcached_core.layout."""
    tree = ast.parse(path.read_text(), str(path))
    layout_aliases: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kvcached_core.layout":
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name in BIT_NAMES]
        if isinstance(node, ast.ImportFrom) and node.module == "kvcached_core":
            layout_aliases |= {a.asname or a.name for a in node.names if a.name == "layout"}
        if isinstance(node, ast.Import):
            layout_aliases |= {a.asname or a.name for a in node.names if a.name == "kvcached_core.layout"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in BIT_NAMES:
            base = ast.unparse(node.value)
            if base in layout_aliases or base.endswith("layout"):
                found.append(f"{path.name}:{node.lineno} reads {base}.{node.attr}")
    return found


def test_no_front_end_module_knows_the_page_map_bits() -> None:
    modules = [p for d in FRONT_ENDS for p in sorted(d.rglob("*.py"))]
    assert len(modules) > 10 and any(p.name == "exporter.py" for p in modules)
    assert [use for p in modules for use in bit_layout_uses(p)] == []


def test_the_checker_sees_both_ways_of_reaching_the_bits(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvcached_core import layout as Q\nfrom kvcached_core.layout import decode_page\n"
                   "x = Q.PAGE_MAPPED\n")
    assert len(bit_layout_uses(bad)) == 2


def test_decoded_map_of_a_live_allocator_agrees_with_its_counters(shm_dir: Path) -> None:
    with KVCacheManager("decoded", name="decoded", **SMALL) as m:
        ids = m.alloc(6)
        assert ids is not None
        m.mark_cached(ids[:4])
        snap = kc.snapshot("decoded")
        assert snap.pages is not None
        counts = pagemap.count_pages(snap.pages)
        assert (counts.inuse, counts.reserved) == (snap.pages_inuse, snap.pages_reserved)
        assert (counts.blocks_used, counts.blocks_cached) == (snap.blocks_used, snap.blocks_cached)
        rows = pagemap.decoded(snap.pages)
        assert sum(used for _, used, _ in rows) == 6 and sum(c for _, _, c in rows) == snap.blocks_cached
        assert pagemap.evictable_pages(snap.pages) == sum(1 for mapped, u, c in rows if mapped and u and u == c)


def test_evictable_pages_walks_sparse_and_dense_maps_alike() -> None:
    from array import array
    dense = array("I", [L.page_entry(True, 4, 4), L.page_entry(True, 4, 1), L.page_entry(True, 0, 0)] * 4)
    sparse = array("I", bytes(4 * 400))
    sparse[7], sparse[300] = L.page_entry(True, 2, 2), L.page_entry(True, 3, 0)
    assert pagemap.evictable_pages(dense) == pagemap.evictable_pages(list(dense)) == 4
    assert pagemap.evictable_pages(sparse) == pagemap.evictable_pages(list(sparse)) == 1
    assert pagemap.evictable_pages(None) == 0


def test_a_page_map_changed_behind_the_writer_is_caught_after_a_good_read(shm_dir: Path) -> None:
    """The reader reuses the last page-map sum only for byte-identical maps: a flipped entry is still refused."""
    import os

    import pytest

    from kvcached_core.names import segment_path
    from kvcached_core.reader import SegmentCorrupt, read_segment
    from kvcached_core.segment import Identity, SegmentWriter

    ident = Identity(name="memo", model="memo", engine="test", backend="host", device=0, page_size=1 << 18,
                     block_bytes=1 << 16, num_layers=1, num_kv_buffers=2, blocks_per_page=4, num_blocks=64,
                     pages_total=16)
    writer = SegmentWriter(ident)  # no threads: nothing publishes behind the test's back
    try:
        writer.begin()
        writer.set_page(0, L.page_entry(True, 3, 0))
        fields = dict.fromkeys(L.COUNTER_FIELDS[:-1], 0)
        fields.update(pages_inuse=1, blocks_used=3, updated_ns=1, effective_limit=-1, requested_limit=-1,
                      ranks_active=1)
        writer.publish(tuple(fields.values()))
        path = segment_path("memo")
        good = read_segment(path, with_pages=True)
        assert good.pages is not None and good.blocks_used == 3
        assert read_segment(path, with_pages=True).pages == good.pages  # the same map read twice
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, (good.pages[0] ^ 1).to_bytes(4, "little"), L.PAGE_MAP_OFF)
        finally:
            os.close(fd)
        with pytest.raises(SegmentCorrupt):
            read_segment(path, with_pages=True)
    finally:
        writer.close()
