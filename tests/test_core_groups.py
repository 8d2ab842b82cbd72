"""The GROUPS words: an engine's KV cache groups (vLLM's sliding-window layers beside full ones), and each
group's blocks and pages, published in its segment for kvtop and kvctl.

A sealed block between the control words and the page map: published by KVCacheManager.publish_groups, read
by every snapshot (``groups`` in kvctl list/show --json); words no engine can have written read as none.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
from conftest import kvctl, send, wait_for

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import scan

TWO = [("sliding window", 256, 2, 30, 12, 3), ("full attention", None, 2, 40, 0, 4)]


def seal_groups(path: os.PathLike, words: list[int], seq: int = 1 << 40) -> None:
    """Write the GROUPS block as a forger who knows the format would: whole, with a check that matches."""
    off, size = L.SEALED["groups"]
    payload = L.GROUPS.pack(*words, *[0] * (L.GROUPS.size // 4 - len(words)))
    assert len(payload) == size
    with open(path, "r+b") as fh:
        os.pwrite(fh.fileno(), L.U64.pack(seq) + payload + L.U64.pack(zlib.crc32(payload) ^ (seq & 0xFFFFFFFF)), off)


def test_published_groups_are_in_every_reader(spawn_allocator, shm_dir) -> None:
    proc = spawn_allocator("hyb", num_layers=2)
    assert kc.snapshot("hyb").groups is None  # none published: none shown, never invented
    first = scan()  # keeps the file open: the next scan must see the new words, not its kept decode
    assert [m.groups for m in first.models] == [None]
    send(proc, f"m.publish_groups({TWO!r})")
    wait_for(lambda: scan().models[0].groups is not None, what="the groups")
    (sliding, full) = kc.snapshot("hyb").groups
    assert (sliding.shape, sliding.window, sliding.layers, sliding.blocks_active, sliding.blocks_cached,
            sliding.pages) == ("sliding window", 256, 2, 30, 12, 3)
    assert (full.shape, full.window, full.pages) == ("full attention", None, 4)
    shown = json.loads(kvctl("show", "hyb", "--json").stdout)
    assert shown["groups"] == [
        {"shape": "sliding window", "window": 256, "layers": 2, "blocks_active": 30, "blocks_cached": 12, "pages": 3},
        {"shape": "full attention", "window": None, "layers": 2, "blocks_active": 40, "blocks_cached": 0, "pages": 4}]
    (row,) = json.loads(kvctl("list", "--json").stdout)
    assert row["groups"] == shown["groups"]


@pytest.mark.parametrize(("groups", "says"), [
    (TWO * 3, "at most 4"),
    ([("mamba", None, 1, 0, 0, 0)], "is not one of"),
    ([("MLA", None, 1, -1, 0, 0)], "figures of"),
])
def test_groups_a_segment_cannot_hold_are_refused(shm_dir, groups, says) -> None:
    with kc.KVCacheManager("bad", num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024) as m:
        with pytest.raises(ValueError, match=says):
            m.publish_groups(groups)
        assert kc.snapshot("bad").groups is None  # nothing was written


@pytest.mark.parametrize("words", [
    [1, 0, 9, 0, 2, 0, 0, 0],  # a shape no engine writes
    [5, 0],  # more groups than a segment holds
    [1, 0, 1, 0, 5, 0, 0, 0],  # more layers than the model's ranges (2)
    [1, 0, 1, 0, 2, 10_000, 0, 0],  # more blocks than the model has
    [1, 0, 1, 0, 2, 0, 0, 1_000],  # more pages than the model has
    [1, 7, 1, 0, 2, 0, 0, 0],  # the spare word is not zero
    [1, 0, 1, 0, 2, 0, 0, 0, 2, 0, 2, 0, 0, 0],  # a record past the count
])
def test_forged_group_words_read_as_none(spawn_allocator, shm_dir, words) -> None:
    spawn_allocator("forged", num_layers=2, num_blocks=512)
    seal_groups(shm_dir / "kvc.forged", words)
    (model,) = scan().models
    assert model.groups is None and model.status == "live"
    (row,) = json.loads(kvctl("list", "--json").stdout)
    assert row["groups"] is None


def test_a_forger_who_writes_possible_groups_is_read(spawn_allocator, shm_dir) -> None:
    spawn_allocator("fine", num_layers=2, num_blocks=512)
    seal_groups(shm_dir / "kvc.fine", [1, 0, 3, 0, 2, 7, 1, 2])
    (group,) = scan().models[0].groups
    assert (group.shape, group.layers, group.blocks_active, group.blocks_cached, group.pages) == ("MLA", 2, 7, 1, 2)


def test_kvctl_show_says_each_groups_blocks_and_pages(spawn_allocator, shm_dir) -> None:
    proc = spawn_allocator("shown", num_layers=2)
    assert "group 0" not in kvctl("show", "shown").stdout  # none published: no line
    send(proc, f"m.publish_groups({TWO!r})")
    text = kvctl("show", "shown").stdout
    assert "group 0      sliding window 256, 2 layers: 30 active + 12 cached blocks on 3 pages" in text
    assert "group 1      full attention, 2 layers: 40 active + 0 cached blocks on 4 pages" in text


def test_the_exporter_serves_each_groups_blocks_and_pages(spawn_allocator, shm_dir) -> None:
    from test_exporter import scrape, value

    from kvtop.serve.exporter import Exporter

    proc = spawn_allocator("scraped", num_layers=2)
    spawn_allocator("plain")
    send(proc, f"m.publish_groups({TWO!r})")
    with Exporter("127.0.0.1", 0) as exporter:
        samples = scrape(exporter.url)
    assert value(samples, "kvcached_group_blocks", model="scraped", group="0", shape="sliding window 256",
                 state="active") == 30
    assert value(samples, "kvcached_group_blocks", model="scraped", group="0", state="cached") == 12
    assert value(samples, "kvcached_group_pages", model="scraped", group="1", shape="full attention") == 4
    assert not any(name.startswith("kvcached_group_") and ("model", "plain") in labels for name, labels in samples)
