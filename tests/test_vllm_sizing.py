"""How much KV a vLLM engine plans with under a shared budget (plugins/kvcached_vllm/sizing.py, measure.py),
without vLLM: the device's figures come from the fake CUDA driver's cuMemGetInfo (tests/fake_cuda.py), the peers
are real allocators on that fake device, and the engine's working memory is measured around a real step.

The span must follow the budget and the peers (their weights and registered working memory), never what was free
when the engine started; and it must be what the CUDA backend's growth rule then lets the engine map.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import ROOT
from test_cuda_backend import needs_gpu

import kvcached_core as kc
from kvcached_vllm import measure
from kvcached_vllm.sizing import Device, Plan, Working, plan_for

MiB, GiB = 1 << 20, 1 << 30
LAYERS = 32
BUNDLE = 2 * MiB * LAYERS * 2  # a 2 MiB page in 32 layers, K and V: 128 MiB
BPP = 16  # blocks per page
GEOMETRY = dict(block_bytes=2 * MiB // BPP, num_layers=LAYERS, page_size=2 * MiB, backend="cuda")
OWN = Working(weights=10 * GiB, peak=2 * GiB, now=GiB // 2)  # this engine: 1.5 GiB of its peak not held now


@pytest.fixture
def device(fake_cuda, monkeypatch):
    """An 80 GiB fake device, 5% of it headroom; every growth on demand."""
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", "5%")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_CUDA_ASYNC_UNMAP", "0")
    monkeypatch.delenv("KVCACHED_DEVICE_BUDGET", raising=False)
    return fake_cuda


@pytest.fixture
def peer(device) -> Iterator[kc.KVCacheManager]:
    """Another engine on the device: 8 GiB of KV mapped, a working-memory peak of 3 GiB of which it holds 1."""
    with kc.KVCacheManager("peer", name="peer", num_blocks=256 * BPP, **GEOMETRY) as m:
        assert m.alloc(64 * BPP) is not None
        m.register_working_memory(3 * GiB, now_bytes=GiB)
        yield m


def seen(driver, others: int) -> Device:
    """The device as the engine's worker sees it after its profiling pass: the fake's cuMemGetInfo, with the
    engine's weights and working memory, and ``others`` outside kvcached (the peers' weights...), counted as used."""
    driver.external_bytes = others + OWN.weights + OWN.now
    assert driver.cuInit(0)[0] == 0
    _, dev = driver.cuDeviceGet(0)
    _, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    driver.cuCtxPushCurrent(ctx)
    try:
        err, free, total = driver.cuMemGetInfo()
        assert err == 0
    finally:
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(dev)
    return Device("cuda", 0, total, free)


def documented_line() -> str:
    text = (ROOT / "docs" / "engines.md").read_text()
    start = text.index("`kvcached: KV span") + 1
    return " ".join(text[start:text.index("`", start)].split())


def test_the_span_is_the_budget_whatever_the_peers_kv_left_free(device, peer, monkeypatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", "40GiB")
    found = seen(device, others=15 * GiB)  # the peer's weights and what it holds of its working memory
    assert found.free == 80 * GiB - 15 * GiB - 8 * GiB - OWN.weights - OWN.now  # 46.5 GiB free at this start
    plan = plan_for(found, OWN)
    assert (plan.span, plan.bound, plan.room) == (40 * GiB, "budget", 47 * GiB)
    assert (plan.peers.count, plan.peers.kv_bytes, plan.peers.working_outstanding) == (1, 8 * GiB, 2 * GiB)
    assert plan.others == 15 * GiB
    assert plan.describe() == documented_line()  # the engine's log line, as docs/engines.md shows it
    # the peer's KV is the budget's: more of it changes nothing, though the device has less free
    assert peer.alloc(32 * BPP) is not None
    later = plan_for(seen(device, others=15 * GiB), OWN)
    assert later.device.free == found.free - 4 * GiB and (later.span, later.room) == (40 * GiB, 47 * GiB)


def test_the_span_is_what_the_device_leaves_beside_every_engines_weights_and_working_memory(device, peer) -> None:
    plan = plan_for(seen(device, others=40 * GiB), OWN)  # no budget: the device is the budget
    # 80 total - 4 headroom - 10 weights - 2 working peak - 40 others - 2 of the peer's peak to come
    assert (plan.span, plan.bound, plan.others) == (22 * GiB, "device", 40 * GiB)
    peer.register_working_memory(3 * GiB, now_bytes=3 * GiB)  # the peer reached its peak: torch's cache holds it
    assert plan_for(seen(device, others=42 * GiB), OWN).span == 22 * GiB  # held now: in others, no longer to come
    peer.register_working_memory(7 * GiB, now_bytes=3 * GiB)  # a longer prompt measured: 4 GiB more to come
    assert plan_for(seen(device, others=42 * GiB), OWN).span == 18 * GiB
    assert peer.alloc(32 * BPP) is not None  # its KV grew by 4 GiB: the budget's, the span stays
    assert plan_for(seen(device, others=42 * GiB), OWN).span == 18 * GiB
    assert plan_for(seen(device, others=42 * GiB), Working(10 * GiB, 6 * GiB, GiB // 2)).span == 14 * GiB
    capped = plan_for(seen(device, others=42 * GiB), OWN, cap=8 * GiB)
    assert (capped.span, capped.bound) == (8 * GiB, "explicit size")


def test_a_device_with_no_room_left_plans_nothing(device) -> None:
    plan = plan_for(seen(device, others=66 * GiB), OWN)  # 3.5 GiB free: less than the headroom
    assert plan.room < 0 and plan.span == 0
    assert "KV span 0.00 GiB (device)" in plan.describe()


def test_the_span_is_what_the_growth_rule_lets_the_engine_map(device) -> None:
    """The plan agrees with the CUDA backend: an engine sized by it maps its whole span, and not a page more."""
    found = seen(device, others=60 * GiB)
    plan: Plan = plan_for(found, OWN)
    pages = plan.span // BUNDLE
    assert 0 < pages < 256
    with kc.KVCacheManager("own", name="own", num_blocks=(pages + 4) * BPP, **GEOMETRY) as m:
        m.register_working_memory(OWN.peak, now_bytes=OWN.now)
        taken = 0
        while m.alloc(BPP) is not None:
            taken += 1
        assert taken == pages


def test_the_host_step_measures_the_process_peak_and_what_it_keeps() -> None:
    kept: list[bytearray] = []

    def step() -> int:
        transient = bytearray(256 * MiB)  # touched: zero-filled pages count in RSS once written
        transient[::4096] = b"\1" * (len(transient) // 4096)
        kept.append(bytearray(b"\1" * (32 * MiB)))
        del transient
        return 7

    answer, found, own = measure.host(step)
    assert answer == 7 and found.backend == "host" and 0 < found.free <= found.total
    assert own.peak >= 256 * MiB and 32 * MiB * 0.9 <= own.now < 128 * MiB, own
    assert own.pending >= 128 * MiB


@needs_gpu
@pytest.mark.gpu
def test_the_cuda_step_measures_torchs_peak_and_what_its_cache_keeps() -> None:
    import torch

    torch.cuda.init()
    base = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # stands for the weights

    def step() -> int:
        transient = torch.ones(512 * MiB, dtype=torch.uint8, device="cuda")
        del transient
        return 7

    answer, found, own = measure.cuda(step, torch)
    assert answer == 7 and found.backend == "cuda" and found.total == torch.cuda.mem_get_info()[1]
    assert own.weights >= base.numel() and own.peak >= 512 * MiB
    assert own.now >= 512 * MiB  # torch's cache keeps the freed block: held now, not pending
    torch.cuda.empty_cache()
