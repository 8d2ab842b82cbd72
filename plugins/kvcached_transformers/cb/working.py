"""An engine's working memory on its GPU, measured by torch's allocator and registered with kvcached.

Working memory is what the forward passes take beside the weights and the KV cache: activations, the attention
buffers and masks, logits. kvcached maps the KV cache outside torch's allocator, so torch's own figures, taken from
the moment the model's first cache on kvcached is built (its weights are loaded by then), are the working memory:

- ``peak``: torch's peak of allocated bytes since then (the peak counter of the device is reset at that moment)
  less what was allocated then;
- ``now``: of that peak, what torch's caching allocator holds now (its reserved bytes less the same base): memory
  the device already lacks, so a budget need not keep it free again.

:meth:`WorkingMemory.publish` hands both to ``KVCacheManager.register_working_memory`` whenever they changed; the CUDA
budget then keeps ``peak - now`` free beside its headroom. The figures are the process's for that device: one engine
per process and GPU, as a serving deployment runs them.
"""

from __future__ import annotations

import torch

from kvcached_core import KVCacheManager


class WorkingMemory:
    """The working memory of the engine on ``device`` (a CUDA device), from now on."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"working memory is measured on a CUDA device, not {device}")
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)
        self.base = torch.cuda.memory_allocated(device)
        self._sent: tuple[KVCacheManager, int, int] | None = None

    def figures(self) -> tuple[int, int]:
        """``(peak, now)`` in bytes (see the module docstring); ``now`` is at most ``peak``."""
        peak = max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
        now = max(0, torch.cuda.memory_reserved(self.device) - self.base)
        return peak, min(now, peak)

    def publish(self, manager: KVCacheManager) -> None:
        """Register the figures with ``manager`` when they (or the manager) changed since the last time."""
        peak, now = self.figures()
        if self._sent != (manager, peak, now):
            manager.register_working_memory(peak, now)
            self._sent = (manager, peak, now)
