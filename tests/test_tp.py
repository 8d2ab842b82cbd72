"""Tensor parallelism on the host backend: a scheduler and 2-4 real worker processes over Unix sockets."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env, configured, freeze, wait_for

from kvcached_core.allocator import fastpath
from kvcached_core.allocator.manager import KVCacheManager
from kvcached_core.backends import BackendError, Geometry
from kvcached_core.control.requests import AckTimeout, request_limit, request_trim
from kvcached_core.segment import layout as L
from kvcached_core.segment.procinfo import is_alive
from kvcached_core.segment.reader import list_models, snapshot
from kvcached_core.tp import RankLost, TPWorker
from kvtop.serve.exporter import KVCachedCollector

KiB, MiB = 1024, 1024 * 1024
# 4 blocks per page, 16 pages; one page id costs 256 KiB x 2 layers x 2 buffers = 1 MiB per rank.
GEOM = dict(num_blocks=64, block_bytes=64 * KiB, num_layers=2, page_size=256 * KiB)
RANK_BUNDLE = 1 * MiB


@pytest.fixture(autouse=True)
def small_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """No background refill: every map in these tests is one the test asked for."""
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "8")


@pytest.fixture
def managers():
    made: list[KVCacheManager] = []

    def make(name: str, world: int, **kwargs) -> KVCacheManager:
        m = KVCacheManager.tensor_parallel(name, world=world, name=name, **{**GEOM, **kwargs})
        made.append(m)
        return m

    yield make
    for m in made:
        for state in m.backend.ranks:  # never leave a stopped worker behind
            if state.pid and is_alive(state.pid, state.start_time):
                os.kill(state.pid, signal.SIGCONT)
        m.close()


def mapped_pages(m: KVCacheManager) -> list[int]:
    return [p for p in range(m.pages.pages_total) if m.pages.mapped[p]]


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * KiB
    raise AssertionError(f"no RssAnon for pid {pid}")



@pytest.mark.parametrize(("world", "strategy"), [(2, "sequential"), (2, "concurrent"), (4, "concurrent")])
def test_map_and_unmap_reach_every_rank(managers, world: int, strategy: str) -> None:
    m = managers("tp-map", world, strategy=strategy)
    assert m.bundle_bytes == RANK_BUNDLE * world
    pids = [s.pid for s in m.backend.ranks]
    assert len(set(pids)) == world and os.getpid() not in pids
    before = [rss_anon(pid) for pid in pids]

    ids = m.alloc(10)  # 3 pages
    assert ids is not None
    pages = mapped_pages(m)
    assert len(pages) == 3
    assert m.backend.rank_pages() == [pages] * world  # every rank holds exactly the scheduler's pages
    for pid, rss in zip(pids, before, strict=True):  # real memory, committed in each worker
        assert rss_anon(pid) - rss >= 3 * RANK_BUNDLE - 256 * KiB

    snap = list_models()[0]  # ranks are read without the page map too
    assert snap.tp_world == world and snap.backend == "host"
    assert [r.rank for r in snap.ranks] == list(range(world))
    assert [r.pid for r in snap.ranks] == pids and all(r.alive for r in snap.ranks)
    assert all(r.mapped_bytes == 3 * RANK_BUNDLE for r in snap.ranks)
    assert snap.mapped_bytes == sum(r.mapped_bytes for r in snap.ranks) == 3 * m.bundle_bytes
    assert snap.held_bytes == 10 * 64 * KiB * 2 * 2 * world
    assert snap.pinned_bytes == 3 * m.bundle_bytes
    as_json = snap.to_dict()
    assert as_json["tp_world"] == world and len(as_json["ranks"]) == world
    scraped = {metric.name: metric for metric in KVCachedCollector(host="h", with_nvml=False).collect()}
    per_rank = {s.labels["rank"]: (s.labels["pid"], s.value) for s in scraped["kvcached_rank_mapped_bytes"].samples}
    assert per_rank == {str(r): (str(pid), 3 * RANK_BUNDLE) for r, pid in enumerate(pids)}
    assert [s.value for s in scraped["kvcached_rank_up"].samples] == [1] * world

    m.free(ids)
    m.trim()
    assert m.backend.rank_pages() == [[]] * world
    wait_for(lambda: all(r.mapped_bytes == 0 for r in snapshot(m.name).ranks), what="ranks to report 0 bytes")
    for pid, rss in zip(pids, before, strict=True):
        assert rss_anon(pid) - rss < 2 * RANK_BUNDLE


def _published(m: KVCacheManager) -> bytes:
    """The segment bytes a publish writes, with what differs between two allocators of one script masked:
    the clock, the checksum it feeds, and each rank's pid and start time."""
    buf = bytearray(m.segment._buf)
    for name in ("updated_ns",):
        off = L.COUNTERS_OFF + struct.calcsize("<" + L.COUNTERS.format.lstrip("<")[:L.COUNTER_FIELDS.index(name)])
        buf[off:off + 8] = bytes(8)
    buf[L.CHECKSUM_OFF:L.CHECKSUM_OFF + 8] = bytes(8)
    rank_fmt = L.RANK.format.lstrip("<")
    pid_off = struct.calcsize("<" + rank_fmt[:L.RANK_FIELDS.index("pid")])
    for index in range(m.tp_world):
        off = L.ranks_offset(m.pages.pages_total) + index * L.RANK.size + pid_off
        buf[off:off + 16] = bytes(16)  # pid and start_time
    end = L.ranks_offset(m.pages.pages_total) + L.RANK.size * m.tp_world
    return bytes(buf[L.SEQ_OFF:end])  # the seqlock count, counters, COMPACT, TRAFFIC, page map, ranks


@pytest.mark.skipif(fastpath.load()[0] is None, reason="the C alloc path is not built here")
def test_the_c_path_serves_tensor_parallelism_with_the_bytes_python_writes(
        managers, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    made = []
    for mode in ("1", "0"):
        monkeypatch.setenv("KVCACHED_FASTPATH", mode)
        made.append(managers(f"tp-fp{mode}", 2))
    fast, slow = made
    assert fast._fast is not None and slow._fast is None, fast.fastpath_reason
    assert fast.alloc == fast._fast.manager_alloc  # the C entry, lock and all

    def both(step):
        got = [step(m) for m in (fast, slow)]
        assert got[0] == got[1]
        assert _published(fast) == _published(slow)
        return got[0]

    first = both(lambda m: m.alloc(10))  # maps 3 pages on both ranks: the records' mapped bytes change
    assert snapshot(fast.name).ranks[1].mapped_bytes == 3 * RANK_BUNDLE
    second = both(lambda m: m.alloc(3, near=first[-1]))
    both(lambda m: m.free(first[:4]))
    both(lambda m: m.mark_cached(second[:2]))
    both(lambda m: m.alloc(9))
    both(lambda m: m.free(second))
    both(lambda m: m.trim())  # unmaps on every rank: a full publish
    snap = snapshot(fast.name)
    assert snap.tp_world == 2 and [r.rank for r in snap.ranks] == [0, 1]
    assert snap.mapped_bytes == sum(r.mapped_bytes for r in snap.ranks) == snapshot(slow.name).mapped_bytes


def test_a_rank_that_refuses_makes_the_page_a_miss_on_every_rank(managers) -> None:
    m = managers("tp-full", 3, worker_capacity=[None, 2 * RANK_BUNDLE, None])
    first = m.alloc(8)  # 2 pages: rank 1 is now full
    assert first is not None and mapped_pages(m) == [0, 1]
    assert m.alloc(4) is None  # rank 1 says no, so no rank keeps page 2
    assert m.try_to_reserve(16) is False
    assert m.backend.rank_pages() == [[0, 1]] * 3
    assert m.backend.ledger.claimed == 2 * m.bundle_bytes  # the host share was given back too
    snap = snapshot(m.name)
    assert snap.mapped_bytes == 2 * m.bundle_bytes
    assert [r.mapped_bytes for r in snap.ranks] == [2 * RANK_BUNDLE] * 3
    m.free(first[:4])  # page 0 empties and stays in the pool: still no room for another page
    again = m.alloc(4)
    assert again is not None and {b // 4 for b in again} == {0}
    assert m.backend.rank_pages() == [[0, 1]] * 3


def test_limit_counts_every_rank(managers) -> None:
    m = managers("tp-limit", 2)
    assert m.set_limit(3 * m.bundle_bytes + 5) == "applied"  # rounded down to whole model bundles
    assert m.try_to_reserve(64) is False
    assert len(mapped_pages(m)) == 3
    snap = snapshot(m.name)
    assert snap.limit_bytes == 3 * m.bundle_bytes == 3 * 2 * RANK_BUNDLE
    assert snap.mapped_bytes == snap.limit_bytes
    assert [r.mapped_bytes for r in snap.ranks] == [3 * RANK_BUNDLE] * 2


def test_trim_is_acknowledged_only_after_every_rank_trimmed(managers) -> None:
    m = managers("tp-trim", 2, timeout=30)
    assert m.try_to_reserve(16)  # 4 reserved pages on both ranks
    pids = [s.pid for s in m.backend.ranks]
    full = [rss_anon(pid) for pid in pids]
    freeze(pids[1])
    try:
        pending = request_trim(m.name, wait=0)
        # Rank 0 gives its memory back at once ...
        wait_for(lambda: rss_anon(pids[0]) < full[0] - 3 * RANK_BUNDLE, what="rank 0 to unmap")
        # ... but the model does not acknowledge while rank 1 has not.
        with pytest.raises(AckTimeout):
            request_trim(m.name, wait=0.3)
        snap = snapshot(m.name)
        assert snap.trim_ack_seq < pending.revision and snap.mapped_bytes == 4 * m.bundle_bytes
    finally:
        os.kill(pids[1], signal.SIGCONT)
    done = wait_for(lambda: (s := snapshot(m.name)).trim_ack_seq >= pending.revision + 1 and s, what="trim ack")
    assert done.mapped_bytes == 0 and all(r.mapped_bytes == 0 for r in done.ranks)
    assert m.backend.rank_pages() == [[], []]


def test_limit_is_acknowledged_only_after_every_rank_unmapped(managers) -> None:
    m = managers("tp-lim-ack", 2, timeout=30)
    assert m.try_to_reserve(16)
    pid0 = m.backend.ranks[0].pid
    freeze(pid0)
    try:
        with pytest.raises(AckTimeout):
            request_limit(m.name, m.bundle_bytes, wait=0.3)
        assert snapshot(m.name).applied_revision == 0
    finally:
        os.kill(pid0, signal.SIGCONT)
    ack = wait_for(lambda: (s := snapshot(m.name)).applied_revision >= 1 and s, what="limit ack")
    assert ack.limit_status == "applied" and ack.limit_bytes == m.bundle_bytes
    assert [r.mapped_bytes for r in ack.ranks] == [RANK_BUNDLE] * 2
    assert m.backend.rank_pages() == [[mapped_pages(m)[0]]] * 2


def test_a_killed_worker_is_reported_not_waited_for(managers) -> None:
    m = managers("tp-kill", 2, timeout=2)
    ids = m.alloc(4)
    assert ids is not None
    victim = m.backend.workers.processes[1]
    victim.kill()
    victim.wait()
    ranks = snapshot(m.name).ranks
    assert [r.alive for r in ranks] == [True, False]
    started = time.monotonic()
    with pytest.raises(RankLost, match="rank 1"):
        m.alloc(8)  # needs a map: the scheduler finds rank 1 gone instead of hanging
    assert time.monotonic() - started < 10
    assert any("rank 1" in e for e in m.backend.errors)
    assert m.pages.inflight == 0 and mapped_pages(m) == [0]  # nothing left half mapped
    with pytest.raises(RankLost):
        m.try_to_reserve(8)
    snap = snapshot(m.name)
    assert [r.alive for r in snap.ranks] == [True, False]
    assert snap.ranks[1].mapped_bytes == 0
    m.free(ids)  # page 0 goes back to the pool ...
    assert m.backend.rank_pages() == [[0], None]
    assert m.trim() == m.bundle_bytes  # ... and unmaps still reach the surviving rank
    assert m.backend.rank_pages() == [[], None]


def test_a_hung_worker_times_out_and_lets_go_of_its_memory(managers) -> None:
    m = managers("tp-hang", 2, timeout=3)  # the healthy rank answers within it even on a loaded host
    assert m.alloc(4) is not None
    worker = m.backend.workers.processes[1]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RankLost, match="did not answer map within 3 s"):
            m.alloc(8)
        snap = snapshot(m.name)
        assert [r.alive for r in snap.ranks] == [True, False]  # alive process, but lost to the model
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    worker.wait(timeout=10)  # disconnected: it released everything and exited
    assert m.backend.rank_pages()[0] == [0]


def test_embedded_workers_expose_their_buffers(tmp_path: Path) -> None:
    geometry = Geometry(256 * KiB, 16, 2, 2)
    paths = [str(tmp_path / f"r{r}.sock") for r in range(2)]
    workers = [TPWorker(path, r, 0, "host", geometry) for r, path in enumerate(paths)]
    for w in workers:
        w.start()
    m = KVCacheManager("tp-embed", name="tp-embed", tp_workers=paths, **GEOM)
    try:
        assert m.tp_world == 2 and all(w.attached.is_set() for w in workers)
        block = m.alloc(1)[0]
        offset = block * GEOM["block_bytes"]
        for r, w in enumerate(workers):  # each rank writes its own shard of the block's K in layer 1
            w.buffer(1, 0)[offset:offset + 4] = bytes([r + 1]) * 4
        assert [bytes(w.buffer(1, 0)[offset:offset + 4]) for w in workers] == [b"\x01" * 4, b"\x02" * 4]
        with pytest.raises(RuntimeError, match="rank workers"):
            m.buffer(0, 0)
    finally:
        m.close()
    for w in workers:
        assert w.finished.wait(5) and not w.mapped


@pytest.mark.parametrize("known", ["at start", "from the scheduler"])
def test_a_pinned_page_is_mapped_before_any_scheduler_and_outlives_its_unmaps(tmp_path: Path, known: str) -> None:
    """vLLM's warm-up reads block 0 before the scheduler exists: its worker pins page 0. Mapped from the start
    (or once the scheduler's HELLO gives the geometry), a scheduler's map of it is a no-op and its unmaps and
    trims leave it; the worker's close releases it (on the old code a worker maps nothing by itself)."""
    geometry = Geometry(256 * KiB, 16, 2, 2)
    path = str(tmp_path / "r0.sock")
    worker = TPWorker(path, 0, 0, "host", geometry if known == "at start" else None, pinned=(0,))
    assert worker.mapped == ({0} if known == "at start" else set())
    worker.start()
    no_pool = configured({"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0"})
    m = KVCacheManager("tp-pin", name="tp-pin", tp_workers=[path], settings=no_pool, **GEOM)
    try:
        assert worker.mapped == {0}  # before any block is handed out
        ids = m.alloc(4)
        assert ids is not None and {b // m.blocks_per_page for b in ids} == {0} and worker.mapped == {0}
        worker.buffer(1, 0)[:4] = b"kept"
        m.free(ids)
        m.trim()
        assert m.pages.mapped_pages == 0 and worker.mapped == {0}  # the scheduler unmapped it; the worker kept it
        assert bytes(worker.buffer(1, 0)[:4]) == b"kept"
    finally:
        m.close()
    assert worker.finished.wait(5) and not worker.mapped  # the end of the worker's life releases it


def test_closing_an_embedded_worker_hangs_up_on_its_scheduler(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"r{r}.sock") for r in range(2)]
    workers = [TPWorker(path, r) for r, path in enumerate(paths)]  # geometry from the scheduler
    for w in workers:
        w.start()
    m = KVCacheManager("tp-hangup", name="tp-hangup", tp_workers=paths, tp_timeout=5, **GEOM)
    try:
        assert m.alloc(4) is not None and workers[1].mapped == {0}
        workers[1].close()  # the engine's rank 1 shuts down
        assert workers[1].finished.is_set() and not workers[1].mapped
        with pytest.raises(RankLost, match="rank 1"):
            m.alloc(8)
        assert [r.alive for r in snapshot(m.name).ranks] == [True, False]
    finally:
        m.close()
    assert workers[0].finished.wait(5) and not workers[0].mapped


def test_a_worker_with_another_geometry_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "r0.sock")
    worker = TPWorker(path, 0, 0, "host", Geometry(256 * KiB, 8, 2, 2))
    worker.start()
    with pytest.raises(BackendError, match="rank 0 .* refused: rank 0 holds"):
        KVCacheManager("tp-bad", name="tp-bad", tp_workers=[path], **GEOM)
    assert worker.finished.wait(5)
    assert list_models() == []  # no segment left behind


def test_tp_world_without_workers_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="tp_world=2 needs one worker socket per rank"):
        KVCacheManager("tp-none", tp_world=2, **GEOM)


def test_worker_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvcached_core.tp.worker", "--socket", str(tmp_path / "s"), "--rank", "0"]
    for extra in (["--page-size", "4096"], ["--capacity", "12xx"]):
        out = subprocess.run(cmd + extra, capture_output=True, text=True, env=child_env(), timeout=60)
        assert out.returncode == 2
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("error:") and "Traceback" not in out.stderr
        assert not (tmp_path / "s").exists()


def test_kvctl_and_kvtop_group_the_ranks_under_one_model(managers) -> None:
    import dataclasses
    import json

    from click.testing import CliRunner

    from kvcached_core.backends.nvml import GpuInfo
    from kvtop.cli import main as kvctl
    from kvtop.frames.source import Frame
    from kvtop.screen.view import device_bars, model_cells

    m = managers("tp-cli", 2)
    assert m.alloc(8) is not None  # 2 pages
    runner = CliRunner()
    listed = json.loads(runner.invoke(kvctl, ["list", "--json"]).stdout)
    assert len(listed) == 1  # one model, not one row per rank
    row = listed[0]
    assert row["tp_world"] == 2 and [r["rank"] for r in row["ranks"]] == [0, 1]
    assert row["mapped_bytes"] == sum(r["mapped_bytes"] for r in row["ranks"]) == 2 * m.bundle_bytes
    assert " 0 tp2 " in runner.invoke(kvctl, ["list"]).stdout
    shown = runner.invoke(kvctl, ["show", "tp-cli"]).stdout
    assert "x 2 ranks" in shown and "tp2" in shown
    for r in m.backend.ranks:
        assert f"rank {r.rank}" in shown and f"pid {r.pid}" in shown

    # kvtop: "0,1 tp2" in the device column; each GPU's bar holds its rank's half of the model.
    snap = snapshot(m.name)
    gpu_snap = dataclasses.replace(snap, backend="cuda", ranks=tuple(
        dataclasses.replace(r, device=r.rank) for r in snap.ranks))
    assert model_cells(gpu_snap)["device"].plain == "0,1 tp2"
    gpus = tuple(GpuInfo(i, "H200", None, 100 * MiB, 0, 100 * MiB) for i in range(2))
    frame = Frame((gpu_snap,), (), gpus, "", 0, None, 0.0, "host")
    for bar in device_bars(frame):
        assert [(p.label, p.nbytes) for p in bar.parts] == [("tp-cli", m.bundle_bytes)]  # 2 pages in use / 2


def _gpu_count() -> int:
    from kvcached_core.backends import nvml

    return len(nvml.probe()) if nvml.available() else 0


GPUS = _gpu_count()
CUDA_GEOM = dict(num_blocks=64, block_bytes=512 * KiB, num_layers=2, page_size=2 * MiB)  # 8 MiB per rank


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 NVIDIA GPUs, found {GPUS}")
def test_cuda_ranks_map_on_their_own_gpus(managers) -> None:
    m = managers("tp-cuda", 2, backend="cuda", **CUDA_GEOM)
    ids = m.alloc(10)  # 3 pages
    assert ids is not None
    assert m.backend.rank_pages() == [mapped_pages(m)] * 2 and len(mapped_pages(m)) == 3
    snap = snapshot(m.name)
    assert snap.backend == "cuda" and snap.devices == (0, 1) and snap.tp_world == 2
    assert [r.mapped_bytes for r in snap.ranks] == [3 * 8 * MiB] * 2
    assert snap.mapped_bytes == 3 * 16 * MiB
    m.free(ids)
    m.trim()
    assert m.backend.rank_pages() == [[], []]


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 NVIDIA GPUs, found {GPUS}")
def test_cuda_embedded_workers_write_their_own_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    geometry = Geometry(2 * MiB, 16, 2, 2)
    paths = [str(tmp_path / f"g{r}.sock") for r in range(2)]
    workers = [TPWorker(path, r, r, "cuda", geometry) for r, path in enumerate(paths)]
    for w in workers:
        w.start()
    m = KVCacheManager("tp-cuda-embed", name="tp-cuda-embed", backend="cuda", tp_workers=paths, **CUDA_GEOM)
    try:
        block = m.alloc(1)[0]
        page, slot = divmod(block, m.blocks_per_page)
        for r, w in enumerate(workers):
            view = w.buffer(1, 1)
            assert view.device.index == r
            view[page, slot * m.block_bytes:slot * m.block_bytes + 8] = r + 1
        for r, w in enumerate(workers):
            torch.cuda.synchronize(r)
            cell = w.buffer(1, 1)[page, slot * m.block_bytes:slot * m.block_bytes + 8]
            assert torch.all(cell == r + 1)
        del view, cell  # views keep the mapping's memory referenced
    finally:
        m.close()
    for w in workers:
        assert w.finished.wait(10) and not w.mapped
