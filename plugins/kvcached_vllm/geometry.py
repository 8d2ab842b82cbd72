"""vLLM's KV cache configuration as kvcached geometry: the one place both processes derive it.

The scheduler (block ids) and the worker (memory) must agree on page size, page count and
layers, or the worker refuses the scheduler at attach time. Both call :func:`kv_layout` on the
same ``KVCacheConfig``.

Supported: one KV cache group of identical full-attention layers in a layer-outermost layout
(vLLM's default for such models, ``LBHNC`` on CPU): layer ``l``'s block ``b`` is at
``l * layer_stride + b * block_stride``. kvcached gives each layer its own range and maps a page
id in every layer, so a block keeps one stride inside its layer, as attention kernels expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcached_core.engines import Geometry
from kvcached_core.settings import settings


class UnsupportedLayout(RuntimeError):
    """The model's KV cache cannot be placed in kvcached pages; the message says why and what to do."""


@dataclass(frozen=True)
class KVLayout:
    """One vLLM KV cache tensor group in kvcached terms (one KV buffer per layer: K and V side by side)."""

    layer_names: tuple[str, ...]
    num_blocks: int
    block_bytes: int  # one layer's block, vLLM's block stride
    block_tokens: int
    page_size: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def blocks_per_page(self) -> int:
        return self.page_size // self.block_bytes

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.page_size, -(-self.num_blocks // self.blocks_per_page), self.num_layers, 1)


def kv_layout(kv_cache_config: Any, page_size: int | None = None) -> KVLayout:
    """The :class:`KVLayout` of ``kv_cache_config``, or :class:`UnsupportedLayout` saying why not."""
    page_size = settings().page_size_bytes if page_size is None else page_size
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if len(groups) != 1 or len(tensors) != 1:
        raise UnsupportedLayout(
            f"this model has {len(groups)} KV cache groups in {len(tensors)} tensors; kvcached serves models "
            "whose layers all use full attention (one group): run it without ENABLE_KVCACHED")
    spec, tensor = groups[0].kv_cache_spec, tensors[0]
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "page_size_padded", None):
        raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not plain full attention; "
                                "run this model without ENABLE_KVCACHED")
    num_blocks = int(kv_cache_config.num_blocks)
    block_bytes = int(tensor.block_stride)
    if tensor.layer_stride < num_blocks * block_bytes:
        raise UnsupportedLayout(
            f"the KV cache layout {kv_cache_config.kv_cache_layout} interleaves layers inside a block "
            f"(layer stride {tensor.layer_stride} B, block stride {block_bytes} B); set "
            "VLLM_KV_CACHE_LAYOUT to a layer-outermost layout such as LBHNC")
    if block_bytes > page_size or page_size % block_bytes:
        raise UnsupportedLayout(
            f"a vLLM block of {block_bytes} bytes per layer does not tile a kvcached page of {page_size} bytes: "
            f"choose --block-size so that it does, or set KVCACHED_PAGE_SIZE_MB to a multiple of the block")
    return KVLayout(tuple(tensor.layers), num_blocks, block_bytes, int(spec.block_size), page_size)
