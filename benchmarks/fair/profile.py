"""The profiling pass: an engine's working-memory peak, measured as vLLM's profile run measures it.

One child process (as an engine is one) builds the model and, for each configuration in turn, starts transformers'
continuous batching on it (static beside a fixed cache; elastic on kvcached), answers a warm-up request, then runs
the pass: the longest prompts the trace draws, enough of them to fill a step of ``max_batch_tokens``, two new tokens
each. Working memory is what the pass took beside the weights and the KV cache:

- on CUDA, torch's peak of allocated bytes over the pass (``torch.cuda.reset_peak_memory_stats`` before it,
  ``torch.cuda.max_memory_allocated`` after) less what was allocated before it; the CUDA context (the process's
  device memory outside torch's allocator) is measured once, through NVML when it answers;
- on CPU, the process's peak resident memory over the pass (``VmHWM``, reset through ``/proc/self/clear_refs``) less
  its resident memory before it, less the KV pages kvcached mapped meanwhile (its host pages are resident too);
  glibc is told to give freed blocks back at once, so that memory freed before the pass cannot hide its needs.

The static cache the pass runs beside is the largest share any plan could give (:func:`.scale.upper_share_blocks`):
transformers' attention inputs grow with the cache, so a plan's engines never need more than was measured.
Engines at operator scale run the same pass as their warm-up (:func:`run_pass`), so an engine that cannot hold it
fails at its start, and an elastic engine's registered working memory (the plugin's) covers it before any run.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from .scale import CONFIGS, Measured, upper_share_blocks
from .tcb_child import build_model, error_line, log_to, setup_of, start_batching

PASS_NEW_TOKENS = 2
PASS_TIMEOUT_S = 300.0


def pass_requests(longest: int, max_batch_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """The pass's prompts: ``longest`` tokens each, enough for their prefill to fill a step of ``max_batch_tokens``
    (at least two, so that a step can carry the chunks of two of them)."""
    rng = random.Random(seed)
    count = max(2, -(-max_batch_tokens // longest) + 1)
    return [[1] + [rng.randrange(4, vocab) for _ in range(longest - 1)] for _ in range(count)]


def run_pass(manager: Any, prompts: list[list[int]], timeout_s: float = PASS_TIMEOUT_S) -> None:
    """Send ``prompts`` to a started continuous batching manager and wait for every answer (before the engine's
    own reader thread runs); RuntimeError with the engine's error if one fails or the loop stops."""
    for i, ids in enumerate(prompts):
        manager.add_request(ids, request_id=f"profile-{i}", max_new_tokens=PASS_NEW_TOKENS, eos_token_id=-1)
    left = {f"profile-{i}" for i in range(len(prompts))}
    deadline = time.monotonic() + timeout_s
    while left:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the profiling pass did not end within {timeout_s:.0f} s")
        out = manager.get_result(timeout=0.2)
        if out is None:
            if not manager.is_running():
                from .tcb_child import loop_error

                raise RuntimeError(f"the profiling pass stopped the engine: {loop_error(manager)}")
            continue
        if out.is_finished() and out.request_id in left:
            if out.error:
                raise RuntimeError(f"the profiling pass failed: {out.error}")
            left.discard(out.request_id)


def wait_warm(manager: Any) -> None:
    """One short request answered: the cache is built (on kvcached, by the loop's first batch)."""
    run_pass(manager, [[1, 5, 6, 7]])


class Meter:
    """Working memory over a pass, on the device the model runs on (see the module docstring)."""

    def __init__(self, device: str, *, device_figures: bool = True) -> None:
        """``device_figures``: also measure the CUDA context and the device's free memory (see the module
        docstring), once, now."""
        self.cuda = device == "cuda"
        self.base = 0
        self.context_bytes = 0
        self.free_bytes = self.total_bytes = 0
        if self.cuda and device_figures:
            self._start_cuda()
        if not self.cuda:
            _return_freed_memory()

    def _start_cuda(self) -> None:
        import torch

        from kvcached_core.backends import nvml

        before = nvml.probe([0])
        used_before = before[0].used_bytes if before else None
        torch.zeros(1, device="cuda")  # the context, created now
        free, total = torch.cuda.mem_get_info()
        after = nvml.probe([0])
        used_after = after[0].used_bytes if after else None
        reserved = torch.cuda.memory_reserved()
        if used_before is not None and used_after is not None:
            self.context_bytes = max(0, used_after - used_before - reserved)
        else:  # no NVML: what the device has in use beyond torch, as if this process were alone on it
            self.context_bytes = max(0, total - free - reserved)
        self.free_bytes, self.total_bytes = free + self.context_bytes + reserved, total

    @property
    def how(self) -> str:
        return "torch.cuda.max_memory_allocated over a profiling pass" if self.cuda else \
            "peak resident memory (VmHWM) over a profiling pass"

    def reset(self) -> None:
        """From now on."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident size starts again from the resident size now
            self.base = _status_bytes("VmRSS")

    def peak(self) -> int:
        """Bytes above the reset's, at the highest since it."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return max(0, torch.cuda.max_memory_allocated() - self.base)
        return max(0, _status_bytes("VmHWM") - self.base)


def _return_freed_memory() -> None:
    """glibc hands blocks of 64 KiB or more straight back to the system when freed, from now on: the resident size
    then follows what is allocated, and memory freed before a pass cannot hide what the pass takes."""
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameters (malloc.h)
    libc.mallopt(m_mmap_threshold, 64 << 10)
    libc.mallopt(m_trim_threshold, 0)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def profile_child(spec: dict, inbox: Any, outbox: Any) -> None:
    """A child: measure (see the module docstring) and put ``("profile", name, None, figures, ...)`` on the outbox,
    or ``("died", ...)`` with the error line."""
    log_to(spec.get("log"))
    os.environ.update(spec["env"])
    try:
        figures = _profile(spec)
    except Exception as exc:
        outbox.put(("died", spec["name"], None, None, None, 0, error_line(exc)))
        raise
    outbox.put(("profile", spec["name"], None, figures, None, 0, None))
    inbox.get()  # ends when told, as an engine does


def _profile(spec: dict) -> dict:
    import gc

    from kvcached_core.settings import settings

    setup = setup_of(spec)
    meter = Meter(setup.device)
    total, free = (spec["declared_bytes"],) * 2 if spec.get("declared_bytes") else (meter.total_bytes, meter.free_bytes)
    model = build_model(setup, spec["seed"])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    headroom = settings().device_headroom.of(total)
    blocks = upper_share_blocks(free, weights, meter.context_bytes, headroom_bytes=headroom,
                                block_bytes=setup.block_bytes, models=spec["models"])
    longest = setup.prompt_range()[1]
    prompts = pass_requests(longest, setup.max_batch_tokens, setup.vocab, spec["seed"])
    per_request = -(-(longest + PASS_NEW_TOKENS) // spec["page_tokens"])
    if blocks < per_request:
        raise RuntimeError(f"the device leaves no room for a cache of one longest request ({per_request} blocks) "
                           f"beside {spec['models']} engines' weights")
    prompts = prompts[:max(1, blocks // per_request)]
    budget = spec["models"] * (blocks + 2) * setup.block_bytes
    os.environ["KVCACHED_DEVICE_BUDGET" if setup.device == "cuda" else "KVCACHED_HOST_CAPACITY"] = f"{budget >> 20}MiB"
    working: dict[str, int] = {}
    for config in CONFIGS:
        elastic = config == "elastic"
        manager, handle = start_batching(model, setup, elastic=elastic, name=f"{spec['name']}-{config}",
                                         num_blocks=spec["models"] * (blocks + 2) - 2 if elastic else blocks)
        try:
            wait_warm(manager)
            working[config] = measure_pass(manager, handle, meter, prompts)
        finally:
            manager.stop(block=True, timeout=60)
            if handle is not None:
                handle.close()
        del manager, handle
        gc.collect()
        if meter.cuda:
            import torch

            torch.cuda.empty_cache()
    return {"total_bytes": total, "free_bytes": free, "context_bytes": meter.context_bytes, "weights_bytes": weights,
            "working_bytes": working, "how": meter.how, "profile_cache_blocks": blocks,
            "pass_requests": len(prompts), "pass_prompt_tokens": longest}


def measure_pass(manager: Any, handle: Any, meter: Meter, prompts: list[list[int]]) -> int:
    """The working memory of one pass of ``prompts`` on a started, warm engine (``handle``: the plugin's, or None)."""
    mapped_before = _mapped(handle)
    meter.reset()
    run_pass(manager, prompts)
    peak = meter.peak()
    if not meter.cuda:  # kvcached's host pages are resident too: they are KV, not working memory
        peak = max(0, peak - (_mapped(handle) - mapped_before))
    return peak


def _mapped(handle: Any) -> int:
    """The bytes kvcached has mapped for an elastic engine (0 for a static one)."""
    manager = getattr(handle, "manager", None)
    return 0 if manager is None else int(manager.backend_mapped_bytes())


def measured_from(figures: dict) -> Measured:
    return Measured(**{k: figures[k] for k in ("total_bytes", "free_bytes", "context_bytes", "weights_bytes",
                                               "working_bytes", "how", "profile_cache_blocks")})


def measure(setup: Any, *, models: int, seed: int, shm: Any, logs: Any, declared_bytes: int | None,
            timeout_s: float = 900.0) -> tuple[Measured, dict]:
    """Run the profiling pass for ``setup``'s model in a child process; what it measured, and its figures as it
    gave them (the pass's requests too). EngineDied with its error line when it fails."""
    from .tcb import WARM_POOL, context
    from .tcb_engines import Engines
    from .tcb_setup import PAGE_TOKENS

    spec = {"name": "profile", "seed": seed, "setup": setup.__dict__, "models": models, "page_tokens": PAGE_TOKENS,
            "declared_bytes": declared_bytes, "env": {"KVCACHED_SHM_DIR": str(shm),
                                                      "OMP_NUM_THREADS": str(setup.threads), **WARM_POOL}}
    child = Engines(context(), ["profile"], [spec], shm=None, vocab=setup.vocab, logs=logs, target=profile_child)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = child.get(deadline - time.monotonic())
            if msg is not None and msg[0] == "profile":
                return measured_from(msg[3]), msg[3]
        raise RuntimeError(f"the profiling pass did not end within {timeout_s:.0f} s")
    finally:
        child.stop()
