"""Corruption: random, truncated, bit-flipped and foreign files in the segment directory.

Every file in our namespace is either read as a model, or reported as a Problem with a
reason; nothing raises out of scan()/list_models(), nothing hangs (a SIGALRM bounds each
scan), and a valid model beside the damage is still listed with its true figures. Segments
whose checks pass with random contents must not break anything that consumes a snapshot.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment.writer import Identity, SegmentWriter
from kvtop.serve.exporter import KVCachedCollector
from kvtop.text.pagemap import fold

SCAN_BOUND_S = 10  # a hang detector, not a speed target
PROBLEM_KINDS = {"corrupt", "foreign", "unreadable", "busy"}
FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextlib.contextmanager
def bounded(seconds: float):
    def expire(signum, frame):
        raise TimeoutError(f"a scan took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def identity(name: str = "fuzz", **overrides: int) -> Identity:
    fields = dict(name=name, model=name, engine="custom", backend="host", device=0, page_size=1 << 20,
                  block_bytes=1 << 18, num_layers=2, num_kv_buffers=2, blocks_per_page=4, num_blocks=64,
                  pages_total=16, tp_rank=0, tp_world=2, ranks_max=2)
    fields.update(overrides)
    return Identity(**fields)


def image_of(writer_state) -> bytes:
    """The bytes of a segment SegmentWriter produced in the state ``writer_state(writer)`` leaves."""
    writer = SegmentWriter(identity())
    try:
        writer_state(writer)
        return writer.path.read_bytes()
    finally:
        writer.close(unlink=True)


def busy_state(w: SegmentWriter) -> None:
    w.begin()
    for page, used in ((0, 4), (1, 2), (2, 0)):
        w.set_page(page, L.page_entry(True, used, 1 if used else 0))
    w.set_rank(0, 0, 0, os.getpid(), 0, 3 << 20, 0)
    w.set_rank(1, 1, 1, os.getpid(), 0, 3 << 20, 0)
    w.publish((2, 1, 6, 2, 3 * (1 << 22), 5, 2, 9, 3, 0, 1, L.LIMIT_APPLIED, 0, 4 << 22, 1, 0, 0, 4 << 22, 0, 0, 2))


IMAGE = image_of(busy_state)


@pytest.fixture
def good(shm_dir):
    """A real allocator beside the damage, with figures we know."""
    with kc.KVCacheManager("good", name="good", num_blocks=64, block_bytes=1 << 16, num_layers=1,
                           page_size=1 << 18) as manager:
        manager.alloc(5)
        yield manager


def check_directory(shm_dir: Path, damaged: list[Path]) -> None:
    """Scan both ways: bounded, no exception, the good model intact, every damaged file accounted for."""
    for with_pages in (False, True):
        with bounded(SCAN_BOUND_S):
            found = kc.scan(with_pages=with_pages)
            listed = kc.list_models(with_pages=with_pages)
        assert [m.name for m in listed] == [m.name for m in found.models]
        good = [m for m in found.models if m.name == "good"]
        assert len(good) == 1 and good[0].status == "live" and good[0].blocks_used == 5
        as_models = {m.path for m in found.models}
        as_problems = {p.path: p for p in found.problems}
        for problem in found.problems:
            assert problem.status in PROBLEM_KINDS and problem.reason.strip(), problem
        for path in damaged:
            if path.name.startswith(("kvc.", "kvcached_")):
                assert (str(path) in as_models) != (str(path) in as_problems), path
        for model in found.models:  # whatever passed the checks must be usable downstream
            model.to_dict()
            kc.fragmentation(model)
            _ = (model.display_status, model.waste_ratio, model.virtual_bytes)
            if model.pages is not None:
                fold(model.pages, model.blocks_per_page, 40)
    KVCachedCollector(with_nvml=False).build()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


@settings(max_examples=80, **FUZZ)
@given(data=st.binary(max_size=3 * L.PAGE_MAP_OFF),
       name=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True).filter(lambda n: n != "good"))
def test_random_bytes(good, shm_dir, data, name):
    damaged = [write(shm_dir / f"kvc.{name}", data), write(shm_dir / f"kvcached_{name}_1", data[:24])]
    try:
        check_directory(shm_dir, damaged)
    finally:
        for path in damaged:
            path.unlink()


@settings(max_examples=80, **FUZZ)
@given(cut=st.integers(min_value=0, max_value=len(IMAGE) - 1))
def test_truncated_segments(good, shm_dir, cut):
    path = write(shm_dir / "kvc.fuzz", IMAGE[:cut])
    try:
        check_directory(shm_dir, [path])
        found = kc.scan(with_pages=True)
        assert str(path) in {p.path for p in found.problems}  # a truncated segment is never a model
    finally:
        path.unlink()


@settings(max_examples=120, **FUZZ)
@given(flips=st.lists(st.integers(min_value=0, max_value=8 * len(IMAGE) - 1), min_size=1, max_size=12))
def test_bit_flips(good, shm_dir, flips):
    data = bytearray(IMAGE)
    for bit in flips:
        data[bit // 8] ^= 1 << (bit % 8)
    path = write(shm_dir / "kvc.fuzz", bytes(data))
    try:
        check_directory(shm_dir, [path])
        found = kc.scan(with_pages=True)
        in_counters = [b for b in flips if L.COUNTERS_OFF <= b // 8 < L.CHECKSUM_OFF + 8]  # CRC-covered
        in_map = [b for b in flips if L.PAGE_MAP_OFF <= b // 8 < L.PAGE_MAP_OFF + 64]  # summed: one flip shows
        if len(set(flips)) == len(flips) and (in_counters or len(in_map) == 1):
            assert str(path) in {p.path for p in found.problems}, f"flips at bits {flips} went unnoticed"
    finally:
        path.unlink()


def counter_values():
    """Any value each counter field can hold, as its struct format allows."""
    ranges = {"Q": (0, 2**64 - 1), "q": (-(2**63), 2**63 - 1), "i": (-(2**31), 2**31 - 1)}
    fmt = L.COUNTERS.format.lstrip("<")[:-1]  # all but page_sum, which must match the map
    return st.tuples(*(st.integers(*ranges[c]) for c in fmt))


@settings(max_examples=120, **FUZZ)
@given(counters=counter_values(),
       entries=st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=16, max_size=16),
       closing=st.booleans())
def test_consistent_segments_with_any_values_never_break_a_consumer(good, shm_dir, counters, entries, closing):
    """Random counters and page entries with valid checksums: read as a model, and every consumer copes."""
    def state(w: SegmentWriter) -> None:
        w.begin()
        for page, entry in enumerate(entries):
            w.set_page(page, entry)
        values = list(counters)
        values[L.COUNTER_FIELDS.index("closing")] = int(closing)
        w.publish(tuple(values))

    path = write(shm_dir / "kvc.fuzz", image_of(state))
    try:
        check_directory(shm_dir, [path])
        (fuzz,) = [m for m in kc.list_models(with_pages=True) if m.name == "fuzz"]
        assert fuzz.status == ("stale" if closing else "live")
        assert list(fuzz.pages) == entries
    finally:
        path.unlink()


HEADER_FORMATS = dict(zip(L.HEADER_FIELDS, (code[-1] for code in re.findall(r"\d*[a-zA-Z]", L.HEADER.format)),
                          strict=True))  # field -> struct code, e.g. pages_total -> "Q"


@settings(max_examples=120, **FUZZ)
@given(field=st.sampled_from([f for f, c in HEADER_FORMATS.items() if c != "s"]), data=st.data())
def test_any_header_field_value(good, shm_dir, field, data):
    ranges = {"Q": (0, 2**64 - 1), "q": (-(2**63), 2**63 - 1), "I": (0, 2**32 - 1), "i": (-(2**31), 2**31 - 1)}
    value = data.draw(st.one_of(st.integers(*ranges[HEADER_FORMATS[field]]), st.sampled_from([0, 1, 2, 4096])))
    fields = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(IMAGE), strict=True))
    fields[field] = value
    path = write(shm_dir / "kvc.fuzz", L.HEADER.pack(*fields.values()) + IMAGE[L.HEADER.size:])
    try:
        check_directory(shm_dir, [path])
    finally:
        path.unlink()


def test_foreign_files_of_every_kind(good, shm_dir, tmp_path):
    """Directories, FIFOs, sockets, symlinks (dangling, to /dev/zero, to a real segment) and our lock file."""
    target = write(tmp_path / "elsewhere", IMAGE)
    (shm_dir / "kvc.dir").mkdir()
    os.mkfifo(shm_dir / "kvc.fifo")
    os.mkfifo(shm_dir / "kvcached_vllm_77")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(shm_dir / "kvc.sock"))
    os.symlink(tmp_path / "missing", shm_dir / "kvc.dangling")
    os.symlink("/dev/zero", shm_dir / "kvc.zero")
    os.symlink(target, shm_dir / "kvc.fuzz")
    os.symlink(shm_dir / "kvc.good", shm_dir / "kvc.alias")
    write(shm_dir / "kvc.empty", b"")
    write(shm_dir / "kvc.zeros", bytes(4096))
    write(shm_dir / "kvcached_sglang_12", bytes(23))
    write(shm_dir / "unrelated.txt", b"hello")
    names = ["kvc.dir", "kvc.fifo", "kvcached_vllm_77", "kvc.sock", "kvc.dangling", "kvc.zero", "kvc.fuzz",
             "kvc.alias", "kvc.empty", "kvc.zeros", "kvcached_sglang_12"]
    try:
        check_directory(shm_dir, [shm_dir / n for n in names])
        found = kc.scan()
        assert [m.name for m in found.models] == ["good"]
        reasons = {Path(p.path).name: (p.status, p.reason) for p in found.problems}
        assert sorted(reasons) == sorted(names)
        assert reasons["kvc.dir"] == ("foreign", "not a regular file")
        assert reasons["kvc.fifo"] == ("foreign", "not a regular file")
        assert reasons["kvc.empty"][0] == "corrupt" and "empty header" in reasons["kvc.empty"][1]
        assert reasons["kvcached_sglang_12"][0] == "foreign"
        for link in ("kvc.dangling", "kvc.zero", "kvc.fuzz", "kvc.alias"):
            assert "symbolic link" in reasons[link][1], reasons[link]
        assert target.read_bytes() == IMAGE
    finally:
        sock.close()
        (shm_dir / "kvc.dir").rmdir()


def test_a_hung_lock_on_an_upstream_segment_does_not_hang_a_scan(good, shm_dir):
    import fcntl

    name = f"kvcached_vllm_{os.getpgrp()}"  # a process group that exists: not stale
    path = write(shm_dir / name, struct.pack("<qqq", 8 << 30, 1 << 30, 1 << 20))
    legacy = kc.resolve("kvcached_vllm", kc.list_models())
    holder = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # an upstream engine that hangs while holding its lock
        with bounded(SCAN_BOUND_S):
            found = kc.scan()
        assert [m.name for m in found.models] == ["good"]
        assert [(p.status, Path(p.path).name) for p in found.problems] == [("busy", name)]
        with pytest.raises(kc.ControlError, match="locked by another process"):
            kc.request_limit(legacy, 1 << 30)
    finally:
        os.close(holder)
    assert [m.name for m in kc.list_models()] == ["good", name]


def test_kvctl_and_kvtop_keep_working_beside_damaged_files(good, shm_dir):
    data = bytearray(IMAGE)
    data[L.COUNTERS_OFF + 3] ^= 0x10
    damaged = {"kvc.fuzz": bytes(data), "kvc.short": IMAGE[:700], "kvc.junk": b"\x7fELF" + bytes(2000),
               "kvcached_vllm_9": b"abc"}
    for name, content in damaged.items():
        write(shm_dir / name, content)

    def tool(module: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", module, *args], env=dict(child_env(), COLUMNS="200"),
                              capture_output=True, text=True, timeout=60)

    listed = tool("kvtop.cli", "list", "--all", "--json")
    assert listed.returncode == 0 and [m["name"] for m in json.loads(listed.stdout)] == ["good"]
    warned = {Path(re.match(r"kvctl: warning: (\S+): ", line).group(1)).name for line in listed.stderr.splitlines()}
    assert warned == set(damaged)  # one warning line per damaged file, nothing else
    shown = tool("kvtop.cli", "show", "good", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["blocks_used"] == 5
    refused = tool("kvtop.cli", "show", "fuzz")
    assert refused.returncode == 1 and "checksum mismatch" in refused.stderr and "Traceback" not in refused.stderr
    once = tool("kvtop.app", "--once")
    assert once.returncode == 0 and "Traceback" not in once.stderr
    assert any(line.split()[1:2] == ["good"] for line in once.stdout.splitlines() if line.split())
    cleaned = tool("kvtop.cli", "clean")
    assert cleaned.returncode == 0
    assert all((shm_dir / name).exists() for name in damaged)  # clean never removes what it cannot read
