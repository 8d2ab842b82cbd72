"""Torch tensors over the allocator's memory: the one place that knows host from GPU.

A layer's K (or V) buffer is ``num_pages`` pages of ``page_size`` bytes, one stride apart (the
stride is ``page_size`` in a layer-separated layout, a whole page bundle in the CUDA backend's
page-major one). Blocks sit back to back inside a page and never straddle pages, so a buffer is
viewed as ``[num_pages, tokens_per_page, kv_heads, head_dim]`` and a token is addressed by
(page, token-in-page), whatever ``page_size % block_bytes`` is. Only mapped pages may be
touched (on a GPU an unmapped page is an illegal address): the cache indexes the blocks it
holds and nothing else.
"""

from __future__ import annotations

import torch

from kvcached_core import KVCacheManager


def page_rows(manager: KVCacheManager, layer: int, kv: int, device: torch.device) -> torch.Tensor:
    """``[num_pages, page_size]`` uint8 over one layer's one KV buffer, without a copy.

    Host backend: ``manager.buffer`` is a writable memoryview of process memory, viewed with
    ``torch.frombuffer``. CUDA backend: ``manager.buffer`` is already a torch tensor over the
    reserved virtual range (handed over through DLPack).
    """
    g = manager.geometry
    buf = manager.buffer(layer, kv)
    if manager.backend.name == "host":
        if device.type != "cpu":
            raise ValueError(f"the host backend's memory is CPU memory; the model runs on {device}")
        return torch.frombuffer(buf, dtype=torch.uint8, count=g.range_bytes).view(g.num_pages, g.page_size)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"the {manager.backend.name} backend's buffer is a {type(buf).__name__}, not a torch tensor")
    rows = buf.view(torch.uint8)
    if rows.dim() == 1:
        rows = rows.view(g.num_pages, g.page_size)
    if tuple(rows.shape) != (g.num_pages, g.page_size) or rows.stride(1) != 1:
        raise ValueError(f"backend buffer is {tuple(rows.shape)} with strides {rows.stride()}, "
                         f"expected [{g.num_pages}, {g.page_size}] rows of contiguous bytes")
    if rows.device != device:
        raise ValueError(f"the allocator's memory is on {rows.device}; the model runs on {device}")
    return rows


def kv_pool(manager: KVCacheManager, layer: int, kv: int, *, kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[num_pages, tokens_per_page, kv_heads, head_dim]`` view of one layer's K (kv=0) or V (kv=1)."""
    item = torch.empty((), dtype=dtype).element_size()
    token_bytes = kv_heads * head_dim * item
    block_tokens = manager.block_bytes // token_bytes
    if block_tokens * token_bytes != manager.block_bytes:
        raise ValueError(f"block_bytes {manager.block_bytes} is not a whole number of {token_bytes}-byte tokens")
    rows = page_rows(manager, layer, kv, device)
    if manager.page_size % item or rows.stride(0) % item:
        raise ValueError(f"pages of {manager.page_size} bytes cannot hold {dtype} elements")
    typed = rows.view(dtype)  # [num_pages, page_size // item], same page stride
    tokens_per_page = manager.blocks_per_page * block_tokens
    return typed.as_strided((manager.geometry.num_pages, tokens_per_page, kv_heads, head_dim),
                            (typed.stride(0), kv_heads * head_dim, head_dim, 1))
