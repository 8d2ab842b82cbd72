"""Upstream kvcached segments appear as legacy rows; files that are not segments are Problems, never exceptions."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest

import kvcached_core as kc
from kvcached_core.segment import layout as L

GiB = 1024**3
LIVE = os.getpgrp()  # a process group that exists and is older than any file a test writes


def legacy_file(directory, name: str, total: int, used: int, prealloc: int):
    path = directory / name
    path.write_bytes(L.LEGACY.pack(total, used, prealloc))
    path.chmod(0o600)
    return path


def fields(path) -> tuple[int, int, int]:
    return L.LEGACY.unpack(path.read_bytes())


def test_upstream_segments_are_listed_as_legacy(shm_dir, monkeypatch):
    legacy_file(shm_dir, f"kvcached_vllm_{LIVE}", 8 * GiB, 3 * GiB, 1 * GiB)
    legacy_file(shm_dir, f"kvcached_sglang_{LIVE}_1", 0, GiB, 0)
    monkeypatch.setenv("KVCACHED_IPC_NAME", "custom_ipc")
    legacy_file(shm_dir, "custom_ipc", 2 * GiB, 0, 0)
    rows = {m.name: m for m in kc.list_models()}
    assert set(rows) == {f"kvcached_vllm_{LIVE}", f"kvcached_sglang_{LIVE}_1", "custom_ipc"}
    vllm = rows[f"kvcached_vllm_{LIVE}"]
    assert (vllm.status, vllm.display_status, vllm.engine, vllm.pid, vllm.legacy) == ("legacy", "legacy", "vllm", LIVE, True)
    assert (vllm.limit_bytes, vllm.limit_status, vllm.mapped_bytes) == (8 * GiB, "written", 4 * GiB)
    assert (vllm.reserved_bytes, vllm.held_bytes, vllm.waste_ratio) == (GiB, 3 * GiB, None)
    sglang = rows[f"kvcached_sglang_{LIVE}_1"]  # total 0: upstream sized its cache to nothing
    assert (sglang.engine, sglang.pid, sglang.limit_bytes, sglang.limit_status) == ("sglang", LIVE, 0, "pending")
    assert (rows["custom_ipc"].engine, rows["custom_ipc"].pid, rows["custom_ipc"].limit_bytes) == ("kvcached", 0, 2 * GiB)
    json.dumps([m.to_dict() for m in rows.values()])  # the JSON shape holds for legacy rows too


def test_request_limit_writes_the_total_field_and_nothing_else(shm_dir):
    name = f"kvcached_vllm_{LIVE}"
    path = legacy_file(shm_dir, name, 8 * GiB, 3 * GiB, GiB)
    ack = kc.request_limit(name, 5 * GiB)
    assert (ack.kind, ack.status, ack.effective_limit, ack.in_use) == ("limit", "legacy", 5 * GiB, 3 * GiB)
    assert fields(path) == (5 * GiB, 3 * GiB, GiB)
    assert kc.snapshot(name).limit_bytes == 5 * GiB
    with pytest.raises(kc.ControlError, match="cannot be trimmed from outside"):
        kc.request_trim(name)
    assert fields(path) == (5 * GiB, 3 * GiB, GiB)


def test_request_limit_waits_for_upstreams_flock(shm_dir):
    name = f"kvcached_vllm_{LIVE}_2"
    path = legacy_file(shm_dir, name, 8 * GiB, 0, 0)
    holder = os.open(path, os.O_RDONLY)  # upstream's reader holding its lock
    fcntl.flock(holder, fcntl.LOCK_SH)
    result: list[object] = []
    writer = threading.Thread(target=lambda: result.append(kc.request_limit(name, 3 * GiB)))
    try:
        writer.start()
        time.sleep(0.3)
        assert writer.is_alive(), "the limit was written without the lock"
        assert fields(path)[0] == 8 * GiB
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        os.close(holder)
    writer.join(5)
    assert result and result[0].status == "legacy"
    assert fields(path)[0] == 3 * GiB


def test_a_lock_that_is_never_released_fails_clearly_and_writes_nothing(shm_dir):
    name = f"kvcached_vllm_{LIVE}_3"
    path = legacy_file(shm_dir, name, 8 * GiB, 0, 0)
    row = kc.snapshot(name)
    holder = os.open(path, os.O_RDONLY)  # a hung upstream writer
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(kc.ControlError, match=name):
            kc.request_limit(row, GiB)
        (problem,) = kc.scan().problems  # readers do not hang on it either
        assert (os.path.basename(problem.path), problem.status) == (name, "busy")
    finally:
        os.close(holder)
    assert fields(path)[0] == 8 * GiB


def header_bytes(**changes) -> bytes:
    values = dict(magic=L.MAGIC, layout_version=L.LAYOUT_VERSION, header_bytes=L.HEADER_SIZE,
                  total_bytes=L.total_size(4, 1), pages_total=4, name=b"hdr", model=b"m", engine=b"e",
                  backend=b"host", pid=os.getpid(), start_time=0, uid=os.getuid(), device=0, tp_rank=0,
                  tp_world=1, page_size=65536, block_bytes=8192, num_layers=1, num_kv_buffers=2,
                  blocks_per_page=8, num_blocks=32, created_ns=0, ranks_max=1, device_capacity=0, pid_ns=0,
                  wake_token=0, device_headroom=0)
    values.update(changes)
    return L.HEADER.pack(*(values[f] for f in L.HEADER_FIELDS))


def test_garbage_in_our_namespace_is_reported_never_raised(shm_dir, tmp_path):
    live = kc.KVCacheManager("real", name="real", num_blocks=32, block_bytes=8192, num_layers=1, page_size=65536)
    try:
        (shm_dir / "kvc.empty").write_bytes(b"")
        (shm_dir / "kvc.noise").write_bytes(os.urandom(100))
        (shm_dir / "kvc.bignoise").write_bytes(os.urandom(5000))
        (shm_dir / "kvc.magiconly").write_bytes(L.MAGIC + b"\xff" * 40)
        (shm_dir / "kvc.future").write_bytes(header_bytes(name=b"future", layout_version=99).ljust(5000, b"\0"))
        (shm_dir / "kvc.short").write_bytes(header_bytes(name=b"short").ljust(700, b"\0"))
        (shm_dir / "kvc.huge").write_bytes(header_bytes(name=b"huge", pages_total=2**40).ljust(2048, b"\0"))
        (shm_dir / "kvc.hdr").write_bytes(header_bytes(pid=2**40).ljust(L.total_size(4, 1), b"\0"))
        (shm_dir / "kvc.renamed").write_bytes(live.segment.path.read_bytes())
        (shm_dir / "kvc.dir").mkdir()
        os.mkfifo(shm_dir / "kvc.fifo")
        (shm_dir / "kvc.link").symlink_to(live.segment.path)
        (shm_dir / "kvcached_vllm_9").write_bytes(b"not 24 bytes")
        result = kc.scan(with_pages=True)
        assert [(m.name, m.status) for m in result.models] == [("hdr", "stale"), ("real", "live")]
        problems = {os.path.basename(p.path): p for p in result.problems}
        expected = {"kvc.empty", "kvc.noise", "kvc.bignoise", "kvc.magiconly", "kvc.future", "kvc.short",
                    "kvc.huge", "kvc.renamed", "kvc.dir", "kvc.fifo", "kvc.link", "kvcached_vllm_9"}
        assert expected <= set(problems), f"not reported: {expected - set(problems)}"
        for problem in problems.values():
            assert problem.status in ("corrupt", "foreign", "unreadable", "busy")
            assert problem.reason
        assert [m.name for m in kc.list_models()] == [m.name for m in result.models]
        assert kc.snapshot("real").status == "live"
        with pytest.raises(kc.ModelNotFound):
            kc.snapshot("noise")
    finally:
        live.close()
        if (shm_dir / "kvc.dir").is_dir():
            (shm_dir / "kvc.dir").rmdir()  # the shared fixture removes files only
