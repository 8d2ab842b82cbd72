"""The ENDPOINT words: where an engine serves its model, published in its segment for routers and readers.

A sealed block in the header region's spare tail: published by KVCacheManager.publish_endpoint or
KVCACHED_ENDPOINT, read by every snapshot (``endpoint`` in kvctl list/show --json); a URL no engine can have
written (a forger's, a damaged block) reads as none; a segment written before the block existed reads as none.
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
from kvcached_core.settings import ConfigError, settings


def seal_endpoint(path: os.PathLike, payload: bytes, seq: int = 1 << 40) -> None:
    """Write the ENDPOINT block as a forger who knows the format would: whole, with a check that matches."""
    off, size = L.SEALED["endpoint"]
    assert len(payload) == size
    with open(path, "r+b") as fh:
        os.pwrite(fh.fileno(), L.U64.pack(seq) + payload + L.U64.pack(zlib.crc32(payload) ^ (seq & 0xFFFFFFFF)), off)


def listed(name: str) -> dict:
    (row,) = [r for r in json.loads(kvctl("list", "--json").stdout) if r["name"] == name]
    return row


def test_a_published_endpoint_is_in_every_reader(spawn_allocator, shm_dir):
    proc = spawn_allocator("ep")
    assert kc.snapshot("ep").endpoint is None and listed("ep")["endpoint"] is None  # none published yet
    first = scan()  # keeps the file open: the next scan must see the new words, not its kept decode
    assert [m.endpoint for m in first.models] == [None]
    send(proc, "m.publish_endpoint('http://127.0.0.1:8011')")
    wait_for(lambda: [m.endpoint for m in scan().models] == ["http://127.0.0.1:8011"], what="the endpoint")
    assert listed("ep")["endpoint"] == "http://127.0.0.1:8011"
    shown = json.loads(kvctl("show", "ep", "--json").stdout)
    assert shown["endpoint"] == "http://127.0.0.1:8011"
    send(proc, "m.publish_endpoint('https://[::1]:9443/v1')")  # moved: the last one counts
    wait_for(lambda: kc.snapshot("ep").endpoint == "https://[::1]:9443/v1", what="the moved endpoint")


def test_kvcached_endpoint_is_published_at_start(spawn_allocator, shm_dir, monkeypatch):
    monkeypatch.setenv("KVCACHED_ENDPOINT", "http://localhost:8022")
    spawn_allocator("envep")
    assert kc.snapshot("envep").endpoint == "http://localhost:8022"


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h:21", "http://h", "http://h:0", "http://u:p@h:1",
                                 "http://h:1/?q=1", "http://h:99999", "http://" + "h" * 120 + ":1", "http://h:1/ä"])
def test_an_endpoint_a_segment_cannot_hold_is_refused(url, monkeypatch):
    assert L.endpoint_problem(url) is not None
    monkeypatch.setenv("KVCACHED_ENDPOINT", url)
    with pytest.raises(ConfigError, match="KVCACHED_ENDPOINT"):
        settings().endpoint  # noqa: B018


def test_publish_endpoint_refuses_a_bad_url(shm_dir):
    m = kc.KVCacheManager("badep", num_blocks=64, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
    try:
        with pytest.raises(ValueError, match="scheme must be http or https"):
            m.publish_endpoint("unix:///tmp/sock")
        assert kc.snapshot("badep").endpoint is None
    finally:
        m.close()


def _payload(url: bytes, length: int | None = None) -> bytes:
    return L.ENDPOINT.pack(len(url) if length is None else length, url)


@pytest.mark.parametrize("payload", [
    _payload(b"ftp://127.0.0.1:21"), _payload(b"http://127.0.0.1:8000", length=5),
    _payload(b"http://127.0.0.1:8000", length=L.ENDPOINT_MAX + 1), _payload(b"http://127.0.0.1:8000\0junk", 21),
    _payload(b"http://\xff\xfe:8000"), _payload(b"http://h:1\x1b[2J"),
], ids=["scheme", "cut", "too_long", "trailing_bytes", "not_ascii", "escape"])
def test_forged_endpoint_words_read_as_none(spawn_allocator, shm_dir, payload):
    spawn_allocator("forged", script="m.publish_endpoint('http://127.0.0.1:8000')\nb = m.alloc(4)\n")
    seal_endpoint(shm_dir / "kvc.forged", payload)
    snap = kc.snapshot("forged")
    assert snap.status == "live" and snap.blocks_used == 4 and snap.endpoint is None
    assert listed("forged")["endpoint"] is None


def test_a_damaged_endpoint_block_reads_as_none(spawn_allocator, shm_dir):
    spawn_allocator("damaged", script="m.publish_endpoint('http://127.0.0.1:8000')\nb = m.alloc(4)\n")
    off, size = L.SEALED["endpoint"]
    with open(shm_dir / "kvc.damaged", "r+b") as fh:
        os.pwrite(fh.fileno(), b"9", off + 8 + 8)  # one byte of the URL, the check left as it was
    snap = kc.snapshot("damaged")
    assert snap.status == "live" and snap.blocks_used == 4 and snap.endpoint is None
    assert snap.traffic is None and snap.sleep.state == "awake"  # the other words are read as usual


def test_a_segment_written_before_the_endpoint_reads_as_none(spawn_allocator, shm_dir):
    """The block lies where earlier writers of this layout left zeros, and readers before it never look."""
    spawn_allocator("older", script="b = m.alloc(4)\n")
    raw = (shm_dir / "kvc.older").read_bytes()
    assert raw[L.ENDPOINT_OFF:L.HEADER_SIZE] == bytes(L.HEADER_SIZE - L.ENDPOINT_OFF)
    assert L.HEADER.size <= L.ENDPOINT_OFF  # the header struct, which readers compare, ends before it
    assert kc.snapshot("older").endpoint is None
