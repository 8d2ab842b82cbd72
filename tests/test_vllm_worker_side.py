"""The vLLM plugin's worker side without vLLM: a scheduler's decisions reach the memory the KV views lie over.

The scheduler (a ``KVCacheManager`` over one rank socket, as in EngineCore) hands out blocks;
the worker (a ``TPWorker``, as in vLLM's worker process) holds the memory, viewed per layer as
vLLM's CPU layout ``[num_blocks, kv_heads, block_size, 2 * head_size]``. On the host the
memory is process memory whose RSS follows the mapped pages; on a GPU, CUDA virtual memory.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
from test_cuda_backend import GPU_MISSING

from kvcached_core import KVCacheManager
from kvcached_vllm.geometry import KVLayout
from kvcached_vllm.worker_side import close_workers, layer_bytes, start_worker

MiB = 1 << 20
KV_HEADS, BLOCK_TOKENS, HEAD = 2, 128, 64
BLOCK_BYTES = KV_HEADS * BLOCK_TOKENS * 2 * HEAD * 2  # bf16, K and V side by side: 64 KiB per layer
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn")

BACKENDS = pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(GPU_MISSING is not None,
                                                                     reason=f"needs an NVIDIA GPU: {GPU_MISSING}")]),
])


def views(worker, layout: KVLayout, device: str) -> list[torch.Tensor]:
    out = []
    for layer in range(layout.num_layers):
        raw = layer_bytes(worker, layer)
        assert raw.device.type == device and raw.dtype == torch.int8
        typed = raw.view(torch.bfloat16)[: layout.num_blocks * BLOCK_BYTES // 2]
        out.append(typed.view(layout.num_blocks, KV_HEADS, BLOCK_TOKENS, 2 * HEAD))
    return out


def trim_all(manager: KVCacheManager, worker) -> None:
    """Trim until the worker holds nothing: the refill thread may be mapping its pool right now."""
    deadline = time.monotonic() + 5
    while worker.mapped and time.monotonic() < deadline:
        manager.trim()
        time.sleep(0.05)


@pytest.fixture
def socket_path() -> Iterator[str]:
    """A rank socket's path in a short-lived folder of its own (a Unix socket's path is at most 107 bytes, so not
    under pytest's longer tmp_path), removed with what is in it when the test ends."""
    with tempfile.TemporaryDirectory(prefix="kvc-vllm-test-") as folder:
        yield os.path.join(folder, "rank0.sock")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@BACKENDS
def test_blocks_the_scheduler_hands_out_are_mapped_in_the_worker_views(device: str, socket_path: str) -> None:
    layout = KVLayout(LAYERS, num_blocks=320, block_bytes=BLOCK_BYTES, block_tokens=BLOCK_TOKENS, page_size=2 * MiB)
    assert layout.blocks_per_page == 32 and layout.geometry.num_pages == 10
    torch_device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    worker = start_worker(socket_path, 0, layout, torch_device)
    manager = KVCacheManager("vllm-worker-test", num_blocks=layout.num_blocks, block_bytes=BLOCK_BYTES,
                             num_layers=layout.num_layers, num_kv_buffers=1, page_size=layout.page_size,
                             backend="host" if device == "cpu" else "cuda", engine="vllm",
                             block_tokens=BLOCK_TOKENS, tp_world=1, tp_workers=[socket_path])
    try:
        caches = views(worker, layout, device)
        bundle = layout.page_size * layout.num_layers
        ids = manager.alloc(96)  # three pages' worth
        assert ids is not None
        pages = {b // layout.blocks_per_page for b in ids}
        assert pages <= worker.mapped  # every page a block lies on is mapped in the worker first
        for layer, cache in enumerate(caches):  # write each block where vLLM's kernels would, read it back
            for block in ids:
                cache[block].fill_(float(layer * 64 + block % 64))
        for layer, cache in enumerate(caches):
            got = torch.stack([cache[b][0, 0, 0] for b in ids]).float().cpu()
            assert got.tolist() == [float(layer * 64 + b % 64) for b in ids]
        assert worker.mapped_bytes == len(worker.mapped) * bundle
        manager.free(ids)
        trim_all(manager, worker)
        # the trim reached the worker's memory (on a GPU but page 0, pinned: see the next test)
        assert worker.mapped == PINNED[device] and manager.pages.mapped_pages == 0
    finally:
        manager.close()
        close_workers()
    assert not worker.mapped  # the scheduler's close released the worker's memory


PINNED = {"cpu": set(), "cuda": {0}}


@BACKENDS
def test_block_0_is_readable_before_the_scheduler_exists(device: str, socket_path: str) -> None:
    """vLLM's warm-up and CUDA-graph capture run kernels over block 0 (every block table's padding) before the
    EngineCore's scheduler exists: on a GPU its page is mapped by the worker at start and kept, so they read
    memory, not an unmapped address (a fault that kills the engine; on the old code the worker mapped
    nothing before the scheduler attached). On the host an unmapped page reads as zeros: nothing is pinned."""
    layout = KVLayout(LAYERS, num_blocks=320, block_bytes=BLOCK_BYTES, block_tokens=BLOCK_TOKENS, page_size=2 * MiB)
    torch_device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    worker = start_worker(socket_path, 0, layout, torch_device)
    try:
        assert worker.mapped == PINNED[device]
        for layer, cache in enumerate(views(worker, layout, device)):  # a warm-up's writes and reads of block 0
            cache[0].fill_(float(layer + 1))
            assert float(cache[0].float().sum()) == float(layer + 1) * cache[0].numel()
        if device == "cuda":
            torch.cuda.synchronize()
    finally:
        close_workers()
    assert not worker.mapped


def test_worker_rss_follows_the_pages_the_scheduler_maps(socket_path: str) -> None:
    layout = KVLayout(LAYERS, num_blocks=640, block_bytes=BLOCK_BYTES, block_tokens=BLOCK_TOKENS, page_size=2 * MiB)
    worker = start_worker(socket_path, 0, layout, torch.device("cpu"))
    manager = KVCacheManager("vllm-rss-test", num_blocks=layout.num_blocks, block_bytes=BLOCK_BYTES,
                             num_layers=layout.num_layers, num_kv_buffers=1, page_size=layout.page_size,
                             backend="host", engine="vllm", block_tokens=BLOCK_TOKENS, tp_world=1, tp_workers=[socket_path])
    try:
        views(worker, layout, "cpu")  # the views alone commit nothing
        manager.trim()
        idle = rss_bytes()
        ids = manager.alloc(layout.num_blocks - 32)
        assert ids is not None
        grown = rss_bytes() - idle
        need = (-(-len(ids) // layout.blocks_per_page)) * layout.page_size * layout.num_layers
        assert grown >= 0.9 * need
        manager.free(ids)
        trim_all(manager, worker)
        assert rss_bytes() - idle < 0.1 * need
    finally:
        manager.close()
        close_workers()
