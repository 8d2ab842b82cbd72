"""The CUDA backend keeps the device's headroom and the engines' working memory free (KVCACHED_DEVICE_HEADROOM,
KVCacheManager.register_working_memory): a growth that would take them is a budget miss, never an exception, with
or without KVCACHED_DEVICE_BUDGET. On CPU, against the fake driver (tests/fake_cuda.py), whose cuMemGetInfo counts
``external_bytes`` (weights, torch, other processes) as used."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
from conftest import child_env
from segment_holder import hold_segment

import kvcached_core as kc
from kvcached_core.backends import cuda as cuda_backend

MiB, GiB = 1 << 20, 1 << 30
BUNDLE = 8 * MiB  # 2 MiB pages x 2 layers x K and V
BPP = 32  # blocks per page
GEOMETRY = dict(num_blocks=64 * BPP, block_bytes=(2 * MiB) // BPP, num_layers=2, page_size=2 * MiB, backend="cuda")


@pytest.fixture
def device(fake_cuda, shm_dir, monkeypatch):
    """A 1 GiB fake device of which 64 MiB is headroom, every growth on demand (no warm pool refilled behind
    the test's back), warnings said afresh."""
    fake_cuda.total_bytes = GiB
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", "64MiB")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_CUDA_ASYNC_UNMAP", "0")
    monkeypatch.delenv("KVCACHED_DEVICE_BUDGET", raising=False)
    monkeypatch.setattr(cuda_backend, "_warned", set(), raising=False)
    return fake_cuda


def grow_until_refused(m: kc.KVCacheManager) -> int:
    """Allocate a page's blocks at a time until alloc answers None; the pages it took (tests/test_device_headroom_gpu.py
    grows a real device's allocators with it too)."""
    pages = 0
    while m.alloc(m.blocks_per_page) is not None:
        pages += 1
        assert pages * m.blocks_per_page <= m.num_blocks, "never refused"
    return pages


@pytest.mark.parametrize("budget", [None, "512MiB"])
def test_a_growth_that_would_take_the_headroom_is_a_miss(device, monkeypatch, budget) -> None:
    if budget:
        monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", budget)  # room under the budget: the device says no first
    device.external_bytes = GiB - 64 * MiB - 3 * BUNDLE - MiB  # weights and the like: 3 bundles and a bit beside
    with kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
        assert m.available_size() == 3 * BPP
        assert grow_until_refused(m) == 3
        assert device.free_bytes() >= 64 * MiB  # the headroom is never taken
        assert not [r for r in device.refused if r.call == "cuMemCreate"]  # refused before the driver ran out
        assert m.pressure.wanted > 0  # a budget miss: the model asks the others for the memory (pressure.py)
        device.external_bytes -= BUNDLE  # torch gave a page's worth back: the next growth takes it
        assert m.alloc(BPP) is not None
        assert m.alloc(BPP) is None


def test_headroom_off_still_keeps_the_working_memory_free(device, monkeypatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", "0")
    device.external_bytes = GiB - 10 * BUNDLE - MiB
    with kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
        m.register_working_memory(7 * BUNDLE)
        assert grow_until_refused(m) == 3
        m.register_working_memory(0)
        assert grow_until_refused(m) == 7  # up to the device's last whole bundle
        assert device.free_bytes() == MiB


def test_another_engines_outstanding_working_memory_is_kept_free(device) -> None:
    device.external_bytes = GiB - 64 * MiB - 10 * BUNDLE  # 10 bundles of room beside the headroom
    with kc.KVCacheManager("engine-a", name="engine-a", **GEOMETRY) as a, \
            kc.KVCacheManager("engine-b", name="engine-b", **GEOMETRY) as b:
        a.register_working_memory(6 * BUNDLE, now_bytes=2 * BUNDLE)  # 4 bundles not reached yet
        assert grow_until_refused(b) == 6
        assert b.available_size() == 0
        a.register_working_memory(6 * BUNDLE, now_bytes=6 * BUNDLE)  # reached: torch's cache holds it now
        device.external_bytes += 4 * BUNDLE  # ... in the device's used memory
        assert b.alloc(BPP) is None  # nothing more to take: it was held back for a, and a holds it
        a.register_working_memory(6 * BUNDLE)  # now unknown (0): the whole peak is kept free again
        device.external_bytes -= 4 * BUNDLE
        b.free([blk for p in range(6) for blk in range(p * BPP, (p + 1) * BPP)])  # pages go back
        assert grow_until_refused(b) == 4  # 10 bundles of room less a's 6


def test_an_engines_own_working_memory_is_kept_free(device) -> None:
    device.external_bytes = GiB - 64 * MiB - 10 * BUNDLE
    with kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
        m.register_working_memory(7 * BUNDLE)
        assert grow_until_refused(m) == 3


def _engine_elsewhere(peak: int, now: int) -> subprocess.Popen:
    """Another process's engine on device 0 with its working memory registered, alive until its stdin closes."""
    return hold_segment("elsewhere", f"set_working({peak}, {now})")


def test_a_live_process_working_memory_holds_back_growth_and_its_exit_releases_it(device) -> None:
    device.external_bytes = GiB - 64 * MiB - 10 * BUNDLE
    other = _engine_elsewhere(5 * BUNDLE, BUNDLE)  # 4 bundles outstanding, in another process
    try:
        with kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
            assert grow_until_refused(m) == 6
            assert other.stdin is not None
            other.stdin.close()
            assert other.wait(30) == 0  # gone: what it registered no longer counts
            assert grow_until_refused(m) == 4
    finally:
        other.kill()
        other.wait()


def test_a_budget_the_device_cannot_give_is_one_warning_line(device, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcached_core.backends.cuda"):
        monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", "960MiB")  # 1 GiB less 64 MiB of headroom: nothing to say
        kc.KVCacheManager("m0", name="m0", **GEOMETRY).close()
        monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", "990MiB")
        with kc.KVCacheManager("m1", name="m1", **GEOMETRY), kc.KVCacheManager("m2", name="m2", **GEOMETRY):
            pass
    said = [r.getMessage() for r in caplog.records if r.name == "kvcached_core.backends.cuda"]
    assert said == ["kvcached: the KV budget of device 0 (990.0 MiB, KVCACHED_DEVICE_BUDGET) is more than the device "
                    "can give (1.0 GiB total - 64.0 MiB headroom = 960.0 MiB): growth stops where the device's free "
                    "memory less the headroom and the engines' working memory ends"]


def test_the_warning_is_one_line_on_stderr_without_logging_set_up(fake_cuda, shm_dir) -> None:
    code = textwrap.dedent("""
        import fake_cuda
        from kvcached_core.backends import cuda
        driver = fake_cuda.FakeDriver(total_bytes=1 << 30)
        cuda._load_driver = lambda: driver
        import kvcached_core as kc
        for name in ("m1", "m2"):
            kc.KVCacheManager(name, name=name, num_blocks=64, block_bytes=1 << 16, num_layers=2,
                              page_size=2 << 20, backend="cuda").close()
    """)
    env = child_env({"KVCACHED_DEVICE_BUDGET": "2GiB", "KVCACHED_DEVICE_HEADROOM": "5%", "KVCACHED_CUDA_NATIVE": "0",
                     "KVCACHED_FASTPATH": "0"})
    env["PYTHONPATH"] += f"{':'}{sys.path[0]}"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "kvcached: the KV budget of device 0 (2.0 GiB, KVCACHED_DEVICE_BUDGET) is more than the device can give "
        "(1.0 GiB total - 51.2 MiB headroom = 972.8 MiB): growth stops where the device's free memory less the "
        "headroom and the engines' working memory ends"]


def test_a_headroom_of_all_the_device_says_so(device, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", "2GiB")
    with caplog.at_level(logging.WARNING, logger="kvcached_core.backends.cuda"), \
            kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
        assert m.alloc(1) is None
    assert [r.getMessage() for r in caplog.records if r.name == "kvcached_core.backends.cuda"] == [
        "kvcached: the headroom of device 0 (2.0 GiB, KVCACHED_DEVICE_HEADROOM) is all of its 1.0 GiB: no KV page "
        "can be mapped there"]


def test_readers_see_the_headroom_and_the_working_memory(device) -> None:
    with kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
        m.register_working_memory(3 * GiB // 4, now_bytes=GiB // 4)
        seen = kc.snapshot("m").to_dict()
        assert (seen["device_headroom"], seen["working_peak_bytes"], seen["working_now_bytes"]) == (
            64 * MiB, 3 * GiB // 4, GiB // 4)
        assert kc.snapshot("m").working_outstanding == GiB // 2


def test_a_working_word_no_allocator_writes_reads_as_none(device, shm_dir) -> None:
    from kvcached_core.segment import layout as L

    with kc.KVCacheManager("m", name="m", **GEOMETRY) as m:
        m.segment.set_working(1 << 63, 5)  # past what register_working_memory takes: forged or damaged
        snap = kc.snapshot("m")
        assert (snap.working_peak, snap.working_now) == (0, 5)
        assert L.U64.unpack_from((shm_dir / "kvc.m").read_bytes(), L.WORKING_PEAK_OFF)[0] == 1 << 63
        assert m.alloc(BPP) is not None  # and no growth is held back for it
