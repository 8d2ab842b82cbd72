"""On a real GPU: KV growth stops at the headroom and at another engine's working memory, as a miss, while the rest
of the device is taken by memory outside kvcached (cuMemAlloc here, as weights and torch's cache would be).
Skipped without an NVIDIA GPU; the same rule runs on CPU against the fake driver (tests/test_device_headroom.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_cuda_backend import needs_gpu
from test_device_headroom import grow_until_refused

import kvcached_core as kc

MiB, GiB = 1 << 20, 1 << 30
BUNDLE = 16 * MiB  # 2 MiB pages x 4 layers x K and V
BPP = 8
HEADROOM = GiB
SLACK = 16 * MiB  # what the driver itself takes for the mappings (page tables), which the rule does not count


class Hog:
    """Device memory held outside kvcached, through the driver in the device's primary context."""

    def __init__(self) -> None:
        from cuda.bindings import driver as d

        self.d = d
        self.ok = d.CUresult.CUDA_SUCCESS
        assert d.cuInit(0)[0] == self.ok
        self.dev = d.cuDeviceGet(0)[1]
        self.ctx = d.cuDevicePrimaryCtxRetain(self.dev)[1]
        assert d.cuCtxPushCurrent(self.ctx)[0] == self.ok
        self.held: list[Any] = []

    def free_bytes(self) -> int:
        err, free, _total = self.d.cuMemGetInfo()
        assert err == self.ok
        return int(free)

    def leave(self, nbytes: int) -> None:
        """Allocate until the device has ``nbytes`` free (in 1 GiB pieces, then the rest)."""
        while (short := self.free_bytes() - nbytes) > 0:
            err, ptr = self.d.cuMemAlloc(min(short, GiB))
            assert err == self.ok, f"cuMemAlloc: {err}"
            self.held.append(ptr)

    def release(self) -> None:
        for ptr in self.held:
            self.d.cuMemFree(ptr)
        self.held.clear()
        self.d.cuCtxPopCurrent()
        self.d.cuDevicePrimaryCtxRelease(self.dev)


@pytest.fixture
def hog(shm_dir, monkeypatch) -> Iterator[Hog]:
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", f"{HEADROOM // MiB}MiB")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_CUDA_ASYNC_UNMAP", "0")
    monkeypatch.delenv("KVCACHED_DEVICE_BUDGET", raising=False)
    held = Hog()
    try:
        yield held
    finally:
        held.release()


def manager(name: str) -> kc.KVCacheManager:
    return kc.KVCacheManager(name, name=name, num_blocks=256 * BPP, block_bytes=(2 * MiB) // BPP, num_layers=4,
                             page_size=2 * MiB, backend="cuda")


@pytest.mark.gpu
@needs_gpu
def test_a_real_device_keeps_its_headroom(hog) -> None:
    with manager("gpu-headroom") as m:
        hog.leave(HEADROOM + 6 * BUNDLE + MiB)
        assert grow_until_refused(m) in (5, 6)  # 6, or 5 where the driver keeps a little for itself
        assert hog.free_bytes() >= HEADROOM - SLACK
        assert m.pressure.wanted > 0  # a budget miss, not an error


@pytest.mark.gpu
@needs_gpu
def test_a_real_device_keeps_another_engines_working_memory(hog) -> None:
    with manager("gpu-a") as a, manager("gpu-b") as b:
        hog.leave(HEADROOM + 12 * BUNDLE + MiB)
        a.register_working_memory(6 * BUNDLE)
        assert grow_until_refused(b) in (5, 6)
        assert hog.free_bytes() >= HEADROOM + 6 * BUNDLE - SLACK
