"""Admission at the router: at most ``limit`` requests in flight to the engines of one device, the rest wait.

A freed place goes to the waiting request whose model has the highest memory-policy priority (the one
``kvctl policy --priority`` sets: the model that gives memory last under pressure is served first), then to the
lowest request ``priority`` (the field vLLM's priority scheduling reads: lower is earlier), then to the earliest.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiter:
    key: tuple[int, int, int]  # (-model priority, request priority, arrival)
    future: asyncio.Future = field(compare=False)
    model: str = field(compare=False)


class Admission:
    """Places per device (``limit`` 0: no limit, nobody waits). ``enter`` before a request goes to its engine,
    ``leave`` once it is answered in full."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("the limit of requests in flight cannot be negative")
        self.limit = limit
        self._in_flight: Counter[int] = Counter()
        self._waiting: dict[int, list[_Waiter]] = {}
        self._arrival = itertools.count()

    async def enter(self, device: int, model: str, model_priority: int, request_priority: int) -> None:
        """Return once the request holds a place on ``device`` (at once while one is free and nobody waits)."""
        if not self.limit:
            return
        heap = self._waiting.setdefault(device, [])
        while heap and heap[0].future.done():  # cancelled waiters on top: none of them waits any more
            heapq.heappop(heap)
        if self._in_flight[device] < self.limit and not heap:
            self._in_flight[device] += 1
            return
        waiter = _Waiter((-model_priority, request_priority, next(self._arrival)),
                         asyncio.get_running_loop().create_future(), model)
        heapq.heappush(heap, waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(device)  # the place was handed over as the request was cancelled: pass it on
            raise

    def leave(self, device: int) -> None:
        """Give the place back: to the first waiting request of ``device`` (it keeps the count), else free it."""
        if not self.limit:
            return
        heap = self._waiting.get(device, [])
        while heap:
            waiter = heapq.heappop(heap)
            if not waiter.future.done():  # cancelled ones are skipped
                waiter.future.set_result(None)
                return
        self._in_flight[device] -= 1

    def waiting(self) -> dict[str, int]:
        """Requests waiting for a place now, by model (segment name)."""
        counts: Counter[str] = Counter(w.model for heap in self._waiting.values() for w in heap
                                       if not w.future.done())
        return dict(sorted(counts.items()))
