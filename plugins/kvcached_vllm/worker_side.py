"""The worker side: vLLM's KV tensors over memory that kvcached maps page by page.

vLLM allocates one zeroed buffer for all layers and cuts it into per-layer views. Here each
layer's view lies over that layer's range of a :class:`kvcached_core.tp.TPWorker`'s backend
(host: anonymous memory committed per page; cuda: a reserved virtual range mapped per page).
The scheduler (EngineCore) maps a page id on this worker, over the same sockets tensor
parallelism uses, before it hands out any block on it, so vLLM never writes a block whose page
is not mapped; unmapped pages cost nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvcached_core.engines import TPWorker

from .geometry import KVLayout

log = logging.getLogger(__name__)

_WORKERS: dict[str, TPWorker] = {}  # socket path -> the worker serving it (kept alive with the process)


def start_worker(path: str, rank: int, layout: KVLayout, device: torch.device) -> TPWorker:
    """Listen on ``path`` for the scheduler of rank ``rank``; replaces a worker an earlier call left."""
    old = _WORKERS.pop(path, None)
    if old is not None:
        old.close()
    backend = "host" if device.type == "cpu" else "cuda"
    # vLLM's warm-up and CUDA-graph capture run kernels before the scheduler exists, and they read block 0 (the
    # padding of every block table): on a GPU its page stays mapped for the worker's whole life. On the host an
    # unmapped page reads as zeros (anonymous memory), so nothing is pinned there.
    pinned = (0,) if backend == "cuda" else ()  # block 0 lies on page 0
    worker = TPWorker(path, rank, device.index or 0, backend, layout.geometry, pinned=pinned)
    worker.start()
    _WORKERS[path] = worker
    return worker


def layer_bytes(worker: TPWorker, layer: int) -> torch.Tensor:
    """One layer's whole range as a flat int8 tensor on the worker's device, without a copy."""
    assert worker.backend is not None and worker.geometry is not None
    size = worker.geometry.range_bytes
    if worker.backend.name == "host":
        return torch.frombuffer(worker.buffer(layer, 0), dtype=torch.int8, count=size)
    raw = worker.buffer(layer, 0)  # cuda: [num_pages, page_size] bytes over the reserved range
    if raw.stride(0) != worker.geometry.page_size:
        raise RuntimeError("vLLM needs the cuda backend's layer layout (KVCACHED_CUDA_LAYOUT=layer): "
                           "its attention kernels index a layer's blocks with one stride")
    return raw.view(torch.int8).reshape(-1)


def kv_cache_views(worker: TPWorker, layout: KVLayout, kv_cache_config: Any, kv_layout_order: Any,
                   kernel_block_sizes: list[int] | None) -> dict[str, torch.Tensor]:
    """vLLM's per-layer KV views (its own ``create_kv_cache_views``) over the worker's ranges: each layer over its
    slot's range, with its group's spec and kernel block size (the layers of several groups share a slot)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views

    from .geometry import layer_specs

    assert worker.geometry is not None
    size = worker.geometry.range_bytes
    where: dict[str, tuple[int, Any]] = {}  # layer -> (its group, its spec)
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        where.update((name, (group_id, spec)) for name, spec in layer_specs(group).items())
    ranges: dict[int, torch.Tensor] = {}
    views: dict[str, torch.Tensor] = {}
    for index, name in enumerate(layout.layer_names):
        slot = layout.slot(index)
        raw = ranges.get(slot)
        if raw is None:
            raw = ranges[slot] = layer_bytes(worker, slot)
        group_id, spec = where[name]
        kernel_block_size = (kernel_block_sizes[group_id]
                             if kernel_block_sizes is not None and group_id < len(kernel_block_sizes) else None)
        tensor = KVCacheTensor(size=size, layers=[name], layer_stride=size, block_stride=layout.block_bytes)
        (view,) = create_kv_cache_views(raw, spec, layout.num_blocks, kv_layout_order, tensor,
                                        kernel_block_size=kernel_block_size)
        views[name] = view
    return views


def close_workers() -> None:
    for worker in _WORKERS.values():
        worker.close()
    _WORKERS.clear()
