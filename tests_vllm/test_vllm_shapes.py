"""Model shapes beyond one group of full-attention layers: sliding-window layers beside full ones, and MLA.

Real offline vLLM engines on tiny random models built here: with the plugin, the greedy tokens and
each token's log-probability are plain vLLM's. The shapes kvcached cannot place are refused with
one message that names them (vLLM's own spec objects, no engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvcached_vllm.geometry import UnsupportedLayout, kv_layout
from kvcached_vllm.tiny import build_tiny_llama, build_tiny_mla, prompts

from .harness import base_env, run_offline

MiB = 1 << 20
# Longer than the window (the sliding layers drop their oldest blocks), and more than one page of MLA blocks.
PROMPTS = prompts(12, length=900, seed=5)
TOKENS = 32
WINDOW = 256


@pytest.mark.parametrize("shape", ["sliding window", "MLA"])
def test_the_plugin_serves_the_shape_with_plain_vllms_tokens(shape: str, workdir: Path) -> None:
    key = shape.replace(" ", "-").lower()
    extra: dict[str, str] = {}
    if shape == "MLA":
        model = build_tiny_mla(workdir / "tiny-mla")
        extra["KVCACHED_PAGE_SIZE_MB"] = "18"  # whole 36 KiB blocks (build_tiny_mla says why)
        # vLLM's CPU MLA differs run to run when its worker is a process of its own (two plain runs: logprobs up
        # to 0.23 apart, other tokens); in one process it is the same to the bit, run after run.
        extra["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        model = build_tiny_llama(workdir / "tiny-sliding", sliding_window=WINDOW)
    runs = {}
    for enabled in (False, True):
        shm = workdir / f"shm-{key}-{'on' if enabled else 'off'}"
        shm.mkdir()
        env = base_env(shm, enabled=enabled, **extra)
        runs[enabled] = run_offline(model, env, PROMPTS, TOKENS, workdir / f"{key}-{enabled}.json", logprobs=True)
    plain, ours = runs[False], runs[True]
    assert plain["models"] == []
    assert ours["tokens"] == plain["tokens"]
    for mine, theirs in zip(ours["logprobs"], plain["logprobs"], strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
    (seen,) = ours["models"]
    assert seen["engine"] == "vllm" and seen["backend"] == "host"
    # two ranges: the sliding model's two groups overlay each other (2 + 2 layers), the MLA model has 2 layers
    assert seen["num_layers"] == 2
    assert seen["page_size"] == (18 if shape == "MLA" else 2) * MiB
    # each KV cache group, as the idle engine left it: no active block; between them the allocator's cached ones
    # (every block but the placeholder), each group's on the pages it says
    groups = seen["groups"]
    expected = [("MLA", None, 2)] if shape == "MLA" else [("sliding window", WINDOW, 2), ("full attention", None, 2)]
    assert [(g["shape"], g["window"], g["layers"]) for g in groups] == expected
    assert all(g["blocks_active"] == 0 and (g["pages"] > 0) == (g["blocks_cached"] > 0) for g in groups), groups
    assert sum(g["blocks_cached"] for g in groups) == seen["blocks_cached"] == seen["blocks_used"] - 1, seen


# -- kv_layout on vLLM's own configuration objects ------------------------------------------------
def full(block: int = 16, heads: int = 2, head: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=torch.float32)


def config(groups: list[tuple[object, list[str]]], num_blocks: int = 1024) -> KVCacheConfig:
    """vLLM's layer-outermost layout for ``groups`` (as get_kv_cache_config_from_groups builds it): the groups
    overlay each other from byte 0, the ``i``-th layer of every group in the ``i``-th region."""
    specs = [KVCacheGroupSpec(names, spec) for spec, names in groups]  # type: ignore[arg-type]
    page = max(spec.page_size_bytes for spec, _ in groups)  # type: ignore[attr-defined]
    slots = max(len(names) for _, names in groups)
    tensors = [KVCacheTensor(size=slots * num_blocks * page, layers=names, layer_stride=num_blocks * page,
                             block_stride=spec.page_size_bytes)  # type: ignore[attr-defined]
               for spec, names in groups]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=specs)


def test_sliding_window_groups_overlay_full_ones_in_two_ranges() -> None:
    sliding = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                sliding_window=WINDOW)
    layout = kv_layout(config([(sliding, ["l0", "l2"]), (full(), ["l1", "l3"])]))
    assert layout.layer_names == ("l0", "l2", "l1", "l3")
    assert [layout.slot(i) for i in range(4)] == [0, 1, 0, 1]
    assert layout.num_layers == 2 and layout.geometry.num_layers == 2
    assert layout.describe() == f"2 groups: sliding window {WINDOW} (2 layers), full attention (2 layers)"


def test_one_group_keeps_a_range_per_layer() -> None:
    layout = kv_layout(config([(full(), ["a", "b", "c"])]))
    assert layout.slots == () and layout.num_layers == 3 and layout.block_tokens == 16


def test_mla_blocks_name_the_page_size_that_holds_them() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    with pytest.raises(UnsupportedLayout, match="KVCACHED_PAGE_SIZE_MB=18 "):
        kv_layout(config([(mla, ["a", "b"])]), page_size=2 * MiB)
    assert kv_layout(config([(mla, ["a", "b"])]), page_size=18 * MiB).blocks_per_page == 512


def test_a_mamba_group_is_refused_by_name() -> None:
    mamba = MambaSpec(shapes=((4, 64),), dtypes=(torch.float32,), block_size=16)
    with pytest.raises(UnsupportedLayout) as caught:
        kv_layout(config([(full(), ["a"]), (mamba, ["m"])]))
    message = str(caught.value)
    assert "MambaSpec" in message and "full attention, sliding window, MLA" in message
    assert "\n" not in message and "ENABLE_KVCACHED" in message


def test_groups_with_pages_of_different_sizes_are_refused() -> None:
    with pytest.raises(UnsupportedLayout, match="pages of different sizes"):
        kv_layout(config([(full(head=64), ["a"]), (full(head=128), ["b"])]))
