"""The transformers versions whose continuous batching the plug-in serves, and the seams it uses there.

The plug-in wraps internals of ``transformers.generation.continuous_batching``, which change between
releases: each seam is checked (present, with the parameters used) before anything is patched, and
any transformers outside :data:`SUPPORTED` is refused in one line.

Seams (module ``continuous_api`` unless named):

- ``ContinuousBatchingManager._create_batch_processor(self)``: builds the paged cache, scheduler and
  processor; wrapped so a model given to :func:`~kvcached_transformers.cb.install` gets a
  :class:`~.paged.KvcachedPagedAttentionCache`, built through the module's ``PagedAttentionCache`` name.
- ``ContinuousBatchingManager._run_generation_loop`` and ``stop``: the loop's end withdraws the sleep
  handler; a stop that drops the processor gives every sector back.
- ``ContinuousBatchProcessor.prepare_next_batch(self)``: called before every step and every 0.1 s while
  idle, on the loop's thread: where sleep, wake, limits and traffic are served (:mod:`.loop`).
- ``cache.PagedAttentionCache``: ``__init__`` (its sizing runs unchanged over a ``meta`` tensor),
  ``can_store_request_tokens``, ``compute_free_capacity``, ``evict_cached_blocks``, ``free_all_requests``.
- ``cache_allocators``: ``CachePool`` (sector and block bookkeeping), ``CacheAllocator.register_cache_tensor``
  and its trash indices.
- ``offloading_manager.OffloadingManager.offload_requests(self)``.
- ``scheduler.Scheduler.schedule_batch(self, token_budget, cache_budget)``: the read budget passed is the capacity.
- ``input_outputs.ContinuousBatchingIOs.prepare_batch_tensors``, and the ``attention_mask`` and
  ``read_index_storage`` buffers it fills (sized by ``PagedAttentionCache.max_tokens_read``): the read window
  (:mod:`.window`).
"""

from __future__ import annotations

import inspect
from typing import Any

from packaging.version import Version

SUPPORTED = (Version("5.19"), Version("5.26"))  # [low, high): 5.19 (the GPU machine's wheel) to 5.25 (the main venv)


class UnsupportedTransformers(RuntimeError):
    """The installed transformers is outside :data:`SUPPORTED`, or one of its seams is not as expected."""


def supported_text() -> str:
    low, high = SUPPORTED
    return f">={low},<{high}"


def check_version(found: str) -> None:
    """Refuse a transformers outside :data:`SUPPORTED` in one line."""
    version = Version(found)
    low, high = SUPPORTED
    if not low <= Version(version.base_version) < high:
        raise UnsupportedTransformers(
            f"kvcached's continuous batching supports transformers {supported_text()}, found {found}: "
            f"install 'transformers{supported_text()}'")


# (module, attribute path, parameters the plug-in passes or reads, in order after self)
_SEAMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("continuous_api", "ContinuousBatchingManager._create_batch_processor", ()),
    ("continuous_api", "ContinuousBatchingManager._run_generation_loop", ()),  # (use_inference_mode) from 5.2x
    ("continuous_api", "ContinuousBatchingManager.stop", ("block", "timeout", "keep_for_next_session", "hard_stop")),
    ("continuous_api", "ContinuousBatchProcessor.prepare_next_batch", ()),
    ("continuous_api", "PagedAttentionCache", ()),
    ("cache", "PagedAttentionCache.__init__", ("config", "continuous_batching_config", "device",
                                               "distributed_helper", "dtype", "model_supports_logits_to_keep")),
    ("cache", "PagedAttentionCache.can_store_request_tokens", ("state", "request_len", "dry_run")),
    ("cache", "PagedAttentionCache.compute_free_capacity", ("relative",)),
    ("cache", "PagedAttentionCache.evict_cached_blocks", ()),
    ("cache", "PagedAttentionCache.free_all_requests", ("clear_ledgers",)),
    ("cache_allocators", "CachePool.__init__", ("num_sectors", "num_allocators", "num_reserved_sectors")),
    ("cache_allocators", "CachePool.free_blocks", ("index", "block_ids")),
    ("cache_allocators", "CachePool.try_to_free_sectors", ()),
    ("cache_allocators", "CachePool.allocate_sector", ("index",)),
    ("cache_allocators", "CachePool.set_blocks_per_sector", ("index", "blocks_per_sector")),
    ("cache_allocators", "CacheAllocator.register_cache_tensor", ("bytes_per_sector", "non_trash_bytes",
                                                                  "cache_tensor", "pool")),
    ("cache_allocators", "CacheAllocator.needs_new_sectors", ("request_id", "past_length", "query_length")),
    ("cache_allocators", "CacheAllocator.allocate_cache_to_request", ("request_id", "past_length", "query_length")),
    ("offloading_manager", "OffloadingManager.offload_requests", ()),
    ("scheduler", "Scheduler.schedule_batch", ("token_budget", "cache_budget")),
    ("input_outputs", "ContinuousBatchingIOs.prepare_batch_tensors", ("requests_in_batch", "logits_processors",
                                                                      "use_decode_fast_path", "num_q_tokens",
                                                                      "max_kv_read", "use_padding")),
)
# (module, class, attributes its source must set): the allocators' trash indices, the IO buffers the window resizes
_ATTRIBUTES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("cache_allocators.cache_allocator", "CacheAllocator", ("read_trash_index", "sentinel_index", "write_trash_index")),
    ("input_outputs", "ContinuousBatchingIOs", ("attention_mask", "read_index_storage", "write_index_storage")),
)


def check_seams() -> None:
    """Every seam present with the parameters used; raises :class:`UnsupportedTransformers` naming the first that is not."""
    from importlib import import_module

    base = "transformers.generation.continuous_batching"
    for module_name, path, params in _SEAMS:
        where = f"{base}.{module_name}.{path}"
        try:
            obj: Any = import_module(f"{base}.{module_name}")
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise UnsupportedTransformers(f"transformers lacks {where} ({exc}); supported: {supported_text()}") from None
        if params:
            found = [p for p in inspect.signature(obj).parameters if p != "self"]
            if found[:len(params)] != list(params):
                raise UnsupportedTransformers(f"transformers' {where} takes {found}, expected {list(params)} first; "
                                              f"supported: {supported_text()}")
    for module_name, cls, names in _ATTRIBUTES:
        source = inspect.getsource(getattr(import_module(f"{base}.{module_name}"), cls))
        missing = [name for name in names if f"self.{name} =" not in source]
        if missing:
            raise UnsupportedTransformers(f"transformers' {cls} no longer sets {missing}; supported: {supported_text()}")


def check() -> None:
    """The version, then the seams."""
    import transformers

    check_version(transformers.__version__)
    check_seams()
