"""A profiling pass on a started transformers engine, run in the engine's own process (the profiling child of
:mod:`.profile`, or an engine's warm-up at operator scale, :func:`.tcb_child.warm_pass`): the requests it sends
(:func:`fill_pass`) and the working memory it takes (:class:`Meter`, :func:`measure_pass`).

Working memory is what the pass took beside the weights and the KV cache:

- on CUDA, torch's peak of allocated bytes over the pass (``torch.cuda.reset_peak_memory_stats`` before it,
  ``torch.cuda.max_memory_allocated`` after) less what was allocated before it; the CUDA context (the process's
  device memory outside torch's allocator) is measured once, through NVML when it answers;
- on CPU, the process's peak resident memory over the pass (``VmHWM``, reset through ``/proc/self/clear_refs``) less
  its resident memory before it, less the most KV pages kvcached mapped meanwhile (its host pages are resident too);
  glibc is told to give freed blocks back at once, so that memory freed before the pass cannot hide its needs.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from .tcb_errors import loop_error
from .tcb_setup import PAGE_TOKENS

PASS_TIMEOUT_S = 300.0
MAPPED_POLL_S = 0.002  # on the host, how often the pages kvcached has mapped are looked at during a pass
MAX_PASS_REQUESTS = 24  # a pass's requests at most (a CPU pass stays short; an 8B GPU pass fills 18 GiB with 17)


@dataclass(frozen=True)
class Pass:
    """A profiling pass: prompts of the longest length the trace draws, and the tokens each generates."""

    prompts: list[list[int]]
    new_tokens: int


def fill_pass(blocks: int, setup: Any, seed: int) -> Pass:
    """As many of the longest prompts as ``blocks`` hold (at least one, at most :data:`MAX_PASS_REQUESTS`), each
    generating enough tokens to be still running when the last one's prefill ends, so that the last steps read all
    of them at once at ``max_batch_tokens`` a step: the most a cache of ``blocks`` gives one batch to read."""
    longest = setup.prompt_range()[1]
    count = max(1, min(MAX_PASS_REQUESTS, blocks // -(-(longest + PAGE_TOKENS) // PAGE_TOKENS)))
    new = min(PAGE_TOKENS, -(-count * longest // setup.max_batch_tokens) + 2)
    rng = random.Random(seed)
    return Pass([[1] + [rng.randrange(4, setup.vocab) for _ in range(longest - 1)] for _ in range(count)], new)


def blocks_of(p: Pass) -> int:
    """The blocks the pass's requests hold at their end, all together."""
    return sum(-(-(len(ids) + p.new_tokens) // PAGE_TOKENS) for ids in p.prompts)


def run_pass(manager: Any, p: Pass, timeout_s: float = PASS_TIMEOUT_S) -> None:
    """Send the pass to a started continuous batching manager and wait for every answer (before the engine's own
    reader thread runs); RuntimeError with the engine's error if one fails or the loop stops."""
    for i, ids in enumerate(p.prompts):
        manager.add_request(ids, request_id=f"profile-{i}", max_new_tokens=p.new_tokens, eos_token_id=-1)
    left = {f"profile-{i}" for i in range(len(p.prompts))}
    deadline = time.monotonic() + timeout_s
    while left:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the profiling pass did not end within {timeout_s:.0f} s")
        out = manager.get_result(timeout=0.2)
        if out is None:
            if not manager.is_running():
                raise RuntimeError(f"the profiling pass stopped the engine: {loop_error(manager)}")
            continue
        if out.is_finished() and out.request_id in left:
            if out.error:
                raise RuntimeError(f"the profiling pass failed: {out.error}")
            left.discard(out.request_id)


def wait_warm(manager: Any) -> None:
    """One short request answered: the cache is built (on kvcached, by the loop's first batch)."""
    run_pass(manager, Pass([[1, 5, 6, 7]], 2))


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


def measure_pass(manager: Any, handle: Any, meter: Meter, p: Pass) -> int:
    """The working memory of one pass on a started, warm engine (``handle``: the plugin's, or None)."""
    if meter.cuda or handle is None:
        meter.reset()
        run_pass(manager, p)
        return meter.peak()
    # on the host, kvcached's pages are resident too: the most it had mapped over the pass is KV, not working memory
    mapped_before, most = _mapped(handle), [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(MAPPED_POLL_S):
            most[0] = max(most[0], _mapped(handle))

    watcher = threading.Thread(target=watch, daemon=True)
    meter.reset()
    watcher.start()
    try:
        run_pass(manager, p)
    finally:
        done.set()
        watcher.join()
    return max(0, meter.peak() - max(0, max(most[0], _mapped(handle)) - mapped_before))


def _mapped(handle: Any) -> int:
    """The bytes kvcached has mapped for an elastic engine (0 for a static one)."""
    manager = getattr(handle, "manager", None)
    return 0 if manager is None else int(manager.backend_mapped_bytes())
