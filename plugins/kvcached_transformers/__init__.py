"""kvcached for Hugging Face transformers: a ``Cache`` whose K/V live in KVCacheManager blocks.

Importing this package stays cheap (it names the plugin for ``kvcached.engines``); torch and
transformers load when one of the exported names is first used::

    from kvcached_transformers import PagedKVCache
    cache = PagedKVCache.for_model(model, name="my-model")
    out = model.generate(input_ids, attention_mask=mask, **cache_arg(model, cache), max_new_tokens=32)
    cache.close()
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from kvcached_core.engines import EngineInfo, KVCacheExhausted

ENGINE = EngineInfo(
    name="transformers",
    summary="Hugging Face transformers 5.x Cache over kvcached blocks, and a greedy engine with ragged batching",
    modules=("torch", "transformers"),
    cache="kvcached_transformers.cache:PagedKVCache",
    example="python examples/generate.py",
    extras=("transformers",),
)

_LAZY = {
    "PagedKVCache": ".cache", "StepPlan": ".cache",
    "GreedyEngine": ".engine", "Request": ".engine", "generate": ".engine", "unpad": ".engine",
    "tiny_llama": ".tiny", "tiny_llama_config": ".tiny", "random_prompts": ".tiny",
    "kv_pool": ".pools",
    "cache_arg": ".compat", "cache_keyword": ".compat",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENGINE", "KVCacheExhausted", *_LAZY]
