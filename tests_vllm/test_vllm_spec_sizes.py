"""tests/test_model_shapes.py builds vLLM's KV cache specs without vLLM: here its page sizes are vLLM's own.

For every shape of that table, vLLM's spec classes built from the same numbers must give the same
``page_size_bytes`` as the stand-ins there, and the plugin's ``kv_layout`` the same layout.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

ROOT = Path(__file__).resolve().parents[1]


def _shapes_module() -> Any:
    sys.path.insert(0, str(ROOT / "tests"))  # the table imports its neighbour fake_cuda
    spec = importlib.util.spec_from_file_location("model_shapes_table", ROOT / "tests" / "test_model_shapes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TABLE = _shapes_module()
VLLM_SPECS = {"FullAttentionSpec": FullAttentionSpec, "SlidingWindowSpec": SlidingWindowSpec,
              "MLAAttentionSpec": MLAAttentionSpec}


def vllms_own(stand_in: Any) -> Any:
    kwargs: dict[str, Any] = dict(block_size=stand_in.block_size, num_kv_heads=stand_in.num_kv_heads,
                                  head_size=stand_in.head_size, dtype=torch.bfloat16)
    if type(stand_in).__name__ == "SlidingWindowSpec":
        kwargs["sliding_window"] = stand_in.sliding_window
    return VLLM_SPECS[type(stand_in).__name__](**kwargs)


@pytest.mark.parametrize("shape", TABLE.SHAPES, ids=[s.id for s in TABLE.SHAPES])
def test_the_tables_stand_ins_have_vllms_page_sizes(shape: Any) -> None:
    config = TABLE.vllm_config(shape, shape.hf_config())
    for group in config.kv_cache_groups:
        stand_in = group.kv_cache_spec
        assert vllms_own(stand_in).page_size_bytes == stand_in.page_size_bytes, (shape.id, stand_in)
        group.kv_cache_spec = vllms_own(stand_in)
    assert TABLE.vllm_layout(config).page_size == shape.vllm_page_mib << 20
