"""An engine's working memory, measured around its profiling pass (vLLM's available-memory step).

On a GPU the figures are torch's: what is allocated before the pass (the weights), the peak the pass reached
beyond it, and what torch's caching allocator still holds after it. On the host they are the process's:
its RSS before the pass, the high-water mark the pass reached (``VmHWM`` after ``/proc/self/clear_refs`` resets
it; where the kernel refuses the reset, the RSS after the pass) and the RSS after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvcached_core.engines import available_ram_bytes, process_bytes, total_ram_bytes

from .sizing import Device, Working

T = TypeVar("T")


def _reset_high_water() -> bool:
    """Reset the process's RSS high-water mark to its RSS now (Linux's clear_refs 5); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def host(step: Callable[[], T]) -> tuple[T, Device, Working]:
    """Run ``step`` and measure the process's memory around it; the host's memory after it."""
    before = process_bytes("VmRSS")
    reset = _reset_high_water()
    result = step()
    after = process_bytes("VmRSS")
    high = process_bytes("VmHWM") if reset else after
    device = Device("host", 0, total_ram_bytes(), available_ram_bytes())
    return result, device, Working(before, max(0, high - before), max(0, after - before))


def cuda(step: Callable[[], T], torch: Any) -> tuple[T, Device, Working]:
    """Run ``step`` and measure torch's memory on the current CUDA device around it; the device after it."""
    index = torch.cuda.current_device()
    before = torch.cuda.memory_allocated(index)
    torch.cuda.reset_peak_memory_stats(index)
    result = step()
    torch.cuda.synchronize(index)
    peak = torch.cuda.max_memory_allocated(index)
    held = torch.cuda.memory_reserved(index)
    free, total = torch.cuda.mem_get_info(index)
    return result, Device("cuda", index, int(total), int(free)), Working(before, max(0, peak - before),
                                                                        max(0, held - before))
