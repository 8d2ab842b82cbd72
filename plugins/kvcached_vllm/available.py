"""vLLM's available-memory step under kvcached: each worker answers the span :mod:`.sizing` plans.

Before it builds the scheduler, EngineCore asks every worker how much memory the KV cache may take
(``Executor.determine_available_memory``) and turns the answer into vLLM's block count, the span kvcached then
maps page by page. Here each worker still runs its own step (the GPU worker's profiling pass at the largest
batch, which also compiles the model; the CPU worker's, then a profiling pass, which it makes only to compile),
measures its working memory around it (:mod:`.measure`) and answers the span from the shared budget, the
headroom and its peers instead of vLLM's figure. One patch serves every worker class (``Worker``,
``CPUWorker``): the step is sent to each worker as a function. The working memory comes back to EngineCore,
where :func:`register` hands it to the allocator once it exists (``KVCacheManager.register_working_memory``),
so every engine of the device keeps it free.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from . import measure
from .sizing import Working, plan_for

# Under vLLM's logger, whose handler vLLM sets up at INFO in every process: the plan is in the engine's log.
log = logging.getLogger("vllm.kvcached")

_WORKING: dict[str, Working] = {}  # vLLM instance id -> the working memory its workers measured (the largest)


def install() -> None:
    from vllm.v1.executor.abstract import Executor

    original = Executor.determine_available_memory

    @functools.wraps(original)
    def determine_available_memory(self: Any) -> list[int]:
        answers = self.collective_rpc(size_kv)
        _WORKING[self.vllm_config.instance_id] = max((own for _, own in answers), key=lambda w: w.pending)
        return [span for span, _ in answers]

    Executor.determine_available_memory = determine_available_memory


def size_kv(worker: Any) -> tuple[int, Working]:
    """In a worker process: vLLM's own step, measured; the span this engine plans with, and its working memory."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        vllm_answer, device, own = measure.host(functools.partial(_cpu_step, worker))
    else:
        import torch

        vllm_answer, device, own = measure.cuda(worker.determine_available_memory, torch)
    plan = plan_for(device, own, cap=worker.cache_config.kv_cache_memory_bytes)
    if plan.span <= 0:
        raise RuntimeError(f"kvcached: no room for this engine's KV cache: {plan.describe()}")
    log.info("%s; vLLM's own step said %.2f GiB", plan.describe(), vllm_answer / (1 << 30))
    return plan.span, own


def _cpu_step(worker: Any) -> int:
    """The CPU worker's step, then a profiling pass at the largest batch, as the GPU worker's step makes (the CPU
    worker makes one only to compile, never in eager mode): the working memory is measured, not assumed."""
    from vllm.config import set_current_vllm_config

    answer = int(worker.determine_available_memory())
    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.profile_run()
    return answer


def register(manager: Any, vllm_config: Any) -> None:
    """Hand the working memory the engine's workers measured to its allocator (in EngineCore)."""
    own = _WORKING.pop(vllm_config.instance_id, None)
    if own is not None:
        manager.register_working_memory(own.peak, own.now)
