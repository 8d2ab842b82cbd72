"""transformers' own continuous batching with its paged KV cache on kvcached.

``generate_batch``, ``init_continuous_batching`` and the manager behind ``transformers serve`` keep
working as they are; a model passed to :func:`install` gets its cache's memory from a
:class:`~kvcached_core.KVCacheManager` (host pages on CPU, the CUDA backend on a GPU)::

    from kvcached_transformers import cb
    handle = cb.install(model, name="llama", num_blocks=64)   # num_blocks: the most it may grow to
    out = model.generate_batch(prompts, generation_config=gen)  # or cb.generate_batch(model, prompts, ...)
    handle.close()

The model then shows in ``kvctl list`` and kvtop from its first batch until ``close``; ``kvctl limit``,
``trim``, ``sleep``/``wake`` and reclaims between models act on it (see :mod:`.loop`). Its attention buffers follow
what each batch reads, not the capacity (:mod:`.window`); on a GPU its working memory is registered with the allocator
(:mod:`.working`). Supported
transformers: :data:`.seams.SUPPORTED` (others are refused in one line, :class:`UnsupportedTransformers`).
"""

from __future__ import annotations

import atexit
import functools
import threading
from typing import TYPE_CHECKING, Any

from kvcached_core import KVCacheManager
from kvcached_core.engines import ENGINE_LINGER_S

from .seams import SUPPORTED, UnsupportedTransformers, check, supported_text

if TYPE_CHECKING:
    import torch

    from .loop import LoopControl, Traffic
    from .paged import KvcachedPagedAttentionCache
    from .stats import AdmissionStats
    from .working import WorkingMemory

_ATTR = "_kvcached_cb"  # the model attribute that holds its CBInstall
_context = threading.local()  # the install whose cache is being built on this thread
_patched = False
_INSTALLS: list[CBInstall] = []
_every_model: dict[str, Any] | None = None  # install_all's arguments: every model's manager goes on kvcached


class CBInstall:
    """One model's continuous batching on kvcached: its allocator (kept across batches) and the live loop."""

    def __init__(self, model: Any, *, name: str | None, num_blocks: int | None, min_bytes: int | None,
                 priority: int | None, max_read_tokens: int | None = None) -> None:
        for label, value in (("num_blocks", num_blocks), ("max_read_tokens", max_read_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        self.model = model
        self.label = str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        self.name = name
        self.num_blocks = num_blocks
        self.max_read_tokens = max_read_tokens
        self.min_bytes, self.priority = min_bytes, priority
        self.manager: KVCacheManager | None = None
        self.loops: list[LoopControl] = []
        self.caches: list[KvcachedPagedAttentionCache] = []
        self._traffic: tuple[KVCacheManager, Traffic] | None = None  # the counters of the open allocator
        self.working: WorkingMemory | None = None  # on a GPU, from the first cache on

    def manager_for(self, cache: KvcachedPagedAttentionCache, num_sectors: int, device: torch.device) -> KVCacheManager:
        """The allocator for a cache of ``num_sectors`` sectors on ``device``; the one already open when it fits."""
        backend = "cuda" if device.type == "cuda" else "host"
        manager = self.manager
        if manager is not None and not manager._closed and (
                manager.block_bytes, manager.num_blocks, manager.backend.name) == (
                cache.bytes_per_sector, num_sectors, backend) and not self.caches:
            return manager
        if self.caches:
            raise RuntimeError(f"{self.name or self.label}: a continuous batching cache is already live on it")
        if manager is not None:
            manager.close()
        self.manager = KVCacheManager(
            self.label, num_blocks=num_sectors, block_bytes=cache.bytes_per_sector, num_layers=1, num_kv_buffers=1,
            page_size=cache.page_size_for(cache.bytes_per_sector), backend=backend,
            device=(device.index or 0) if device.type == "cuda" else 0, engine="transformers",
            block_tokens=cache.tokens_per_sector_full, name=self.name, min_bytes=self.min_bytes,
            priority=self.priority, refill_linger_s=ENGINE_LINGER_S,
        )
        return self.manager

    def measure_working_memory(self, device: torch.device) -> None:
        """From the first cache on a GPU on, the engine's working memory is measured (:mod:`.working`)."""
        if self.working is None and device.type == "cuda":
            from .working import WorkingMemory

            self.working = WorkingMemory(device)

    def attach(self, cb_manager: Any, processor: Any) -> None:
        from .loop import LoopControl, Traffic
        from .paged import KvcachedPagedAttentionCache

        cache = processor.cache
        if not isinstance(cache, KvcachedPagedAttentionCache):
            return
        for lc in self.loops:
            if lc.processor is processor:  # a processor kept for the next session: its loop runs again
                lc.attach_handlers()
                return
        if cache not in self.caches:
            self.caches.append(cache)
        if self._traffic is None or self._traffic[0] is not cache.kv_manager:
            self._traffic = (cache.kv_manager, Traffic())
        self.loops.append(LoopControl(cb_manager, processor, self._traffic[1], self.working))

    def loop_ended(self, processor: Any) -> None:
        for lc in self.loops:
            if lc.processor is processor:
                lc.detach()

    def dropped(self, processor: Any) -> None:
        """The processor is gone (a stop not kept for the next session): its sectors go back to kvcached."""
        for lc in [lc for lc in self.loops if lc.processor is processor]:
            lc.detach()
            self.loops.remove(lc)
            cache = lc.cache
            if cache in self.caches:
                if not cache.kv_manager._closed:
                    cache.release_all()
                self.caches.remove(cache)

    @property
    def stats(self) -> AdmissionStats:
        """The open allocator's admission counters (:class:`~.stats.AdmissionStats`, a copy): requests per step, passes
        in which each gate held a waiting request back, bytes claimed but unused. Zeros before the first batch."""
        from .stats import AdmissionStats

        traffic = self._traffic
        return traffic[1].admission.copy() if traffic is not None else AdmissionStats()

    @property
    def working_memory(self) -> tuple[int, int] | None:
        """On a GPU, the engine's working memory ``(peak, now)`` in bytes since its first cache (:mod:`.working`), as
        registered with the allocator at every step (``KVCacheManager.register_working_memory``); None on CPU or
        before the first batch."""
        return None if self.working is None else self.working.figures()

    @property
    def segment(self) -> str | None:
        """The segment's name (``kvctl list``), once the first batch made the allocator."""
        return None if self.manager is None else self.manager.name

    def close(self) -> None:
        """Give back every page and remove the segment; the model runs plain transformers afterwards."""
        for lc in list(self.loops):
            self.dropped(lc.processor)
        if self.manager is not None:
            self.manager.close()
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)
        if self in _INSTALLS:
            _INSTALLS.remove(self)

    def __enter__(self) -> CBInstall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install(model: Any, *, name: str | None = None, num_blocks: int | None = None, min_bytes: int | None = None,
            priority: int | None = None, max_read_tokens: int | None = None) -> CBInstall:
    """Put ``model``'s continuous batching cache on kvcached; returns the handle (``close()`` to undo).

    ``name``: the segment's name (default: from the model's name). ``num_blocks``: the cache's capacity in
    transformers' blocks of ``page_size`` tokens (``ContinuousBatchingConfig.num_blocks``, used when the config
    leaves it unset): address space, mapped only as requests use it. ``min_bytes``/``priority``: the memory
    policy between models (``kvctl policy``). ``max_read_tokens``: the most cached tokens one batch reads (default: the
    capacity, as transformers), which bounds the attention's working memory whatever the model holds; a request that
    alone reads more still runs, in a batch of its own reads (:mod:`.window`). Raises :class:`UnsupportedTransformers`
    outside :data:`SUPPORTED`.
    """
    check()
    _patch()
    previous = getattr(model, _ATTR, None)
    if isinstance(previous, CBInstall):
        previous.close()
    handle = CBInstall(model, name=name, num_blocks=num_blocks, min_bytes=min_bytes, priority=priority,
                       max_read_tokens=max_read_tokens)
    setattr(model, _ATTR, handle)
    _INSTALLS.append(handle)
    return handle


def install_all(*, num_blocks: int | None = None, max_read_tokens: int | None = None) -> None:
    """Every model whose continuous batching starts from now on in this process goes on kvcached (its segment named
    after the model), as :func:`install` would; for code that loads the model itself, such as ``transformers serve``
    (docs/engines.md gives the command line)."""
    global _every_model
    check()
    _patch()
    _every_model = {"num_blocks": num_blocks, "max_read_tokens": max_read_tokens}


def uninstall_all() -> None:
    """Undo :func:`install_all` (models already installed keep their handles)."""
    global _every_model
    _every_model = None


def generate_batch(model: Any, inputs: list[list[int]], *, name: str | None = None, num_blocks: int | None = None,
                   **kwargs: Any) -> dict[str, Any]:
    """``model.generate_batch(inputs, **kwargs)`` on kvcached; the segment stays until the model's handle closes
    (``model._kvcached_cb.close()``, or at exit)."""
    handle = getattr(model, _ATTR, None)
    if not isinstance(handle, CBInstall):
        handle = install(model, name=name, num_blocks=num_blocks)
    return dict(model.generate_batch(inputs, **kwargs))


def installed(model: Any) -> CBInstall | None:
    """The model's handle, if :func:`install` was called on it."""
    handle = getattr(model, _ATTR, None)
    return handle if isinstance(handle, CBInstall) else None


def _patch() -> None:
    """Wrap transformers' seams once per process (see :mod:`.seams`); a model without a handle runs as before."""
    global _patched
    if _patched:
        return
    from transformers.generation.continuous_batching import continuous_api

    from .paged import KvcachedPagedAttentionCache

    manager_cls = continuous_api.ContinuousBatchingManager
    original_create = manager_cls._create_batch_processor
    original_loop = manager_cls._run_generation_loop
    original_stop = manager_cls.stop
    plain_cache = continuous_api.PagedAttentionCache

    def paged_cache(**kwargs: Any) -> Any:
        handle = getattr(_context, "install", None)
        if handle is None:
            return plain_cache(**kwargs)
        _context.install = None  # one cache per processor
        return KvcachedPagedAttentionCache(handle, **kwargs)

    @functools.wraps(original_create)
    def create_batch_processor(self: Any) -> Any:
        handle = installed(self.model)
        if handle is None and _every_model is not None:
            handle = install(self.model, **_every_model)
        if handle is None:
            return original_create(self)
        if handle.num_blocks is not None and self.continuous_batching_config.num_blocks is None:
            self.continuous_batching_config.num_blocks = handle.num_blocks
        _context.install = handle
        try:
            processor = original_create(self)
        finally:
            _context.install = None
        handle.attach(self, processor)
        return processor

    @functools.wraps(original_loop)
    def run_generation_loop(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original_loop(self, *args, **kwargs)
        finally:
            handle = installed(self.model)
            if handle is not None and self.batch_processor is not None:
                handle.loop_ended(self.batch_processor)

    @functools.wraps(original_stop)
    def stop(self: Any, *args: Any, **kwargs: Any) -> None:
        processor = self.batch_processor
        original_stop(self, *args, **kwargs)
        handle = installed(self.model)
        if handle is not None and processor is not None and self.batch_processor is None:
            handle.dropped(processor)

    continuous_api.PagedAttentionCache = paged_cache  # type: ignore[misc,assignment]
    manager_cls._create_batch_processor = create_batch_processor  # type: ignore[method-assign]
    manager_cls._run_generation_loop = run_generation_loop  # type: ignore[method-assign]
    manager_cls.stop = stop  # type: ignore[method-assign]
    atexit.register(_close_all)
    _patched = True


def _close_all() -> None:
    for handle in list(_INSTALLS):
        handle.close()


__all__ = ["SUPPORTED", "CBInstall", "UnsupportedTransformers", "generate_batch", "install", "install_all",
           "installed", "supported_text", "uninstall_all"]
