"""The CUDA backend held to the driver's rules on CPU, through the fake driver (``tests/fake_cuda.py``).

First the fake's own rules (each refusal the driver API documents), then the backend on it: every page size
a real model gives (14, 28, 48 MiB are no power of two), both layouts, deferred and immediate unmaps, the
handle pool, running out of memory, and a whole allocator. ``tests/test_cuda_backend.py`` runs the same
probes on a real GPU and compares.
"""

from __future__ import annotations

import pytest
from fake_cuda import PROBES_REFUSED, CUresult, FakeDriver, GiB, MiB, run_probes

from kvcached_core import KVCacheManager
from kvcached_core.backends import Geometry
from kvcached_core.backends.cuda import RESERVE_ALIGNMENT_CAP, CudaBackend, reserve_alignment

INVALID = CUresult.CUDA_ERROR_INVALID_VALUE


def ready(total: int = 80 * GiB) -> tuple[FakeDriver, object, object, object]:
    """An initialised fake with device 0's context current, its allocation properties and access descriptor."""
    d = FakeDriver(total_bytes=total)
    assert d.cuInit(0) == (CUresult.CUDA_SUCCESS,)
    ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
    d.cuCtxPushCurrent(ctx)
    prop = d.CUmemAllocationProp()
    prop.location.id = 0
    access = d.CUmemAccessDesc()
    access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d, ctx, prop, access


# -- the fake's rules -----------------------------------------------------------------------------
def test_the_probes_are_refused_exactly_where_the_driver_documents_it() -> None:
    d = FakeDriver()
    got = run_probes(d)
    assert {name for name, code in got.items() if code} == PROBES_REFUSED
    assert got["create past the device's memory"] == CUresult.CUDA_ERROR_OUT_OF_MEMORY
    assert all(code in (0, INVALID) for name, code in got.items() if name != "create past the device's memory")
    assert len(d.refused) == len(PROBES_REFUSED)
    assert (d.live_handles, d.allocated_bytes, d.mapped_bytes, d.reserved_bytes, d.retained_contexts) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("page_mib", [6, 14, 28, 48, 84])
def test_a_page_size_that_is_no_power_of_two_is_refused_as_an_alignment(page_mib: int) -> None:
    d, *_ = ready()
    assert d.cuMemAddressReserve(16 * page_mib * MiB, page_mib * MiB, 0, 0) == (INVALID,)
    (refusal,) = d.refused
    assert refusal.call == "cuMemAddressReserve" and "power of two" in refusal.why
    ok, va = d.cuMemAddressReserve(16 * page_mib * MiB, reserve_alignment(page_mib * MiB, 2 * MiB), 0, 0)
    assert ok == CUresult.CUDA_SUCCESS and int(va) % reserve_alignment(page_mib * MiB, 2 * MiB) == 0


def test_free_memory_is_total_less_live_allocations_and_external_bytes() -> None:
    d, _ctx, prop, _access = ready(total=64 * MiB)
    assert d.cuMemGetInfo() == (CUresult.CUDA_SUCCESS, 64 * MiB, 64 * MiB)
    d.external_bytes = 20 * MiB
    _, handle = d.cuMemCreate(32 * MiB, prop, 0)
    assert d.cuMemGetInfo()[1] == 12 * MiB
    assert d.cuMemCreate(14 * MiB, prop, 0) == (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
    assert d.cuMemCreate(12 * MiB, prop, 0)[0] == CUresult.CUDA_SUCCESS
    assert d.live_handles == 2 and d.cuMemGetInfo()[1] == 0
    assert d.cuMemRelease(handle) == (CUresult.CUDA_SUCCESS,)
    assert d.cuMemRelease(handle) == (CUresult.CUDA_ERROR_INVALID_HANDLE,)  # released twice
    assert d.cuMemGetInfo()[1] == 32 * MiB


def test_a_released_handle_keeps_its_memory_until_its_mapping_goes() -> None:
    d, _ctx, prop, _access = ready(total=64 * MiB)
    _, va = d.cuMemAddressReserve(8 * MiB, 0, 0, 0)
    _, handle = d.cuMemCreate(4 * MiB, prop, 0)
    assert d.cuMemMap(va, 4 * MiB, 0, handle, 0) == (CUresult.CUDA_SUCCESS,)
    assert d.cuMemRelease(handle) == (CUresult.CUDA_SUCCESS,)
    assert d.live_handles == 0 and d.allocated_bytes == 4 * MiB and d.cuMemGetInfo()[1] == 60 * MiB
    assert d.cuMemMap(int(va) + 4 * MiB, 4 * MiB, 0, handle, 0) == (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    assert d.cuMemUnmap(va, 4 * MiB) == (CUresult.CUDA_SUCCESS,)
    assert d.allocated_bytes == 0 and d.cuMemGetInfo()[1] == 64 * MiB


def test_memory_is_usable_only_once_access_is_set_on_its_mapping() -> None:
    d, _ctx, prop, access = ready()
    _, va = d.cuMemAddressReserve(8 * MiB, 0, 0, 0)
    _, handle = d.cuMemCreate(2 * MiB, prop, 0)
    d.cuMemMap(va, 2 * MiB, 0, handle, 0)
    assert d.touch(int(va), 2 * MiB) == CUresult.CUDA_ERROR_ILLEGAL_ADDRESS  # mapped, no access yet
    assert d.cuMemSetAccess(va, 2 * MiB, [access], 1) == (CUresult.CUDA_SUCCESS,)
    assert d.touch(int(va), 2 * MiB) == CUresult.CUDA_SUCCESS
    assert d.touch(int(va), 4 * MiB) == CUresult.CUDA_ERROR_ILLEGAL_ADDRESS  # runs past the mapping
    d.cuMemUnmap(va, 2 * MiB)
    d.cuMemMap(va, 2 * MiB, 0, handle, 0)  # "all mappings start with no accessibility setup"
    assert not d.accessible(int(va), 2 * MiB) and len(d.faults) == 2
    assert d.cuMemSetAccess(va, 2 * MiB, [access], 2) == (INVALID,)  # count must match the descriptors
    d.cuMemUnmap(va, 2 * MiB)
    d.cuMemRelease(handle)
    d.cuMemAddressFree(va, 8 * MiB)
    assert d.cuMemAddressFree(va, 8 * MiB) == (INVALID,)


def test_calls_before_cuinit_or_outside_a_context_are_refused() -> None:
    d = FakeDriver()
    assert d.cuDeviceGetCount() == (CUresult.CUDA_ERROR_NOT_INITIALIZED,)
    d.cuInit(0)
    assert d.cuMemGetInfo() == (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
    assert d.cuEventCreate(0) == (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
    assert d.cuDeviceGet(1) == (CUresult.CUDA_ERROR_INVALID_DEVICE,)
    ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
    d.cuCtxPushCurrent(ctx)
    _, event = d.cuEventCreate(0)
    assert d.cuEventDestroy(event) == (CUresult.CUDA_SUCCESS,)
    assert d.cuEventDestroy(event) == (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    assert [r.call for r in d.refused] == ["cuDeviceGetCount", "cuMemGetInfo", "cuEventCreate", "cuDeviceGet",
                                           "cuEventDestroy"]


# -- the backend on the fake ----------------------------------------------------------------------
@pytest.mark.parametrize(("page_mib", "granularity_mib", "expected_mib"), [
    (2, 2, 2), (6, 2, 2), (8, 2, 8), (14, 2, 2), (28, 2, 4), (48, 2, 16), (84, 2, 4), (96, 2, 32), (486, 2, 2),
    (4096, 2, RESERVE_ALIGNMENT_CAP // MiB), (3072, 2, RESERVE_ALIGNMENT_CAP // MiB), (12, 4, 4),
])
def test_reserve_alignment_is_the_largest_power_of_two_dividing_the_page(
        page_mib: int, granularity_mib: int, expected_mib: int) -> None:
    assert reserve_alignment(page_mib * MiB, granularity_mib * MiB) == expected_mib * MiB


def test_reserve_alignment_refuses_what_no_mapping_could_use() -> None:
    with pytest.raises(ValueError, match="not a multiple of the granularity"):
        reserve_alignment(3 * MiB, 2 * MiB)
    with pytest.raises(ValueError, match="not a power of two"):
        reserve_alignment(6 * MiB, 3 * MiB)


def assert_backed(fake: FakeDriver, backend: CudaBackend, pages: list[int]) -> None:
    """Every slice of every page is mapped with access: a kernel may touch it."""
    for page in pages:
        for s in range(backend.slices):
            assert fake.touch(backend._addr(page, s), backend.slice_bytes) == CUresult.CUDA_SUCCESS, (page, s)


def assert_all_returned(fake: FakeDriver) -> None:
    assert fake.refused == [] and fake.faults == []
    assert (fake.live_handles, fake.allocated_bytes, fake.mapped_bytes, fake.reserved_bytes) == (0, 0, 0, 0)
    assert (fake.live_events, fake.retained_contexts) == (0, 0)


@pytest.mark.parametrize("page_mib", [2, 14, 28, 48])
@pytest.mark.parametrize("layout", ["layer", "page"])
@pytest.mark.parametrize("async_unmap", [True, False], ids=["deferred", "immediate"])
def test_the_backend_maps_unmaps_trims_and_closes_any_page_size(fake_cuda: FakeDriver, page_mib: int, layout: str,
                                                                  async_unmap: bool) -> None:
    g = Geometry(page_mib * MiB, num_pages=12, num_layers=3, num_kv_buffers=2)
    b = CudaBackend(g, layout=layout, pool_pages=2, async_unmap=async_unmap, unmap_delay_s=0.0)
    assert b._native is None and b.native_reason == "not requested"
    ((start, size),) = fake_cuda.reservations.items()
    assert size == b.va_bytes and start % reserve_alignment(g.page_size, 2 * MiB) == 0
    assert b.map_pages([0, 1, 2, 7, 11]) == [0, 1, 2, 7, 11]
    assert_backed(fake_cuda, b, [0, 1, 2, 7, 11])
    assert fake_cuda.mapped_bytes == 5 * g.bundle_bytes == b.mapped_bytes()
    created = fake_cuda.live_handles
    b.unmap_pages([1, 2, 7])
    b.flush()
    assert fake_cuda.mapped_bytes == 2 * g.bundle_bytes and b.pooled_bytes() == 2 * g.bundle_bytes
    assert fake_cuda.live_handles == 4 * b.slices  # 2 mapped + 2 pooled page ids; the third's released
    assert b.map_pages([5, 6]) == [5, 6] and fake_cuda.live_handles == 4 * b.slices, "regrowth from the pool"
    assert_backed(fake_cuda, b, [0, 5, 6, 11])
    assert not fake_cuda.accessible(b._addr(1, 0), b.slice_bytes)
    b.unmap_pages([5, 6])
    b.trim_pool(0)
    assert fake_cuda.live_handles == 2 * b.slices and fake_cuda.allocated_bytes == 2 * g.bundle_bytes
    assert fake_cuda.free_bytes() == 80 * GiB - 2 * g.bundle_bytes
    assert created == 5 * b.slices
    b.close()
    assert_all_returned(fake_cuda)


def test_running_out_of_device_memory_is_a_short_answer(fake_cuda: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", "0")  # the driver's out-of-memory is the only bound here
    g = Geometry(28 * MiB, num_pages=8, num_layers=2, num_kv_buffers=2)
    fake_cuda.total_bytes = 3 * g.bundle_bytes + 10 * MiB
    fake_cuda.external_bytes = 10 * MiB
    b = CudaBackend(g, pool_pages=0, async_unmap=False)
    assert b.map_pages([0, 1, 2, 3, 4]) == [0, 1, 2]  # a miss, not an error
    # the driver's out-of-memory, or none where the backend saw the device full before asking
    assert {(r.call, r.code) for r in fake_cuda.refused} <= {("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)}
    assert fake_cuda.mapped_bytes == 3 * g.bundle_bytes and fake_cuda.free_bytes() == 0
    fake_cuda.refused.clear()
    b.unmap_pages([2])
    assert b.map_pages([3]) == [3]
    b.close()
    assert_all_returned(fake_cuda)


def test_an_allocator_on_28_mib_pages_backs_every_block_it_hands_out(fake_cuda: FakeDriver) -> None:
    with KVCacheManager("fake-28", num_blocks=96, block_bytes=7 * MiB, num_layers=4, page_size=28 * MiB,
                        backend="cuda") as m:
        b = m.backend
        assert isinstance(b, CudaBackend) and m.blocks_per_page == 4
        blocks = m.alloc(14)
        assert blocks is not None
        pages = sorted({block // m.blocks_per_page for block in blocks})
        assert len(pages) >= 4
        assert_backed(fake_cuda, b, pages)
        m.free(blocks)
        assert m.trim() > 0
        b.flush()
    assert_all_returned(fake_cuda)
