"""The decoded page map (kvcached_core.segment.pagemap) is what the front ends read; none of them knows the bits."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcached_core as kc
from kvcached_core import KVCacheManager
from kvcached_core.segment import layout as L
from kvcached_core.segment import pagemap

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = [ROOT / "kvtop"]  # kvtop, kvctl (kvtop/cli) and the exporter
BIT_NAMES = {"PAGE_MAPPED", "PAGE_FIELD_MASK", "PAGE_CACHED_SHIFT", "MAX_BLOCKS_PER_PAGE", "page_entry", "decode_page"}
SMALL = dict(num_blocks=64, block_bytes=16 * 1024, num_layers=1, page_size=64 * 1024)


def bit_layout_uses(path: Path) -> list[str]:
    """Where ``path`` imports or reads the page-map bit layout of kvcached_core.segment.layout."""
    tree = ast.parse(path.read_text(), str(path))
    layout_aliases: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kvcached_core.segment.layout":
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name in BIT_NAMES]
        if isinstance(node, ast.ImportFrom) and node.module == "kvcached_core":
            layout_aliases |= {a.asname or a.name for a in node.names if a.name == "layout"}
        if isinstance(node, ast.Import):
            layout_aliases |= {a.asname or a.name for a in node.names if a.name == "kvcached_core.segment.layout"}
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
    bad.write_text("from kvcached_core import layout as Q\nfrom kvcached_core.segment.layout import decode_page\n"
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

    from kvcached_core.segment.names import segment_path
    from kvcached_core.segment.reader import SegmentCorrupt, read_segment
    from kvcached_core.segment.writer import Identity, SegmentWriter

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


# -- one base for every percent: the core counts and divides, front ends only print ------------------

PERCENT_BASES = {"pages_total", "device_capacity", "limit_bytes", "total", "total_bytes", "capacity",
                 "host_capacity"}


def _has_division(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv)) for n in ast.walk(node))


def own_percentages(path: Path) -> list[str]:
    """Where ``path`` works out a share or the free-page count from raw figures instead of asking the core
    (``kvcached_core.sizes.percent``, ``ModelSnapshot.pages_free``, ``control.limit_percent_base``)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for const, other in ((node.left, node.right), (node.right, node.left)):
                if isinstance(const, ast.Constant) and const.value in (100, 100.0) and _has_division(other):
                    found.append(f"{where} a ratio times 100")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Attribute) \
                and node.right.attr in PERCENT_BASES:
            found.append(f"{where} divides by .{node.right.attr}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            leftmost = node.left
            while isinstance(leftmost, ast.BinOp):
                leftmost = leftmost.left
            if isinstance(leftmost, ast.Attribute) and leftmost.attr == "pages_total":
                found.append(f"{where} counts free pages from pages_total")
        if isinstance(node, ast.FormattedValue) and isinstance(node.format_spec, ast.JoinedStr):
            spec = "".join(str(v.value) for v in node.format_spec.values if isinstance(v, ast.Constant))
            if spec.endswith("%"):
                found.append(f"{where} formats a ratio as a percentage ({spec})")
    return list(dict.fromkeys(found))


def test_no_front_end_module_works_out_a_percentage_or_the_free_pages_itself() -> None:
    modules = [p for d in FRONT_ENDS for p in sorted(d.rglob("*.py"))]
    assert [use for p in modules for use in own_percentages(p)] == []


def test_the_percentage_checker_sees_each_way(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("a = bar.taken / bar.total * 100\n"  # the device bar as view.py worked it out
                   "b = 100 * (m.held // m.mapped)\n"
                   "c = m.mapped_bytes / m.limit_bytes\n"  # the mapped cell's share of the limit
                   "d = max(0, m.pages_total - m.pages_inuse - m.pages_reserved)\n"  # textfmt and the exporter
                   "e = f'{x:.0%}'\n"
                   "ok = 100 * bundle + n // 100\n")
    assert {use.split()[0] for use in own_percentages(bad)} == {f"bad.py:{n}" for n in range(1, 6)}


def test_percent_and_free_pages_come_from_the_core() -> None:
    from fakes import fake_model, fake_pages

    from kvcached_core.sizes import percent

    assert percent(1, 4) == 25.0 and percent(3, 0) is None and percent(3, None) is None
    m = fake_model("m", pages=fake_pages(64, inuse=10, reserved=6, bpp=4), page_size=1 << 20, block_bytes=256 << 10)
    assert (m.pages_inuse, m.pages_reserved, m.pages_free) == (10, 6, 48)
    assert m.to_dict()["pages_free"] == 48


def test_kvctl_kvtop_and_the_exporter_agree_on_one_live_allocator(spawn_allocator) -> None:
    """The free pages in kvctl list --json, kvctl show, kvtop --once and a scrape; the device bar's percent."""
    import json
    import re
    import subprocess
    import sys
    import urllib.request

    from conftest import child_env, kvctl, send
    from prometheus_client.parser import text_string_to_metric_families

    from kvcached_core.backends import nvml
    from kvcached_core.sizes import percent
    from kvtop.serve.exporter import Exporter

    # 8 MiB page bundles (2 MiB pages, 2 layers, K and V), 4 blocks per page: 41 blocks, 5 freed, pin 10 pages
    proc = spawn_allocator("agree", num_blocks=256, block_bytes=512 << 10, num_layers=2, page_size=2 << 20,
                           script="ids = m.alloc(41)\n")
    send(proc, "m.free(ids[:5])")

    def figures() -> tuple:
        listed = json.loads(kvctl("list", "--json").stdout)
        row = next(r for r in listed if r["name"] == "agree")
        shown = re.search(r"(\d+) free, (\d+) total", kvctl("show", "agree").stdout)
        once = subprocess.run([sys.executable, "-m", "kvtop.app", "--once", "--model", "agree"], capture_output=True,
                              text=True, timeout=60, env=child_env(), stdin=subprocess.DEVNULL).stdout
        caption = re.search(r"([\d,]+) reserved, ([\d,]+) free\)", once)
        bar = re.search(r"host backend.*?(\d+)% of", once)
        with Exporter("127.0.0.1", 0) as exporter, urllib.request.urlopen(exporter.url, timeout=10) as response:
            samples = [s for f in text_string_to_metric_families(response.read().decode()) for s in f.samples]
        scraped = {s.labels["state"]: int(s.value) for s in samples
                   if s.name == "kvcached_pages" and s.labels["model"] == "agree"}
        assert shown and caption, once
        return row, int(shown[1]), int(caption[2].replace(",", "")), bar and int(bar[1]), scraped

    for _ in range(5):  # the warm pool may grow or be returned between the reads: take a quiet moment
        before = kc.snapshot("agree")
        row, shown_free, once_free, bar_pct, scraped = figures()
        after = kc.snapshot("agree")
        if (before.pages_inuse, before.pages_reserved) == (after.pages_inuse, after.pages_reserved):
            break
    counted = pagemap.count_pages(after.pages)
    free = after.pages_total - counted.inuse - counted.reserved
    assert counted.inuse == 10 and free > 0  # the first page emptied by the free
    assert row["pages_free"] == shown_free == once_free == scraped["free"] == free
    assert (row["pages_inuse"], row["pages_reserved"]) == (scraped["inuse"], scraped["reserved"])
    if not nvml.probe():  # no GPU: the device panel is the host bar, against the model's own capacity base
        assert row["device_capacity"] > 0
        expected = percent(row["mapped_bytes"], row["device_capacity"])
        assert expected is not None and expected >= 1 and bar_pct == round(expected)
