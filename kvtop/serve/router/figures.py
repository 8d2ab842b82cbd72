"""Per-model figures at the router: requests, errors, in flight, time to first token and latency percentiles."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 1024  # the latest requests the percentiles are taken over


def percentile(samples: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``samples`` by nearest rank; None when there are none."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


@dataclass
class ModelFigures:
    requests: int = 0  # routed to this model (woken ones included)
    errors: int = 0  # answered with a status of 400 or more (the engine's or the router's own 503)
    in_flight: int = 0
    woken: int = 0  # requests that woke the model
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # streamed: request to first bytes
    latency_s: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # request to the last byte

    def to_dict(self) -> dict:
        ttft, latency = list(self.ttft_s), list(self.latency_s)
        return {
            "requests": self.requests, "errors": self.errors, "in_flight": self.in_flight, "woken": self.woken,
            "ttft_p50_s": _round(percentile(ttft, 0.5)), "ttft_p99_s": _round(percentile(ttft, 0.99)),
            "latency_p50_s": _round(percentile(latency, 0.5)), "latency_p99_s": _round(percentile(latency, 0.99)),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass
class Figures:
    """Every model's figures, by its segment's name; ``unrouted``: requests no model took (404, 400)."""

    models: dict[str, ModelFigures] = field(default_factory=dict)
    unrouted: int = 0

    def of(self, model: str) -> ModelFigures:
        found = self.models.get(model)
        if found is None:
            found = self.models[model] = ModelFigures()
        return found

    def by_model(self) -> dict[str, dict]:
        return {name: f.to_dict() for name, f in sorted(self.models.items())}

    def to_dict(self) -> dict:
        return {"models": self.by_model(), "unrouted": self.unrouted}
