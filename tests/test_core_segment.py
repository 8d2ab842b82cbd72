"""The segment file: owner-only, exclusive, validated names, unlinked on close."""

from __future__ import annotations

import os
import stat

import pytest

import kvcached_core as kc
from kvcached_core import InvalidName, KVCacheManager, SegmentError
from kvcached_core.segment.names import segment_path, validate

SMALL = dict(num_blocks=64, block_bytes=16 * 1024, num_layers=1, page_size=64 * 1024)


def our_files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("kvc."))


def test_segment_is_created_owner_only_even_with_umask_zero(shm_dir):
    old = os.umask(0)
    try:
        with KVCacheManager("perm", name="perm", **SMALL) as m:
            st = os.lstat(m.segment.path)
            assert stat.S_ISREG(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_uid == os.getuid()
    finally:
        os.umask(old)


def test_a_second_allocator_with_a_live_name_fails_clearly(shm_dir):
    with KVCacheManager("first", name="shared", **SMALL) as first:
        first.alloc(3)
        with pytest.raises(SegmentError, match=r"kvc\.shared .*live"):
            KVCacheManager("second", name="shared", **SMALL)
        snap = kc.snapshot("shared")  # the first allocator's segment is untouched
        assert (snap.model, snap.pid, snap.blocks_used, snap.status) == ("first", os.getpid(), 3, "live")
    assert our_files(shm_dir) == []


def test_a_name_held_by_another_live_process_is_refused(shm_dir, spawn_allocator):
    proc = spawn_allocator("taken")
    with pytest.raises(SegmentError, match=rf"kvc\.taken .*live allocator \(pid {proc.pid}\)"):
        KVCacheManager("mine", name="taken", **SMALL)
    assert kc.snapshot("taken").pid == proc.pid


@pytest.mark.parametrize("name", ["../x", "a/b", "x" * 65, "", "a b", ".", "kvc.x", "é", "-\n"])
def test_invalid_names_raise_invalid_name_and_create_nothing(shm_dir, name, monkeypatch):
    with pytest.raises(InvalidName, match="invalid segment name"):
        validate(name)
    with pytest.raises(InvalidName):
        segment_path(name)
    with pytest.raises(InvalidName):
        KVCacheManager("model", name=name, **SMALL)
    if "\0" not in name and name:
        monkeypatch.setenv("KVCACHED_IPC_NAME", name)
        with pytest.raises(InvalidName):
            KVCacheManager("model", **SMALL)
    assert list(shm_dir.iterdir()) == []
    assert not (shm_dir.parent / "x").exists()


def test_valid_names_at_the_edges(shm_dir, monkeypatch):
    assert validate("x" * 64) == "x" * 64
    with KVCacheManager("m", name="A-z_09" + "y" * 58, **SMALL) as m:
        assert our_files(shm_dir) == ["kvc." + m.name]
    monkeypatch.setenv("KVCACHED_IPC_NAME", "from-env")
    with KVCacheManager("m", **SMALL) as m:
        assert m.name == "from-env"


def test_default_names_do_not_collide_within_or_between_processes(shm_dir, spawn_allocator):
    with KVCacheManager("org/model", **SMALL) as a, KVCacheManager("org/model", **SMALL) as b:
        assert a.name == "org_model"
        assert b.name == f"org_model-{os.getpid()}"
        assert our_files(shm_dir) == sorted(["kvc.org_model", f"kvc.org_model-{os.getpid()}"])
    assert our_files(shm_dir) == []


def test_a_symlink_in_the_way_is_never_followed(shm_dir, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (shm_dir / "kvc.link").symlink_to(target)
    with pytest.raises(SegmentError):
        KVCacheManager("m", name="link", **SMALL)
    assert target.read_bytes() == b"precious"
    assert os.path.islink(shm_dir / "kvc.link")


def test_own_stale_segment_is_replaced_in_process(shm_dir):
    with KVCacheManager("old", name="again", **SMALL) as m:
        m.alloc(5)
        raw = bytearray(m.segment.path.read_bytes())
    # Write back the segment as if its process had died without cleaning up (pid 2**22 never runs).
    import kvcached_core.segment.layout as L

    fields = list(L.HEADER.unpack_from(raw, 0))
    fields[L.HEADER_FIELDS.index("pid")] = 2**22 - 1
    L.HEADER.pack_into(raw, 0, *fields)
    path = shm_dir / "kvc.again"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, raw)
    os.close(fd)
    assert kc.snapshot("again").status == "stale"
    with KVCacheManager("new", name="again", **SMALL) as m:
        snap = kc.snapshot("again")
        assert (snap.model, snap.pid, snap.status, snap.blocks_used) == ("new", os.getpid(), "live", 0)


def test_the_header_tells_who_and_what(shm_dir):
    with KVCacheManager("org/llm", name="ident", engine="vllm", device=3, **SMALL) as m:
        snap = kc.snapshot("ident")
        assert (snap.model, snap.engine, snap.backend, snap.pid, snap.uid, snap.device) == (
            "org/llm", "vllm", "host", os.getpid(), os.getuid(), 3)
        assert (snap.page_size, snap.block_bytes, snap.num_layers, snap.num_kv_buffers) == (64 * 1024, 16 * 1024, 1, 2)
        assert (snap.blocks_per_page, snap.num_blocks, snap.pages_total) == (4, 64, 16)
        assert snap.bundle_bytes == m.bundle_bytes == 128 * 1024
        path = m.segment.path
    assert not path.exists(), "closing unlinks the segment"


def test_close_is_idempotent_and_a_closed_allocator_refuses_every_call(shm_dir):
    m = KVCacheManager("m", name="closing", **SMALL)
    m.close()
    m.close()
    calls = {
        "alloc": lambda: m.alloc(1), "free": lambda: m.free([0]), "try_to_reserve": lambda: m.try_to_reserve(1),
        "free_reserved": m.free_reserved, "available_size": m.available_size, "trim": m.trim,
        "set_limit": lambda: m.set_limit(1 << 20), "mark_cached": lambda: m.mark_cached([0]),
        "reuse": lambda: m.reuse([]), "evict": lambda: m.evict(1),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match="KVCacheManager 'closing' is closed"):
            call()
            pytest.fail(f"{what} worked on a closed allocator")
    assert our_files(shm_dir) == []


def test_a_segment_appears_complete_or_not_at_all(shm_dir):
    """Readers scanning while allocators start never see a half-written header (no problem reported)."""
    import threading

    done = threading.Event()
    problems: list = []

    def scan_loop() -> None:
        while not done.is_set():
            problems.extend(kc.scan().problems)

    reader = threading.Thread(target=scan_loop)
    reader.start()
    try:
        for i in range(40):
            with kc.KVCacheManager(f"appear{i}", num_blocks=64, block_bytes=16 * 1024, num_layers=1,
                                   page_size=64 * 1024) as m:
                assert m.name == f"appear{i}"
    finally:
        done.set()
        reader.join()
    assert problems == []
    assert not [p for p in shm_dir.iterdir() if p.name.startswith(".kvc-new.")]  # no temporary left behind
