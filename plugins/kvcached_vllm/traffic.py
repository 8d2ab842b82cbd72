"""Traffic figures from vLLM's scheduler, published into the model's segment for kvtop and kvctl.

Counted in the EngineCore process, where the scheduler sees every request: prompt tokens when a
request arrives, generated tokens after every step, requests that leave (finished or aborted),
preemptions (vLLM recomputes a preempted request later, typically for lack of KV blocks). The
figures go into the segment as plain words once per step (``KVCacheManager.publish_traffic``).
"""

from __future__ import annotations

import time

from kvcached_core import KVCacheManager


class Traffic:
    """Counters of one scheduler; :meth:`arrived` and :meth:`stepped` publish them."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.finished = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.last_request_ns = 0
        manager.publish_traffic(0, 0, 0, 0, 0, 0, 0)  # published from the start: zeros that are true

    def arrived(self, prompt_tokens: int, counts: tuple[int, int]) -> None:
        self.prompt_tokens += prompt_tokens
        self.last_request_ns = time.time_ns()
        self._publish(counts)

    def stepped(self, generated_tokens: int, counts: tuple[int, int]) -> None:
        self.generated_tokens += generated_tokens
        self._publish(counts)

    def refresh(self, counts: tuple[int, int]) -> None:
        """Publish the gauges now (no step runs while the model sleeps: its preempted requests show as waiting)."""
        self._publish(counts)

    def _publish(self, counts: tuple[int, int]) -> None:
        running, waiting = counts
        self.manager.publish_traffic(running, waiting, self.finished, self.prompt_tokens, self.generated_tokens,
                                     self.preemptions, self.last_request_ns)
