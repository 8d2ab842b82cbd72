"""Public model shapes through both engine plugins' geometry and the CUDA backend, on the fake driver.

Each row is a public model's configuration (the numbers of its ``config.json``: layers, heads, KV heads,
head dimension; bf16). Without weights or a GPU:

- transformers: transformers' own continuous-batching cache sizes its sectors over ``meta`` (no memory), and
  the plugin's :meth:`CBInstall.manager_for` builds the allocator on the page
  :meth:`KvcachedPagedAttentionCache.page_size_for` picks (the least multiple of 2 MiB and a sector: most are no
  power of two), on the CUDA backend;
- vLLM: a ``KVCacheConfig`` as vLLM builds it (16-token blocks, each rank's share of the KV heads, sliding-window
  layers in a group of their own, MLA's one latent buffer) goes through the plugin's :func:`kv_layout`; where a
  block does not tile the default 2 MiB page, the page the plugin's message names is used; then the scheduler's
  allocator broadcasts to one in-process rank worker per GPU (:func:`start_worker`), each on the CUDA backend.

Every row constructs, maps blocks over several page ids in every rank, unmaps, closes, and the fake driver saw
no refused call and holds nothing. With the page size passed as the reserve's alignment, every row whose page
is no power of two fails here at ``cuMemAddressReserve``.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from fake_cuda import FakeDriver, MiB

from kvcached_core import KVCacheManager
from kvcached_core.backends.cuda import CudaBackend
from kvcached_core.settings import PAGE_GRAIN

BLOCKS_PER_ROW = 200  # transformers' sectors and the allocator's size: at least three pages of every row
VLLM_BLOCK_TOKENS = 16  # vLLM's default --block-size on a GPU
VLLM_NUM_BLOCKS = 4096
BF16 = 2


@dataclass(frozen=True)
class Shape:
    """One public model: its config class (transformers) and the numbers of its config.json."""

    name: str
    config_class: str
    config: dict[str, Any]
    tp: int = 1
    # the pages both plugins pick, in MiB (transformers: None where it refuses tensor parallelism)
    transformers_page_mib: int | None = None
    vllm_page_mib: int = 2

    def hf_config(self) -> Any:
        cls = getattr(transformers, self.config_class)
        config = cls(**self.config)
        config._attn_implementation = "sdpa"
        return config

    @property
    def id(self) -> str:
        return self.name if self.tp == 1 else f"{self.name}-tp{self.tp}"

    @property
    def segment(self) -> str:
        return self.id.replace(".", "_")


LLAMA_70B = dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                 intermediate_size=28672, vocab_size=128256)
SHAPES = [
    Shape("Llama-3.2-1B", "LlamaConfig", dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                                              num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                                              vocab_size=128256), transformers_page_mib=8),
    Shape("Llama-3.2-3B", "LlamaConfig", dict(num_hidden_layers=28, hidden_size=3072, num_attention_heads=24,
                                              num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                                              vocab_size=128256), transformers_page_mib=28),
    Shape("Llama-3.1-8B", "LlamaConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                              num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                                              vocab_size=128256), transformers_page_mib=32),
    Shape("Llama-3.1-70B", "LlamaConfig", LLAMA_70B, tp=4),
    Shape("Llama-3.1-70B", "LlamaConfig", LLAMA_70B, tp=8),
    Shape("Qwen2.5-7B", "Qwen2Config", dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                                            num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
          transformers_page_mib=14),
    Shape("Qwen2.5-14B", "Qwen2Config", dict(num_hidden_layers=48, hidden_size=5120, num_attention_heads=40,
                                             num_key_value_heads=8, intermediate_size=13824, vocab_size=152064),
          transformers_page_mib=48),
    Shape("Mistral-7B-v0.3", "MistralConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                                   num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                                                   vocab_size=32768, sliding_window=None),
          transformers_page_mib=32),
    # every other layer attends to a 4096-token window: two kinds of layers, two groups in vLLM
    Shape("Gemma-2-9B", "Gemma2Config", dict(num_hidden_layers=42, hidden_size=3584, num_attention_heads=16,
                                             num_key_value_heads=8, head_dim=256, intermediate_size=14336,
                                             vocab_size=256000, sliding_window=4096),
          transformers_page_mib=42),
    # no grouped-query attention: 32 KV heads of 96, a vLLM block of 192 KiB does not tile 2 MiB
    Shape("Phi-3-mini-4k", "Phi3Config", dict(num_hidden_layers=32, hidden_size=3072, num_attention_heads=32,
                                              num_key_value_heads=32, intermediate_size=8192, vocab_size=32064),
          transformers_page_mib=96, vllm_page_mib=6),
    # DeepSeek-V2-Lite: MLA, one latent KV buffer per layer of kv_lora_rank 512 + rope 64
    Shape("DeepSeek-V2-Lite", "DeepseekV2Config", dict(
        num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, vocab_size=102400), transformers_page_mib=486, vllm_page_mib=18),
]
ROWS = pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])


@pytest.fixture
def fake(fake_cuda: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """The fake driver, with the default page size and no device budget from the environment."""
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "2")
    monkeypatch.delenv("KVCACHED_DEVICE_BUDGET", raising=False)
    return fake_cuda


def use_pages(manager: KVCacheManager, backends: list[CudaBackend], fake: FakeDriver, blocks: int) -> set[int]:
    """Allocate ``blocks`` blocks, check every page they lie on is backed in every rank, free them, trim."""
    ids = manager.alloc(blocks)
    assert ids is not None
    pages = {block // manager.blocks_per_page for block in ids}
    for backend in backends:
        for page in pages:
            for s in range(backend.slices):
                assert fake.accessible(backend._addr(page, s), backend.slice_bytes), (backend.device, page, s)
    manager.free(ids)
    manager.trim()
    return pages


def assert_clean(fake: FakeDriver) -> None:
    assert fake.refused == [], fake.refused[:3]
    assert (fake.live_handles, fake.allocated_bytes, fake.mapped_bytes, fake.reserved_bytes) == (0, 0, 0, 0)
    assert (fake.live_events, fake.retained_contexts) == (0, 0)


# -- transformers ---------------------------------------------------------------------------------
def transformers_cache(config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin's cache object with transformers' own sizing run over ``meta`` (no memory)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache as upstream
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from kvcached_transformers.cb.paged import KvcachedPagedAttentionCache

    # transformers checks its sizing against the host's memory; here only the geometry matters
    monkeypatch.setattr(upstream.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 50)
    cache = object.__new__(KvcachedPagedAttentionCache)  # the plugin's __init__ would map pages through torch
    cb_config = ContinuousBatchingConfig(num_blocks=BLOCKS_PER_ROW, max_batch_tokens=256, max_requests_per_batch=4,
                                         max_memory_percent=0.9)
    upstream.PagedAttentionCache.__init__(cache, config, cb_config, device="meta",
                                          distributed_helper=DistributedHelper(None, None), dtype=torch.bfloat16)
    return cache


@ROWS
def test_transformers_continuous_batching_starts_every_shape(shape: Shape, fake: FakeDriver,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcached_transformers.cb import CBInstall
    from kvcached_transformers.cb.paged import KvcachedPagedAttentionCache

    config = shape.hf_config()
    install = CBInstall(SimpleNamespace(config=config), name=f"tf-{shape.segment}", num_blocks=None, min_bytes=None,
                        priority=None)
    if shape.tp > 1:  # the plugin serves one process: it says so before touching memory
        with pytest.raises(ValueError, match="not tensor parallelism"):
            KvcachedPagedAttentionCache(install, device="cuda:0", distributed_helper=SimpleNamespace(tp_size=shape.tp))
        assert fake.calls == {} and shape.transformers_page_mib is None
        return
    cache = transformers_cache(config, monkeypatch)
    manager = install.manager_for(cache, cache.num_sectors + 2, torch.device("cuda", 0))  # + the two trash sectors
    try:
        backend = manager.backend
        assert isinstance(backend, CudaBackend)
        # the plugin's rule: the least multiple of the 2 MiB page and a sector. The table's page is checked where the
        # sector is one transformers 5.x lays out alike; an MLA sector differs between 5.19 (54 MiB pages, seen on the
        # H100) and later 5.x (486 MiB).
        assert manager.page_size == math.lcm(2 * MiB, cache.bytes_per_sector)
        if shape.vllm_page_mib != 18:  # not the MLA row
            assert manager.page_size == shape.transformers_page_mib * MiB
        assert manager.page_size % cache.bytes_per_sector == 0 and manager.page_size % PAGE_GRAIN == 0
        pages = use_pages(manager, [backend], fake, min(manager.num_blocks, 3 * manager.blocks_per_page))
        assert len(pages) >= min(3, manager.geometry.num_pages)
    finally:
        manager.close()
    assert_clean(fake)


# -- vLLM -----------------------------------------------------------------------------------------
# vLLM's KV cache configuration objects, as far as the plugin reads them (kvcached_vllm.seams lists the members).
# The plugin tells the specs apart by class name; page_size_bytes is vLLM's: a block of K and V (full attention,
# sliding window) or of one latent vector (MLA).
@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int = BF16
    page_size_padded: int | None = None

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


def vllm_config(shape: Shape, config: Any) -> Any:
    """The KVCacheConfig vLLM builds for ``config`` on one of ``shape.tp`` ranks (layer-outermost, the groups
    overlaying each other from byte 0, as vLLM's get_kv_cache_config_from_groups lays them out)."""
    layers = config.num_hidden_layers
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    if getattr(config, "kv_lora_rank", None):
        groups = [(MLAAttentionSpec(VLLM_BLOCK_TOKENS, 1, config.kv_lora_rank + config.qk_rope_head_dim), names)]
    else:
        heads = max(1, config.num_key_value_heads // shape.tp)
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * layers
        full = [n for n, kind in zip(names, kinds, strict=True) if kind == "full_attention"]
        sliding = [n for n, kind in zip(names, kinds, strict=True) if kind == "sliding_attention"]
        groups = [(FullAttentionSpec(VLLM_BLOCK_TOKENS, heads, head), full)]
        if sliding:
            window = SlidingWindowSpec(VLLM_BLOCK_TOKENS, heads, head, sliding_window=config.sliding_window)
            groups.insert(0, (window, sliding))
    page = max(spec.page_size_bytes for spec, _ in groups)
    slots = max(len(group) for _, group in groups)
    tensors = [SimpleNamespace(size=slots * VLLM_NUM_BLOCKS * page, layers=group, offset=0,
                               layer_stride=VLLM_NUM_BLOCKS * page, block_stride=spec.page_size_bytes)
               for spec, group in groups]
    return SimpleNamespace(num_blocks=VLLM_NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_layout="NHD",
                           kv_cache_groups=[SimpleNamespace(layer_names=group, kv_cache_spec=spec)
                                            for spec, group in groups])


def vllm_layout(kv_cache_config: Any) -> Any:
    """The plugin's layout at the default 2 MiB page; where it refuses, at the page size its message names."""
    from kvcached_vllm.geometry import UnsupportedLayout, kv_layout

    try:
        return kv_layout(kv_cache_config, page_size=2 * MiB)
    except UnsupportedLayout as exc:
        named = re.search(r"KVCACHED_PAGE_SIZE_MB=(\d+) ", str(exc))
        assert named, exc
        return kv_layout(kv_cache_config, page_size=int(named.group(1)) * MiB)


@ROWS
def test_vllm_starts_every_shape_on_every_rank(shape: Shape, fake: FakeDriver) -> None:
    from kvcached_vllm.worker_side import close_workers, start_worker

    fake.device_count = shape.tp
    config = shape.hf_config()
    kv = vllm_layout(vllm_config(shape, config))
    assert kv.page_size == shape.vllm_page_mib * MiB
    assert kv.page_size % kv.block_bytes == 0 and kv.page_size == math.lcm(kv.block_bytes, PAGE_GRAIN, 2 * MiB)
    paths = [os.path.join(tempfile.mkdtemp(prefix="kvc-shapes-"), f"rank{r}.sock") for r in range(shape.tp)]
    workers = [start_worker(path, rank, kv, torch.device("cuda", rank)) for rank, path in enumerate(paths)]
    try:
        backends = [w.backend for w in workers]
        assert all(isinstance(b, CudaBackend) and b.device == rank for rank, b in enumerate(backends))
        manager = KVCacheManager(  # as the plugin's scheduler builds it (kvcached_vllm.install._build_manager)
            f"vllm-{shape.segment}", num_blocks=kv.num_blocks, block_bytes=kv.block_bytes, num_layers=kv.num_layers,
            num_kv_buffers=1, page_size=kv.page_size, backend="cuda", engine="vllm", block_tokens=kv.block_tokens,
            tp_world=shape.tp, tp_workers=paths)
        try:
            pages = use_pages(manager, backends, fake, 3 * kv.blocks_per_page)
            assert len(pages) >= 3
        finally:
            manager.close()
    finally:
        close_workers()
        for path in paths:
            os.rmdir(os.path.dirname(path))
    assert_clean(fake)
