"""CUDA backend: layout arithmetic everywhere; real GPU memory where an NVIDIA GPU and its driver are.

GPU tests carry ``@pytest.mark.gpu`` and skip (with the reason) when cuda-python, the driver or
a device is missing, so CI without a GPU stays green.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
from fake_cuda import FakeDriver, run_probes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached_core import BackendError, BackendUnavailable, KVCacheManager
from kvcached_core.backends import Geometry, cuda_native
from kvcached_core.backends.cuda import (
    CudaBackend,
    _load_driver,
    block_spec,
    range_spec,
    runs,
    tensor_views,
)
from kvcached_core.settings import ConfigError, Settings

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_missing() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    try:
        from cuda.bindings import driver as d
    except ImportError:
        try:
            from cuda import cuda as d
        except ImportError:
            return "cuda-python is not installed"
    try:
        err = d.cuInit(0)[0]
    except Exception as exc:  # noqa: BLE001 - libcuda missing
        return f"no NVIDIA driver ({type(exc).__name__})"
    if err != d.CUresult.CUDA_SUCCESS:
        return f"no usable GPU (cuInit: {err})"
    err, count = d.cuDeviceGetCount()
    return None if err == d.CUresult.CUDA_SUCCESS and count > 0 else "no CUDA device"


GPU_MISSING = gpu_missing()
needs_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=f"needs an NVIDIA GPU: {GPU_MISSING}")
LAYOUTS = pytest.mark.parametrize("layout", ["layer", "page"])
# Real models' pages are seldom a power of two (transformers' Llama-3.2-3B: 28 MiB, Qwen2.5-7B: 14 MiB), and the
# driver takes only power-of-two reserve alignments (tests/test_model_shapes.py has the shapes on the fake driver).
PAGE_SIZES = pytest.mark.parametrize("page_mib", [2, 14, 28])
# The native loop (the extension built at install, the default) and cuda-python alone.
PATHS = pytest.mark.parametrize("native", ["1", "0"], ids=["native-loop", "cuda-python"])


def on_path(backend: CudaBackend, native: str) -> CudaBackend:
    """Check the backend took the path asked for."""
    assert (backend._native is not None) == (native != "0"), backend.native_reason
    return backend


def native_mode(native: str) -> str:
    return "off" if native == "0" else "on"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- layout arithmetic (runs anywhere) -----------------------------------------------------------
def test_runs_split_pages_into_consecutive_stretches() -> None:
    assert list(runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert list(runs([])) == []
    assert list(runs([7])) == [(0, 7, 1)]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), buffers=st.integers(1, 2), pages=st.integers(1, 5),
       page_units=st.sampled_from([1, 2]), block_div=st.sampled_from([1, 2, 3, 4, 8]),
       layout=st.sampled_from(["layer", "page"]))
def test_block_views_are_disjoint_and_inside_the_reservation(layers, buffers, pages, page_units, block_div, layout):
    g = Geometry(page_units * 2 * MiB, pages, layers, buffers)
    block_bytes = g.page_size // block_div
    bpp = g.page_size // block_bytes
    num_blocks = pages * bpp
    seen: list[tuple[int, int]] = []
    for layer in range(layers):
        for kv in range(buffers):
            spec = block_spec(layout, g, layer, kv, block_bytes, num_blocks)
            flat = len(spec.shape) == 2
            assert flat == (layout == "layer" and g.page_size % block_bytes == 0)
            for block in range(num_blocks):
                index = (block,) if flat else divmod(block, bpp)
                start = spec.offset + sum(i * s for i, s in zip(index, spec.strides[: len(index)], strict=True))
                seen.append((start, start + block_bytes))
                # a block never straddles a page of its own buffer
                page_start = range_spec(layout, g, layer, kv).offset + (block // bpp) * range_spec(
                    layout, g, layer, kv).strides[0]
                assert page_start <= start and start + block_bytes <= page_start + g.page_size
    seen.sort()
    assert all(a[1] <= b[0] for a, b in zip(seen, seen[1:], strict=False)), "two blocks overlap"
    assert seen[0][0] >= 0 and seen[-1][1] <= g.range_bytes * layers * buffers


def test_layer_layout_gives_each_buffer_one_single_stride_tensor() -> None:
    g = Geometry(2 * MiB, 10, 32, 2)
    spec = block_spec("layer", g, 3, 1, 32 * 1024, 640)
    assert spec.shape == (640, 32 * 1024) and spec.strides == (32 * 1024, 1)
    assert spec.offset == (3 * 2 + 1) * g.range_bytes
    page = block_spec("page", g, 3, 1, 32 * 1024, 640)
    assert page.shape == (10, 64, 32 * 1024) and page.strides == (g.bundle_bytes, 32 * 1024, 1)
    assert page.offset == (3 * 2 + 1) * g.page_size


def test_layout_setting_is_validated_before_touching_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", "diagonal")
    with pytest.raises(ConfigError, match="layer, page"):
        assert Settings.from_env().cuda_layout
    with pytest.raises(ConfigError, match="KVCACHED_CUDA_LAYOUT"):
        CudaBackend(Geometry(2 * MiB, 4, 2, 2))
    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", "Page")
    assert Settings.from_env().cuda_layout == "page"
    monkeypatch.setenv("KVCACHED_CUDA_POOL_PAGES", "-1")
    with pytest.raises(ConfigError, match="KVCACHED_CUDA_POOL_PAGES"):
        CudaBackend(Geometry(2 * MiB, 4, 2, 2), layout="layer")
    monkeypatch.setenv("KVCACHED_CUDA_POOL_PAGES", "3")
    monkeypatch.setenv("KVCACHED_CUDA_ASYNC_UNMAP", "later")
    with pytest.raises(ConfigError, match="KVCACHED_CUDA_ASYNC_UNMAP"):
        CudaBackend(Geometry(2 * MiB, 4, 2, 2), layout="layer")
    monkeypatch.setenv("KVCACHED_CUDA_ASYNC_UNMAP", "1")
    monkeypatch.setenv("KVCACHED_CUDA_UNMAP_DELAY_MS", "soon")
    with pytest.raises(ConfigError, match="KVCACHED_CUDA_UNMAP_DELAY_MS"):
        CudaBackend(Geometry(2 * MiB, 4, 2, 2), layout="layer")
    monkeypatch.setenv("KVCACHED_CUDA_UNMAP_DELAY_MS", "5")
    monkeypatch.setenv("KVCACHED_CUDA_NATIVE", "maybe")
    with pytest.raises(ConfigError, match="KVCACHED_CUDA_NATIVE"):
        CudaBackend(Geometry(2 * MiB, 4, 2, 2), layout="layer")


def test_the_map_loop_extension_checks_its_arguments() -> None:
    """The installed extension's entry points refuse what would make the loop read out of bounds (the
    loop itself needs a GPU)."""
    module, why = cuda_native.load()
    assert module is not None, why
    with pytest.raises(TypeError, match="offsets: list"):
        module.map_pages(1, (0,), [])
    with pytest.raises(ValueError, match="null vmm"):
        module.map_pages(0, [0], [])
    with pytest.raises(TypeError, match="handles: list"):
        module.release(1, (1,))
    with pytest.raises(TypeError, match="unmap"):
        module.unmap(1, 0)


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present: construction succeeds here")
def test_without_a_gpu_construction_says_what_is_missing(shm_dir) -> None:
    with pytest.raises(BackendUnavailable) as info:
        CudaBackend(Geometry(2 * MiB, 4, 2, 2))
    message = str(info.value)
    assert "\n" not in message and "backend 'cuda'" in message
    assert any(word in message for word in ("driver", "cuda-python", "GPU", "device"))
    with pytest.raises(BackendUnavailable):
        KVCacheManager("no-gpu", num_blocks=64, block_bytes=MiB, num_layers=2, page_size=2 * MiB, backend="cuda")
    assert list(shm_dir.iterdir()) == []  # no segment left behind


# -- on a GPU --------------------------------------------------------------------------------------
def cuda_manager(name: str, **kwargs) -> KVCacheManager:
    params = dict(num_blocks=48, block_bytes=256 * 1024, num_layers=4, page_size=2 * MiB, backend="cuda")
    params.update(kwargs)
    return KVCacheManager(name, **params)


@pytest.mark.gpu
@needs_gpu
@PAGE_SIZES
@LAYOUTS
@PATHS
def test_write_and_read_back_every_layer_through_torch(layout, native, page_mib, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", layout)
    monkeypatch.setenv("KVCACHED_CUDA_NATIVE", "0" if native == "0" else "1")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")  # map on demand only: no background mapping races
    page = page_mib * MiB
    with cuda_manager(f"rw-{layout}-{page_mib}", page_size=page, block_bytes=page // 8) as m:  # 8 blocks a page
        assert m.backend.layout == layout
        on_path(m.backend, native)
        views = tensor_views(m, dtype=torch.int32)
        bpp = m.blocks_per_page
        blocks = m.alloc(20)
        assert blocks is not None and len(blocks) == 20

        def at(view, block):
            return view[block] if view.dim() == 2 else view[block // bpp, block % bpp]

        def fill_and_check(ids: list[int], salt: int) -> None:
            for layer in range(m.num_layers):
                for kv in range(m.num_kv_buffers):
                    for block in ids:
                        at(views[layer][kv], block).fill_(salt + (layer * 2 + kv) * 1000 + block)
            torch.cuda.synchronize()
            for layer in range(m.num_layers):
                for kv in range(m.num_kv_buffers):
                    for block in ids:
                        got = at(views[layer][kv], block)
                        assert torch.all(got == salt + (layer * 2 + kv) * 1000 + block), (layer, kv, block)

        fill_and_check(blocks, 1)
        # the raw byte view of a buffer sees the same bytes at the documented offset
        raw = m.buffer(2, 1)
        assert tuple(raw.shape) == (m.geometry.num_pages, m.page_size)
        block = blocks[5]
        page, slot = divmod(block, bpp)
        cell = raw[page, slot * m.block_bytes: slot * m.block_bytes + 4].view(torch.int32)
        assert int(cell.item()) == 1 + (2 * 2 + 1) * 1000 + block
        # free everything, return the memory, map again: the new pages work on every layer
        m.free(blocks)
        assert m.trim() > 0
        assert m.backend.mapped_bytes() == 0 and m.backend.pooled_bytes() == 0
        again = m.alloc(30)
        assert again is not None
        fill_and_check(again, 7)


@pytest.mark.gpu
@needs_gpu
@LAYOUTS
def test_views_take_a_dtype_and_block_shape(layout) -> None:
    torch = pytest.importorskip("torch")
    g = Geometry(2 * MiB, 3, 2, 2)
    b = CudaBackend(g, layout=layout)
    try:
        v = b.blocks(1, 0, 256 * 1024, 24, dtype=torch.bfloat16, shape=(16, 8, 1024))
        if layout == "layer":
            assert tuple(v.shape) == (24, 16, 8, 1024) and v.is_contiguous()
        else:
            assert tuple(v.shape) == (3, 8, 16, 8, 1024)
            assert v.stride(0) * 2 == g.bundle_bytes
        assert v.dtype == torch.bfloat16 and v.device.type == "cuda"
        with pytest.raises(ValueError, match="holds"):
            b.blocks(1, 0, 256 * 1024, 24, dtype=torch.bfloat16, shape=(3, 3))
    finally:
        b.close()


@pytest.mark.gpu
@needs_gpu
@PAGE_SIZES
@LAYOUTS
@PATHS
def test_pool_reuses_handles_and_trim_pool_releases_beyond_keep(layout, native, page_mib) -> None:
    b = on_path(CudaBackend(Geometry(page_mib * MiB, 8, 2, 2), layout=layout, pool_pages=4,
                            native=native_mode(native)), native)
    try:
        per_page = b.slices
        assert b.map_pages([0, 1, 2, 3]) == [0, 1, 2, 3]
        assert b.created == 4 * per_page and b.mapped_bytes() == 4 * b.geometry.bundle_bytes
        b.unmap_pages([0, 1, 2, 3])
        b.flush()
        assert b.pooled_bytes() == 4 * b.geometry.bundle_bytes and b.released == 0
        assert b.map_pages([4, 6, 7]) == [4, 6, 7]
        assert b.created == 4 * per_page, "regrowth must come from the pool"
        b.unmap_pages([4, 6, 7])
        b.trim_pool(1)  # finishes the deferred unmaps first
        assert b.pooled_bytes() == b.geometry.bundle_bytes and b.released == 3 * per_page
        with pytest.raises(BackendError, match="not mapped"):
            b.unmap_pages([5])
    finally:
        b.close()


@pytest.mark.gpu
@needs_gpu
@LAYOUTS
@PATHS
def test_deferred_unmap_hands_back_a_pending_page_without_driver_work(layout, native) -> None:
    b = on_path(CudaBackend(Geometry(2 * MiB, 8, 4, 2), layout=layout, pool_pages=0, native=native_mode(native)),
                native)
    idle = threading.Thread(target=lambda: None)
    idle.start()
    idle.join()
    b._unmapper = idle  # an unmapper that never runs: deferred pages stay pending until flush()
    try:
        bundle = b.geometry.bundle_bytes
        assert b.map_pages([1, 2]) == [1, 2]
        kept = b._mapped[2]
        b.unmap_pages([1, 2])
        assert b.returning_bytes() == 2 * bundle and b.mapped_bytes() == 0
        assert b.held_bytes() == 2 * bundle and b.free_bytes() >= 2 * bundle
        created = b.created
        assert b.map_pages([2, 5]) == [2, 5]
        assert b._mapped[2] is kept, "page 2 was still mapped: it must come back as it was"
        assert b.revived == 1
        assert b.created == created + b.slices  # only page 5 needed new memory
        with pytest.raises(BackendError, match="not mapped"):
            b.unmap_pages([1])  # already on its way out
        b.flush()
        assert b.returning_bytes() == 0 and b.mapped_bytes() == 2 * bundle
        assert b.released == b.slices  # page 1's handles (pool_pages=0)
    finally:
        b.close()


@pytest.mark.gpu
@needs_gpu
@PATHS
def test_driver_errors_name_the_call_and_leave_nothing_half_mapped(native) -> None:
    from cuda.bindings import driver as d

    b = on_path(CudaBackend(Geometry(2 * MiB, 4, 1, 1), layout="layer", async_unmap=False,
                            native=native_mode(native)), native)
    try:
        with b._context():
            err, stray = d.cuMemCreate(2 * MiB, b._prop, 0)
            assert err == d.CUresult.CUDA_SUCCESS
            squatted = b.base_address + 2 * MiB  # page 1, mapped behind the backend's back
            assert d.cuMemMap(squatted, 2 * MiB, 0, stray, 0)[0] == d.CUresult.CUDA_SUCCESS
        with pytest.raises(BackendError, match=r"cuMemMap\(page 1\) failed: CUDA_ERROR_\w+"):
            b.map_pages([0, 1])
        assert b.mapped_bytes() == 0, "page 0 must be rolled back when page 1 fails"
        with b._context():
            assert d.cuMemUnmap(squatted, 2 * MiB)[0] == d.CUresult.CUDA_SUCCESS
            assert d.cuMemRelease(stray)[0] == d.CUresult.CUDA_SUCCESS
        assert b.map_pages([0, 1]) == [0, 1]
    finally:
        b.close()
    with pytest.raises(BackendError, match="granularity"):
        CudaBackend(Geometry(MiB // 2, 2, 1, 1))


@pytest.mark.gpu
@needs_gpu
def test_the_fake_driver_refuses_what_this_driver_refuses() -> None:
    """The CPU tests hold the backend to tests/fake_cuda.py's rules; the same probes (reserve alignments, sizes
    off the granularity, a non-zero map offset, double maps, unmaps and access of unmapped memory...) must succeed
    and fail alike here and on the fake. Error codes may differ: a difference is a warning."""
    real = run_probes(_load_driver())
    fake = run_probes(FakeDriver())
    assert {k: v == 0 for k, v in real.items()} == {k: v == 0 for k, v in fake.items()}, (real, fake)
    assert real["reserve aligned to 28 MiB"] != 0 and real["reserve aligned to 8 MiB"] == 0
    differ = {k: (real[k], fake[k]) for k in real if real[k] != fake[k]}
    if differ:
        warnings.warn(f"the fake refuses with other codes than this driver (real, fake): {differ}", stacklevel=1)


@pytest.mark.gpu
@needs_gpu
def test_calls_from_a_thread_leave_its_context_as_it_was() -> None:
    from cuda.bindings import driver as d

    b = CudaBackend(Geometry(2 * MiB, 4, 2, 2), layout="layer")
    seen: dict[str, object] = {}

    def work() -> None:
        seen["free"] = b.free_bytes()
        seen["mapped"] = b.map_pages([1])
        b.unmap_pages([1])
        seen["after"] = int(d.cuCtxGetCurrent()[1] or 0)

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen["mapped"] == [1] and 0 < seen["free"] <= b.capacity_bytes()  # type: ignore[operator]
        assert seen["after"] == 0, "the backend left its context current in a foreign thread"
    finally:
        b.close()


@pytest.mark.gpu
@needs_gpu
def test_trim_returns_memory_and_the_driver_and_nvml_agree(monkeypatch) -> None:
    from kvcached_core import snapshot
    from kvcached_core.backends import nvml

    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", "layer")
    bundle = 2 * MiB * 8 * 2
    with cuda_manager("trim", num_layers=8, num_blocks=8 * 40) as m:
        assert m.try_to_reserve(8 * 32)  # 32 page ids = 1 GiB, mapped now
        mapped = snapshot(m.name).mapped_bytes
        assert mapped >= 32 * bundle
        free_before = m.backend.free_bytes() - m.backend.pooled_bytes()
        gpu_before = nvml.probe([0])[0]
        freed = m.trim()
        assert freed == mapped
        assert snapshot(m.name).mapped_bytes == 0 and m.backend.held_bytes() == 0
        free_after = m.backend.free_bytes()
        gpu_after = nvml.probe([0])[0]
        tolerance = 64 * MiB
        assert abs((free_after - free_before) - freed) < tolerance, (free_before, free_after, freed)
        assert gpu_before.used_bytes is not None and gpu_after.used_bytes is not None
        assert abs((gpu_before.used_bytes - gpu_after.used_bytes) - freed) < tolerance
        # NVML and cuMemGetInfo see the same device (free_bytes keeps the device's headroom back)
        assert abs(gpu_after.free_bytes - (free_after + m.backend.headroom_bytes())) < 512 * MiB


@pytest.mark.gpu
@needs_gpu
def test_limits_cap_mapped_memory(monkeypatch) -> None:
    import kvcached_core as kc

    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "1")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "2")
    with cuda_manager("limited", num_blocks=8 * 12) as m:
        bundle = m.bundle_bytes
        ack = kc.request_limit(m.name, 3 * bundle, wait=5)
        assert ack.status == "applied"
        got = m.alloc(3 * 8)
        assert got is not None
        assert m.alloc(1) is None, "a fourth page id must not be mapped under a 3-page limit"
        assert m.backend.mapped_bytes() <= 3 * bundle
        assert m.set_limit(None) == "none"
        assert m.alloc(8) is not None
        assert m.backend.mapped_bytes() >= 4 * bundle


CHILD = """
import sys
from kvcached_core import KVCacheManager
m = KVCacheManager({name!r}, name={name!r}, num_blocks=64, block_bytes=256 * 1024, num_layers=4,
                   page_size=2 << 20, backend="cuda")
ids = m.alloc({blocks})
assert ids is not None
print("READY", flush=True)
sys.stdin.readline()
m.close()
"""


@pytest.mark.gpu
@needs_gpu
def test_two_processes_share_the_gpu_and_kvctl_lists_both(shm_dir) -> None:
    from kvcached_core.backends import nvml

    procs = []
    try:
        for name, blocks in (("gpu-a", 10), ("gpu-b", 30)):
            p = subprocess.Popen([sys.executable, "-c", CHILD.format(name=name, blocks=blocks)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=child_env())
            procs.append(p)
            assert p.stdout.readline().strip() == "READY"
        listing = subprocess.run([sys.executable, "-m", "kvtop.cli", "list", "--json"], capture_output=True,
                                 text=True, env=child_env(), timeout=60)
        if listing.returncode != 0 and "No module named" in listing.stderr:  # kvctl's deps missing here
            listing = subprocess.run([sys.executable, "-c", textwrap.dedent("""
                import json, kvcached_core
                print(json.dumps([m.to_dict() for m in kvcached_core.list_models()]))""")],
                capture_output=True, text=True, env=child_env(), timeout=60)
        assert listing.returncode == 0, listing.stderr
        rows = {row["name"]: row for row in json.loads(listing.stdout)}
        assert set(rows) == {"gpu-a", "gpu-b"}
        for name, p in zip(("gpu-a", "gpu-b"), procs, strict=True):
            assert rows[name]["backend"] == "cuda" and rows[name]["status"] == "live"
            assert rows[name]["pid"] == p.pid and rows[name]["mapped_bytes"] > 0
        assert rows["gpu-b"]["blocks_used"] == 30 and rows["gpu-a"]["blocks_used"] == 10
        gpus = nvml.probe([0])
        if gpus and gpus[0].processes:  # NVML lists compute processes here: both allocators hold memory
            for p in procs:
                assert p.pid in gpus[0].processes
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.write("\n")
                p.stdin.flush()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


HOG = """
import sys, torch
torch.cuda.init()
keep, chunk = [], 1 << 30
headroom = int(sys.argv[1])
while True:
    free = torch.cuda.mem_get_info(0)[0]
    if free - headroom < (32 << 20):
        break
    size = min(chunk, free - headroom)
    size -= size % (2 << 20)
    try:
        keep.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    except RuntimeError:
        chunk //= 2
        if chunk < (2 << 20):
            break
print("READY", torch.cuda.mem_get_info(0)[0], flush=True)
sys.stdin.readline()
"""


@pytest.mark.gpu
@needs_gpu
def test_driver_out_of_memory_is_a_miss_not_an_error(monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", "layer")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    # one page id = 32 layers x K/V x 2 MiB = 128 MiB; the hog leaves less than that free
    with cuda_manager("oom", num_layers=32, num_blocks=8 * 16) as m:
        assert m.alloc(8) is not None
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(40 * MiB)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=child_env())
        try:
            line = hog.stdout.readline().split()
            assert line and line[0] == "READY", "the memory hog did not start"
            assert int(line[1]) < m.bundle_bytes
            created = m.backend.created
            assert m.alloc(8) is None, "a new page id cannot fit: alloc must miss"
            assert m.backend.map_pages([9]) == []
            assert m.backend.mapped_bytes() == m.bundle_bytes  # the partial page id was rolled back
            assert m.backend.created >= created
            assert m.available_size() < 8 * 2
        finally:
            hog.stdin.write("\n")
            hog.stdin.flush()
            hog.wait(timeout=60)
        deadline = time.monotonic() + 20
        got = None
        while got is None and time.monotonic() < deadline:
            got = m.alloc(8)
            time.sleep(0.05)
        assert got is not None, "memory came back but alloc still misses"


BUDGET_CHILD = """
import sys
from kvcached_core import KVCacheManager
m = KVCacheManager({name!r}, name={name!r}, num_blocks=64, block_bytes=512 * 1024, num_layers=4,
                   page_size=2 << 20, backend="cuda")
ids = m.alloc({blocks})
print("READY", ids is not None, m.backend.held_bytes(), flush=True)
sys.stdin.readline()
m.close()
"""


@pytest.mark.gpu
@needs_gpu
@LAYOUTS
def test_a_device_budget_is_shared_by_every_allocator_on_the_device(layout, monkeypatch) -> None:
    # one page id = 4 layers x K/V x 2 MiB = 16 MiB; the budget holds 6 of them on device 0
    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", layout)
    monkeypatch.setenv("KVCACHED_DEVICE_BUDGET", "96MiB")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_CUDA_POOL_PAGES", "0")
    other = subprocess.Popen([sys.executable, "-c", BUDGET_CHILD.format(name="bud-a", blocks=16)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        ready = other.stdout.readline().split()
        assert ready[:2] == ["READY", "True"] and int(ready[2]) == 64 * MiB  # 4 page ids of 4 blocks
        with cuda_manager("bud-b", num_blocks=64, block_bytes=512 * 1024) as m:
            assert m.backend.capacity_bytes() == 96 * MiB
            assert m.backend.free_bytes() <= 32 * MiB
            assert m.alloc(8) is not None  # two page ids: the budget's last 32 MiB
            assert m.alloc(1) is None, "a third page id is past the device budget: a miss"
            assert m.backend.held_bytes() == 32 * MiB
            from kvcached_core import list_models
            claims = {s.name: s for s in list_models()}
            assert claims["bud-b"].mapped_bytes == 32 * MiB
        # the other process gives its memory back: the budget is free again for a new allocator
        other.stdin.write("\n")
        other.stdin.flush()
        other.wait(timeout=30)
        with cuda_manager("bud-c", num_blocks=64, block_bytes=512 * 1024) as m:
            assert m.alloc(24) is not None and m.backend.held_bytes() == 96 * MiB
            assert m.alloc(1) is None
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()


@pytest.mark.gpu
@needs_gpu
def test_nvml_probe_reports_the_gpu_and_our_process() -> None:
    from kvcached_core.backends import nvml

    assert nvml.available(), nvml.unavailable_reason()
    b = CudaBackend(Geometry(2 * MiB, 64, 2, 2), layout="page")
    try:
        b.map_pages(range(64))  # 512 MiB
        gpus = nvml.probe()
        assert gpus and gpus[0].index == 0
        g = gpus[0]
        assert g.name and "NVIDIA" in g.name
        assert g.uuid and g.uuid.startswith("GPU-")
        assert g.total_bytes and g.total_bytes >= b.capacity_bytes() - 512 * MiB
        assert g.used_bytes is not None and g.free_bytes is not None
        assert os.getpid() in g.processes, f"NVML lists {sorted(g.processes)}, not us ({os.getpid()})"
        used = g.processes[os.getpid()]
        assert used is None or used >= 512 * MiB
    finally:
        b.close()


# A kernel queued before a free writes into the freed page ~1 s later (torch.cuda._sleep first); the page's
# unmap is asked at once (no delay, no pool). ``unfenced`` replays the code before the unmap waited for the
# engine's stream, to show what that wait prevents on this driver.
FENCE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    os.environ.update(KVCACHED_CUDA_UNMAP_DELAY_MS="0", KVCACHED_MIN_RESERVED_PAGES="0",
                      KVCACHED_MAX_RESERVED_PAGES="0", KVCACHED_CUDA_POOL_PAGES="0", KVCACHED_CUDA_LAYOUT="{layout}")
    import torch
    from kvcached_core import KVCacheManager
    from kvcached_core.backends.cuda import CudaBackend, tensor_views
    if "{mode}" == "unfenced":
        CudaBackend._wait_fences = lambda self, wait, done: None
    m = KVCacheManager("fence-{mode}", num_blocks=32, block_bytes=256 * 1024, num_layers=2,
                       page_size=2 * 1024 * 1024, backend="cuda")
    views = tensor_views(m, dtype=torch.float32)
    blocks = m.alloc(m.blocks_per_page)
    assert blocks is not None and m.backend.mapped_bytes() > 0
    bpp = m.blocks_per_page

    def write():
        for layer in views:
            for kv in layer:
                for block in blocks:  # the allocated blocks only: the rest of the range is not mapped
                    (kv[block] if kv.dim() == 2 else kv[block // bpp, block % bpp]).fill_(1.0)

    write()  # the kernels loaded now: a first launch loads its module, which waits for the device
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time before the writes run
    write()
    assert not torch.cuda.current_stream().query(), "the writes must still be queued when the blocks are freed"
    t0 = time.monotonic()
    m.free(blocks)
    m.backend.flush()
    waited = time.monotonic() - t0
    mapped = m.backend.mapped_bytes()
    try:
        torch.cuda.synchronize()
        error = None
    except Exception as exc:
        error = str(exc).splitlines()[0]
    print(json.dumps(dict(waited=waited, mapped=mapped, error=error)), flush=True)
    os._exit(0)  # a faulted context cannot be torn down cleanly
""")


def run_fence_child(mode: str, layout: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FENCE_CHILD.format(mode=mode, layout=layout)], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"exit {out.returncode}: {out.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.mark.gpu
@needs_gpu
@LAYOUTS
def test_an_unmap_waits_for_the_kernels_queued_before_the_free(layout) -> None:
    pytest.importorskip("torch")
    got = run_fence_child("fenced", layout)
    assert got["error"] is None, got  # the writes ran on mapped memory
    assert got["mapped"] == 0, got  # and the page was unmapped after them
    assert got["waited"] > 0.3, got  # the unmap waited for the queued work (about a second of it)
    before = run_fence_child("unfenced", layout)  # the code before: the unmap did not wait
    print("unfenced (the code before):", before)
