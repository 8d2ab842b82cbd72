"""Traffic figures from vLLM's scheduler, published into the model's segment for kvtop and kvctl.

Counted in the EngineCore process, where the scheduler sees every request: prompt tokens when a
request arrives, generated tokens after every step, requests that leave (finished or aborted),
preemptions (vLLM recomputes a preempted request later, typically for lack of KV blocks). The
figures go into the segment as plain words once per step (``KVCacheManager.publish_traffic``).
"""

from __future__ import annotations

import time
from itertools import islice
from typing import Any

from kvcached_core import KVCacheManager

LOOK = 256  # waiting requests counted per step, at most (the head of the queue: what is admitted next)


def waiting_blocks(scheduler: Any) -> int:
    """Blocks the head of vLLM's waiting queue needs for its tokens (prefix hits not counted): what a model the
    shared budget holds back asks the other models for (``KVCacheManager.publish_traffic``)."""
    size = scheduler.block_size
    return sum(-(-r.num_tokens // size) for r in islice(scheduler.waiting, LOOK))


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

    def arrived(self, prompt_tokens: int, counts: tuple[int, int], waiting: int = 0) -> None:
        self.prompt_tokens += prompt_tokens
        self.last_request_ns = time.time_ns()
        self._publish(counts, waiting)

    def stepped(self, generated_tokens: int, counts: tuple[int, int], waiting: int = 0) -> None:
        """After a step; ``waiting``: the blocks the waiting requests need (:func:`waiting_blocks`)."""
        self.generated_tokens += generated_tokens
        self._publish(counts, waiting)

    def refresh(self, counts: tuple[int, int]) -> None:
        """Publish the gauges now (no step runs while the model sleeps: its preempted requests show as waiting)."""
        self._publish(counts)

    def _publish(self, counts: tuple[int, int], waiting_blocks: int = 0) -> None:
        running, waiting = counts
        self.manager.publish_traffic(running, waiting, self.finished, self.prompt_tokens, self.generated_tokens,
                                     self.preemptions, self.last_request_ns, waiting_blocks)
