"""Install the integration into vLLM's classes in this process (idempotent).

vLLM loads the plugin in every process it starts, before the objects patched here exist:
the main process, EngineCore (scheduler and block pool) and each worker (KV tensors). Each
patch is a thin wrapper around vLLM's own function, so the same process can still build a
plain vLLM object where the plugin does not apply (another pool, a profiling run).

- ``Scheduler.__init__``: remembers the engine's config while the scheduler builds its
  KV cache coordinator, whose ``BlockPool`` is then a :class:`KvcachedBlockPool`.
- ``KVCacheManager.allocate_slots``: a :class:`NoRoom` from the pool becomes ``None``, vLLM's
  "cannot allocate" (the scheduler queues or preempts), with nothing half-allocated; a waiting
  request is admitted against what a shared budget leaves beside one block per running request.
- ``Scheduler.update_from_output``: traffic is counted (:mod:`.traffic`), and requests that can
  never fit under the limit end with ``length`` (:mod:`.fit`).
- ``KVCacheManager.take_kv_cache_block_copies``, ``Scheduler.schedule`` / ``update_from_output`` /
  ``has_requests``: compaction rounds ride on the steps' block copies (:mod:`.compact`).
- ``Executor.determine_available_memory``: each worker answers the span the shared budget, the headroom
  and its peers leave, and its measured working memory is registered with the allocator (:mod:`.available`).
- ``GPUModelRunner.initialize_kv_cache_tensors`` / ``allocate_kv_cache``: the worker's KV
  tensors lie over a :class:`kvcached_core.tp.TPWorker`'s memory.
- ``setup_server`` (the API server): the address it binds is published in the model's segment (:mod:`.endpoint`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from typing import Any

from kvcached_core.engines import ENGINE_LINGER_S

from . import available, endpoint
from .seams import check_vllm

log = logging.getLogger("kvcached_vllm")

_installed = False
_context = threading.local()  # the config of the engine whose scheduler or worker is being built
_MANAGERS: list[Any] = []


def install() -> None:
    """Patch vLLM in this process; raises a one-line error if a seam it patches is missing or changed (:mod:`.seams`)."""
    global _installed
    if _installed:
        return
    import vllm

    check_vllm(vllm.__version__)
    _patch_scheduler()
    _patch_engine_shutdown()
    _patch_worker()
    available.install()
    endpoint.install()
    atexit.register(_close_all)
    _installed = True
    log.info("kvcached: vLLM's KV cache goes through kvcached (pid %d)", os.getpid())


# -- scheduler side (EngineCore) --------------------------------------------------------------
def _patch_scheduler() -> None:
    from vllm.v1.core import kv_cache_coordinator, kv_cache_manager
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched import scheduler

    original_init = scheduler.Scheduler.__init__

    @functools.wraps(original_init)
    def scheduler_init(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        _context.scheduler = (vllm_config, kv_cache_config)
        try:
            original_init(self, vllm_config, kv_cache_config, *args, **kwargs)
        finally:
            _context.scheduler = None
        from .block_pool import KvcachedBlockPool
        from .geometry import kv_layout
        from .groups import Groups
        from .sleep import Sleeper
        from .traffic import Traffic

        pool = self.kv_cache_manager.block_pool
        ours = isinstance(pool, KvcachedBlockPool)
        self._kvcached_traffic = Traffic(pool.manager) if ours else None
        self._kvcached_groups = Groups(self, pool, kv_layout(kv_cache_config).groups) if ours else None
        self._kvcached_sleeper = Sleeper(self, pool) if ours else None
        self._kvcached_compactor = pool.compactor if ours else None

    def block_pool(num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, **kwargs: Any) -> BlockPool:
        pending = getattr(_context, "scheduler", None)
        if pending is None or num_gpu_blocks != pending[1].num_blocks:
            return BlockPool(num_gpu_blocks, enable_caching, hash_block_size, **kwargs)
        _context.scheduler = None  # one pool per scheduler
        from .block_pool import KvcachedBlockPool

        manager = _build_manager(*pending)
        try:
            return KvcachedBlockPool(manager, num_gpu_blocks, enable_caching, hash_block_size, **kwargs)
        except BaseException:
            manager.close()
            raise

    original_allocate = kv_cache_manager.KVCacheManager.allocate_slots

    @functools.wraps(original_allocate)
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.request import RequestStatus

        from .block_pool import KvcachedBlockPool, NoRoom

        held = any(self.coordinator.get_blocks(request.request_id))
        pool = self.block_pool
        ours = isinstance(pool, KvcachedBlockPool)
        if ours:  # a waiting request is admitted against what the running ones leave of a shared budget
            pool.admitting = request.status != RequestStatus.RUNNING
        try:
            return original_allocate(self, request, *args, **kwargs)
        except NoRoom as exc:
            log.debug("kvcached: %s; request %s waits", exc, request.request_id)
            if not held:  # blocks taken for this call only (prefix hits): give them back
                self.coordinator.free(request.request_id)
            return None
        finally:
            if ours:
                pool.admitting = False

    original_schedule = scheduler.Scheduler.schedule

    @functools.wraps(original_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        from .block_pool import KvcachedBlockPool

        pool = self.kv_cache_manager.block_pool
        if isinstance(pool, KvcachedBlockPool):  # the watermark this step's admissions keep (block_pool.py)
            pool.growth_reserve = len(self.running)
        return original_schedule(self, *args, **kwargs)

    scheduler.Scheduler.__init__ = scheduler_init
    scheduler.Scheduler.schedule = schedule
    _patch_traffic(scheduler.Scheduler)
    _patch_compact(scheduler.Scheduler)  # inside sleep's wrappers: a round is committed before sleep is served
    _patch_sleep(scheduler.Scheduler)
    _patch_groups(scheduler.Scheduler)  # outermost: counted after the step's compaction and sleep are served
    kv_cache_coordinator.BlockPool = block_pool
    kv_cache_manager.KVCacheManager.allocate_slots = allocate_slots


def _patch_traffic(cls: Any) -> None:
    """Count what the scheduler sees (see :mod:`.traffic`) and end the requests that can never fit (see
    :mod:`.fit`) after every step; a scheduler without kvcached is left alone."""
    from .fit import end_unfit
    from .traffic import waiting_blocks

    original_add = cls.add_request
    original_update = cls.update_from_output
    original_free = cls._free_request
    original_preempt = cls._preempt_request

    @functools.wraps(original_add)
    def add_request(self: Any, request: Any) -> None:
        original_add(self, request)
        traffic = self.__dict__.get("_kvcached_traffic")
        if traffic is not None:
            counts = self.get_request_counts()
            traffic.arrived(request.num_prompt_tokens, counts, waiting_blocks(self) if counts[1] else 0)

    @functools.wraps(original_update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = original_update(self, scheduler_output, model_runner_output)
        traffic = self.__dict__.get("_kvcached_traffic")
        if traffic is not None:
            pool = self.kv_cache_manager.block_pool
            end_unfit(self, pool.manager, pool.placeholders, outputs)
            counts = self.get_request_counts()
            traffic.stepped(sum(map(len, model_runner_output.sampled_token_ids)), counts,
                            waiting_blocks(self) if counts[1] else 0)
        return outputs

    @functools.wraps(original_free)
    def free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        traffic = self.__dict__.get("_kvcached_traffic")
        if traffic is not None:
            traffic.finished += 1
        return original_free(self, request, *args, **kwargs)

    @functools.wraps(original_preempt)
    def preempt_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        traffic = self.__dict__.get("_kvcached_traffic")
        if traffic is not None:
            traffic.preemptions += 1
        return original_preempt(self, *args, **kwargs)

    cls.add_request = add_request
    cls.update_from_output = update_from_output
    cls._free_request = free_request
    cls._preempt_request = preempt_request


def _patch_compact(cls: Any) -> None:
    """Compaction rounds ride on the scheduler's steps (see :mod:`.compact`): begun where the step's block
    copies are taken, committed after that step's output; an idle engine steps while a compaction is wanted."""
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    original_take = kv_cache_manager.KVCacheManager.take_kv_cache_block_copies
    original_schedule = cls.schedule
    original_update = cls.update_from_output
    original_has = cls.has_requests
    original_loop = EngineCoreProc.run_busy_loop

    @functools.wraps(original_take)
    def take_kv_cache_block_copies(self: Any) -> Any:
        copies, retained = original_take(self)
        compactor = getattr(self.block_pool, "compactor", None)
        if compactor is not None:
            ours = compactor.begin()
            if ours:
                copies = [*copies, *ours]
        return copies, retained

    @functools.wraps(original_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        compactor = self.__dict__.get("_kvcached_compactor")
        if compactor is None:
            return original_schedule(self, *args, **kwargs)
        try:
            output = original_schedule(self, *args, **kwargs)
        except BaseException:
            compactor.unscheduled()
            raise
        compactor.scheduled(output)
        return output

    @functools.wraps(original_update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = original_update(self, scheduler_output, model_runner_output)
        compactor = self.__dict__.get("_kvcached_compactor")
        if compactor is not None:
            compactor.stepped(scheduler_output)
        return outputs

    @functools.wraps(original_has)
    def has_requests(self: Any) -> bool:
        if original_has(self):
            return True
        compactor = self.__dict__.get("_kvcached_compactor")
        return compactor is not None and compactor.wanted  # an idle engine runs empty steps to carry the copies

    @functools.wraps(original_loop)
    def run_busy_loop(self: Any) -> Any:
        compactor = getattr(self.scheduler, "_kvcached_compactor", None)
        if compactor is not None:  # a busy loop to wake: from now on the model can be compacted
            queue = self.input_queue
            compactor.attach(lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None)))
        return original_loop(self)

    kv_cache_manager.KVCacheManager.take_kv_cache_block_copies = take_kv_cache_block_copies
    cls.schedule = schedule
    cls.update_from_output = update_from_output
    cls.has_requests = has_requests
    EngineCoreProc.run_busy_loop = run_busy_loop


def _patch_sleep(cls: Any) -> None:
    """Sleep and wake on the engine's thread (see :mod:`.sleep`): served before each schedule, after each
    step's output and after each client request; a request that arrives may wake the model."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    original_schedule = cls.schedule
    original_add = cls.add_request
    original_update = cls.update_from_output
    original_loop = EngineCoreProc.run_busy_loop
    original_client = EngineCoreProc._handle_client_request

    @functools.wraps(original_schedule)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        sleeper = self.__dict__.get("_kvcached_sleeper")
        if sleeper is not None:
            sleeper.service()
        return original_schedule(self, *args, **kwargs)

    @functools.wraps(original_add)
    def add_request(self: Any, request: Any) -> None:
        sleeper = self.__dict__.get("_kvcached_sleeper")
        if sleeper is not None:
            sleeper.arrived()
        original_add(self, request)

    @functools.wraps(original_update)
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original_update(self, *args, **kwargs)
        sleeper = self.__dict__.get("_kvcached_sleeper")
        if sleeper is not None:
            sleeper.service()
        return outputs

    @functools.wraps(original_loop)
    def run_busy_loop(self: Any) -> Any:
        sleeper = getattr(self.scheduler, "_kvcached_sleeper", None)
        if sleeper is not None:  # a busy loop to poke: from now on the model can sleep
            queue = self.input_queue
            sleeper.attach(self, lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None)))
        return original_loop(self)

    @functools.wraps(original_client)
    def handle_client_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_client(self, *args, **kwargs)
        sleeper = getattr(self.scheduler, "_kvcached_sleeper", None)
        if sleeper is not None:
            sleeper.service()
        return result

    cls.schedule = schedule
    cls.add_request = add_request
    cls.update_from_output = update_from_output
    EngineCoreProc.run_busy_loop = run_busy_loop
    EngineCoreProc._handle_client_request = handle_client_request


def _patch_groups(cls: Any) -> None:
    """Publish each KV cache group's blocks (see :mod:`.groups`) after every step's output and every client
    request, once all else that step or request does to the blocks is done."""
    from vllm.v1.engine.core import EngineCoreProc

    original_update = cls.update_from_output
    original_client = EngineCoreProc._handle_client_request

    @functools.wraps(original_update)
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original_update(self, *args, **kwargs)
        groups = self.__dict__.get("_kvcached_groups")
        if groups is not None:
            groups.publish(idle=not self.running)
        return outputs

    @functools.wraps(original_client)
    def handle_client_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_client(self, *args, **kwargs)
        groups = getattr(self.scheduler, "_kvcached_groups", None)
        if groups is not None:
            groups.publish(idle=not self.scheduler.running)
        return result

    cls.update_from_output = update_from_output
    EngineCoreProc._handle_client_request = handle_client_request


def _patch_engine_shutdown() -> None:
    """Close the allocator before vLLM stops its workers, so the ranks are told, not found gone."""
    from vllm.v1.engine import core

    original_shutdown = core.EngineCore.shutdown

    @functools.wraps(original_shutdown)
    def shutdown(self: Any) -> None:
        from .block_pool import KvcachedBlockPool

        kv_manager = getattr(getattr(self, "scheduler", None), "kv_cache_manager", None)
        pool = getattr(kv_manager, "block_pool", None)
        if isinstance(pool, KvcachedBlockPool):
            pool.close()
        original_shutdown(self)

    core.EngineCore.shutdown = shutdown


def _build_manager(vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.platforms import current_platform

    from kvcached_core import KVCacheManager

    from .geometry import kv_layout
    from .rendezvous import socket_paths

    if getattr(vllm_config, "use_v2_model_runner", False):  # releases before the V2 runner have no such property
        raise RuntimeError("kvcached: vLLM's model runner V2 allocates the KV cache on a path the plugin does not "
                           "patch (its memory would not be kvcached's): set VLLM_USE_V2_MODEL_RUNNER=0")
    layout = kv_layout(kv_cache_config)
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise RuntimeError("kvcached serves tensor parallelism, not pipeline parallelism: "
                           "use --pipeline-parallel-size 1 or run without ENABLE_KVCACHED")
    world = parallel.world_size
    paths = socket_paths(vllm_config.instance_id, world)
    manager = KVCacheManager(
        model_name(vllm_config), num_blocks=layout.num_blocks, block_bytes=layout.block_bytes,
        num_layers=layout.num_layers, num_kv_buffers=1, page_size=layout.page_size,
        backend="host" if current_platform.is_cpu() else "cuda", engine="vllm", block_tokens=layout.block_tokens,
        tp_world=world, tp_workers=paths,
        refill_linger_s=ENGINE_LINGER_S,
    )
    _MANAGERS.append(manager)
    available.register(manager, vllm_config)
    log.info("kvcached: segment %r (%d blocks of %d tokens, %d per %d MiB page, %d layer ranges; %s)", manager.name,
             layout.num_blocks, layout.block_tokens, layout.blocks_per_page, layout.page_size >> 20,
             layout.num_layers, layout.describe())
    return manager


def model_name(vllm_config: Any) -> str:
    """The served model name (``--served-model-name``), the last part of a local path."""
    model_config = vllm_config.model_config
    served = model_config.served_model_name or model_config.model
    if isinstance(served, (list, tuple)):
        served = served[0]
    served = str(served)
    if os.path.isabs(served):
        served = os.path.basename(served.rstrip(os.sep)) or served
    return served


# -- worker side ------------------------------------------------------------------------------
def _patch_worker() -> None:
    from vllm.v1.worker import gpu_model_runner

    original_tensors = gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors
    original_allocate = gpu_model_runner.allocate_kv_cache

    @functools.wraps(original_tensors)
    def initialize_kv_cache_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
        _context.worker = self.vllm_config
        try:
            return original_tensors(self, *args, **kwargs)
        finally:
            _context.worker = None

    @functools.wraps(original_allocate)
    def allocate_kv_cache(kv_cache_config: Any, device: Any, layout: Any,
                          kernel_block_sizes: list[int] | None = None) -> Any:
        vllm_config = getattr(_context, "worker", None)
        if vllm_config is None or not kv_cache_config.kv_cache_tensors:
            return original_allocate(kv_cache_config, device, layout, kernel_block_sizes)
        from .geometry import kv_layout
        from .rendezvous import socket_paths
        from .worker_side import kv_cache_views, start_worker

        kv = kv_layout(kv_cache_config)
        rank = _tp_rank()
        path = socket_paths(vllm_config.instance_id, vllm_config.parallel_config.world_size)[rank]
        worker = start_worker(path, rank, kv, device)
        return kv_cache_views(worker, kv, kv_cache_config, layout, kernel_block_sizes)

    gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors = initialize_kv_cache_tensors
    gpu_model_runner.allocate_kv_cache = allocate_kv_cache


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_tensor_model_parallel_rank()
    except (AssertionError, AttributeError):  # no distributed group: a single worker
        return 0


def _close_all() -> None:
    for manager in _MANAGERS:
        manager.close()
    _MANAGERS.clear()
    from .worker_side import close_workers

    close_workers()
