"""Bad input to the core API and the environment, one test per row of docs/bad-input.md.

The last test keeps the document honest: every row names a test that exists (pytest collects
it), every kvctl case in tests/test_kvctl_bad_inputs.py has a row, and every test here has one.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env, freeze, send
from test_hardening_crash import process_state

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment.writer import SegmentError
from kvcached_core.settings import ConfigError

SMALL = dict(num_blocks=64, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)
DOC = ROOT / "docs" / "bad-input.md"


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- the segment directory -----------------------------------------------------------------

def test_missing_segment_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path / "nowhere"))
    found = kc.scan()
    assert found.models == ()
    assert [(p.path, p.status, p.reason) for p in found.problems] == [
        (str(tmp_path / "nowhere"), "unreadable", "No such file or directory")]
    assert kc.list_models() == []


def test_newer_layout_version(shm_dir):
    with kc.KVCacheManager("future", name="future", **SMALL):
        data = bytearray((shm_dir / "kvc.future").read_bytes())
    data[8:12] = (L.LAYOUT_VERSION + 1).to_bytes(4, "little")  # the u32 after the magic
    (shm_dir / "kvc.future").write_bytes(data)
    (problem,) = kc.scan().problems
    assert (problem.status, problem.reason) == (
        "corrupt", f"layout version {L.LAYOUT_VERSION + 1} (this reader knows {L.LAYOUT_VERSION})")


def test_renamed_segment_file(shm_dir, spawn_allocator):
    spawn_allocator("orig")
    (shm_dir / "kvc.copy").write_bytes((shm_dir / "kvc.orig").read_bytes())
    found = kc.scan()
    assert [m.name for m in found.models] == ["orig"]
    assert [(Path(p.path).name, p.status, p.reason) for p in found.problems] == [
        ("kvc.copy", "corrupt", "the header names segment 'orig', not this file")]


def test_writer_frozen_in_the_middle_of_a_publish(shm_dir):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal
        from kvcached_core.segment.writer import Identity, SegmentWriter
        w = SegmentWriter(Identity(name="frozen", model="frozen", engine="custom", backend="host", device=0,
                                   page_size=1 << 20, block_bytes=1 << 16, num_layers=1, num_kv_buffers=2,
                                   blocks_per_page=16, num_blocks=64, pages_total=4))
        w.begin()
        os.kill(os.getpid(), signal.SIGSTOP)
    """)], env=child_env())
    try:
        deadline = time.monotonic() + 10
        while not (shm_dir / "kvc.frozen").exists() or process_state(child.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = time.monotonic()
        found = kc.scan()
        assert time.monotonic() - started < 5  # bounded: it gives up, it does not wait for the writer
        assert found.problems == ()
        (frozen,) = found.models  # still there: late, with what it published before (nothing yet)
        assert (frozen.pid, frozen.display_status, frozen.mapped_bytes) == (child.pid, "late", 0)
        assert frozen.figures_age_s is not None
    finally:
        child.kill()
        child.wait()


# -- the allocator -------------------------------------------------------------------------

def test_name_taken_by_a_file_that_is_not_a_segment(shm_dir):
    (shm_dir / "kvc.junk").write_bytes(b"left over by something else")
    os.chmod(shm_dir / "kvc.junk", 0o600)
    with pytest.raises(SegmentError, match=r"'junk' is taken: .*kvc\.junk is not a kvcached_core segment; remove it"):
        kc.KVCacheManager("junk", name="junk", **SMALL)
    assert (shm_dir / "kvc.junk").read_bytes() == b"left over by something else"


@pytest.mark.parametrize(("change", "message"), [
    (dict(num_blocks=0), "num_blocks must be a positive integer, got 0"),
    (dict(block_bytes=-1), "block_bytes must be a positive integer, got -1"),
    (dict(num_layers=1.5), "num_layers must be a positive integer, got 1.5"),
    (dict(page_size="2MiB"), "page_size must be a positive integer, got '2MiB'"),
    (dict(block_bytes=1 << 20), "a block of 1048576 bytes does not fit a page of 262144 bytes"),
    (dict(block_bytes=8, page_size=1 << 18), "32768 blocks per page exceeds 32767"),
], ids=["num_blocks-0", "block_bytes-negative", "num_layers-float", "page_size-text", "block-over-page",
        "too-many-blocks-per-page"])
def test_bad_allocator_geometry(shm_dir, change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        kc.KVCacheManager("geo", name="geo", **{**SMALL, **change})
    assert files(shm_dir) == {}


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("KVCACHED_PAGE_SIZE_MB", "3", "KVCACHED_PAGE_SIZE_MB=3 must be a positive multiple of 2"),
    ("KVCACHED_PAGE_SIZE_MB", "two", "KVCACHED_PAGE_SIZE_MB='two' is not an integer"),
    ("KVCACHED_MIN_RESERVED_PAGES", "20", "reserve bounds need 0 <= KVCACHED_MIN_RESERVED_PAGES (20)"),
    ("KVCACHED_MAX_CACHED_TOKENS", "lots", "KVCACHED_MAX_CACHED_TOKENS='lots' is not an integer"),
    ("KVCACHED_HOST_CAPACITY", "12XB", "KVCACHED_HOST_CAPACITY: '12XB': unknown unit 'XB'"),
    ("KVCACHED_FASTPATH", "maybe", "KVCACHED_FASTPATH='maybe' must be auto, 1 or 0"),
], ids=["page-size-odd", "page-size-word", "reserve-bounds", "cached-tokens-word", "host-capacity-unit", "fastpath"])
def test_bad_environment(shm_dir, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    kwargs = {k: v for k, v in SMALL.items() if not (variable == "KVCACHED_PAGE_SIZE_MB" and k == "page_size")}
    with pytest.raises(ConfigError, match=re.escape(message)):
        kc.KVCacheManager("env", name="env", **kwargs)
    assert files(shm_dir) == {}


def test_freeing_what_is_not_allocated_changes_nothing(shm_dir, monkeypatch):
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")  # no background refill between the two reads
    with kc.KVCacheManager("frees", name="frees", **SMALL) as m:
        held = m.alloc(3)
        before = kc.snapshot("frees")
        for bad in ([held[0], held[0]], [held[0], 10_000], [-1], ["0"], [held[1], held[2] + 1]):
            with pytest.raises(ValueError, match="is not allocated .*nothing was changed"):
                m.free(bad)
        with pytest.raises(ValueError, match="blocks not in the prefix cache"):
            m.reuse(held[:1])
        with pytest.raises(ValueError, match="a limit cannot be negative"):
            m.set_limit(-1)
        after = kc.snapshot("frees")
        assert (after.blocks_used, after.free_count, list(after.pages)) == (3, 0, list(before.pages))
        m.free(held)


def test_using_a_closed_allocator():
    m = kc.KVCacheManager("closed", name="closed", **SMALL)
    m.close()
    for call in (lambda: m.alloc(1), lambda: m.free([0]), lambda: m.try_to_reserve(1), lambda: m.mark_cached([0])):
        with pytest.raises(RuntimeError, match="KVCacheManager 'closed' is closed"):
            call()
    m.close()  # twice is fine
    assert kc.list_models() == []


# -- controllers ---------------------------------------------------------------------------

def test_negative_limit(spawn_allocator):
    spawn_allocator("neg")
    with pytest.raises(kc.ControlError, match="a limit cannot be negative"):
        kc.request_limit("neg", -1)
    assert kc.snapshot("neg").limit_revision == 0


def test_control_of_a_stale_model(spawn_allocator):
    proc = spawn_allocator("dead")
    proc.kill()
    proc.wait()
    with pytest.raises(kc.ControlError, match="dead is stale: its process is gone, nothing would apply the limit"):
        kc.request_limit("dead", 1 << 20)
    with pytest.raises(kc.ControlError, match="dead is stale: its process is gone, nothing to trim"):
        kc.request_trim("dead")


def test_unknown_or_ambiguous_model(spawn_allocator):
    spawn_allocator("llama-8b")
    spawn_allocator("llama-70b")
    with pytest.raises(kc.ModelNotFound, match=r"no model named 'qwen' \(known: llama-70b, llama-8b\)") as missing:
        kc.request_limit("qwen", 1 << 20)
    assert missing.value.candidates == ["llama-70b", "llama-8b"]
    with pytest.raises(kc.ModelNotFound, match="model name 'llama' is ambiguous: llama-70b, llama-8b"):
        kc.request_trim("llama")
    assert kc.resolve("llama-7", kc.list_models()).name == "llama-70b"  # a unique prefix is fine


def test_control_lock_held_by_a_hung_controller(spawn_allocator, shm_dir):
    spawn_allocator("locked")
    holder = os.open(shm_dir / "kvc.locked", os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(kc.ControlError, match="kvc.locked: another controller holds its lock"):
            kc.request_limit("locked", 1 << 20)
    finally:
        os.close(holder)
    assert kc.request_limit("locked", 1 << 20, wait=5).status == "applied"


def test_trim_of_an_upstream_segment(shm_dir):
    (shm_dir / "kvcached_vllm_1").write_bytes(L.LEGACY.pack(0, 1 << 20, 1 << 19))
    with pytest.raises(kc.ControlError, match="upstream kvcached segment: it cannot be trimmed from outside"):
        kc.request_trim("kvcached_vllm_1")


def test_a_model_that_does_not_acknowledge(spawn_allocator):
    proc = spawn_allocator("slow")
    freeze(proc.pid)  # alive, heartbeat still fresh for a moment, but not answering
    try:
        with pytest.raises(kc.AckTimeout, match="slow did not acknowledge the limit within 0.3 s") as timeout:
            kc.request_limit("slow", 1 << 20, wait=0.3)
        assert timeout.value.ack.status == "pending"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    send(proc, "pass")
    deadline = time.monotonic() + 10
    while kc.snapshot("slow").applied_revision < 1:  # it applies the request once it runs again
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty size"), ("12XB", "unknown unit 'XB'"), ("-1G", "a size cannot be negative"),
    ("1.2.3G", "is not a size"), ("150%", "at most 100"), ("none", "'none' is not a size here"),
])
def test_bad_size_text(text, message):
    with pytest.raises(kc.SizeError, match=re.escape(message)):
        kc.parse_size(text, percent_of=1 << 30)


# -- the document --------------------------------------------------------------------------

def doc_rows() -> list[tuple[str, str, str]]:
    """(case, behaviour, test node id) of every test each table row of docs/bad-input.md names."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`tests/"):
            # One or more node ids; a bare `[case]` is another case of the test named before it.
            function = ""
            for node in re.findall(r"`([^`]+)`", cells[2]):
                if node.startswith("["):
                    node = function + node
                function = node.split("[")[0]
                rows.append((cells[0], cells[1], node))
    return rows


def test_every_row_of_the_bad_input_table_names_a_test_that_exists():
    rows = doc_rows()
    assert len(rows) > 80
    referenced = {node for _, _, node in rows}
    test_files = sorted({node.split("::")[0] for node in referenced})
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                *test_files], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    nodes = set(collected.stdout.split())
    functions = {n.split("[")[0] for n in nodes}  # a row may name a whole parametrized test
    missing = sorted(referenced - nodes - functions)
    assert not missing, f"rows naming no collected test: {missing}"
    assert all(case and behaviour for case, behaviour, _ in rows)

    here = {n for n in functions if n.startswith("tests/test_hardening_badinput.py::")}
    here.discard("tests/test_hardening_badinput.py::" + sys._getframe().f_code.co_name)
    assert sorted(here - referenced) == [], "tests in this file without a row in docs/bad-input.md"
    kvctl_cases = {n for n in nodes if n.startswith("tests/test_kvctl_bad_inputs.py::test_bad_input[")}
    assert sorted(kvctl_cases - referenced) == [], "kvctl bad-input cases without a row in docs/bad-input.md"
