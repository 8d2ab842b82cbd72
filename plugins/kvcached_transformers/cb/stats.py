"""What one model's continuous batching admitted, counted per scheduling pass: what a benchmark records beside a run.

Read as ``CBInstall.stats`` (a copy, taken when read): counters since the handle was installed, over every
processor it served.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GATES = ("reserve", "margin", "budget")  # the gates of admission, in the order a waiting request meets them


@dataclass
class AdmissionStats:
    """Per-run admission counters of one model (see :data:`GATES` for the gate names).

    - ``steps``: scheduling passes that built a batch; ``step_requests``: the requests in them, summed
      (``requests_per_step`` is their mean);
    - ``refused``: per gate, the passes in which a waiting request was held back by it: ``reserve`` (the sectors kept
      for the growth of running requests), ``margin`` (transformers' FIFO safety margin: the free share of what the
      model holds plus what it may take is under it), ``budget`` (the limit or the shared budget leaves too little);
    - ``reserved_bytes``: bytes mapped in the warm pool (claimed, no block on them) when last counted, and
      ``reserved_bytes_sum``: summed at every step (divided by ``steps``: the mean);
    - ``pooled_bytes``: bytes in the backend's pool of physical handles (CUDA; 0 on the host), when last counted.
    """

    steps: int = 0
    step_requests: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GATES, 0))
    reserved_bytes: int = 0
    reserved_bytes_sum: int = 0
    pooled_bytes: int = 0

    @property
    def requests_per_step(self) -> float:
        """Mean requests per step (0.0 before the first step)."""
        return self.step_requests / self.steps if self.steps else 0.0

    @property
    def unused_bytes(self) -> int:
        """Bytes claimed but holding no block, when last counted: the warm pool and the handle pool."""
        return self.reserved_bytes + self.pooled_bytes

    def count_pass(self, requests: int, refused: set[str], reserved_bytes: int, pooled_bytes: int) -> None:
        """One scheduling pass: ``requests`` scheduled (0: no batch), the gates that held a waiting request back."""
        for gate in refused:
            self.refused[gate] += 1
        self.reserved_bytes, self.pooled_bytes = reserved_bytes, pooled_bytes
        if requests:
            self.steps += 1
            self.step_requests += requests
            self.reserved_bytes_sum += reserved_bytes

    def copy(self) -> AdmissionStats:
        return replace(self, refused=dict(self.refused))
