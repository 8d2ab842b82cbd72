"""The traffic's peak rate, from a measured rate and from memory: where memory binds, so that elastic has something
to win on every shape but steady (the memory rule serves operator scale; see :mod:`.tcb`).

Two rules, both declared, both applied to figures measured in the run (:func:`.tcb.calibrate`):

- the rate rule: the peak is at least :data:`PEAK_RULE` times the requests per second one static share serves;
- the memory rule: at the peak, the KV of the requests in flight must reach :data:`MEMORY_RULE` times a share for
  the busiest model, within the trace. A request is in flight for the measured service time ``W`` after it arrives
  (Little's law: arrival rate x W requests at once), and holds the KV of its prompt and its new tokens, in whole
  blocks. The KV in flight at ``t`` is that of the model's requests that arrived in ``(t - W, t]``, read off the trace
  itself, so a short ramp is judged by what it really sends. While the rule is not met, the peak rate is raised in
  proportion and the (seeded) trace made again.

The steady shape keeps the rate rule alone: each model at its share's capacity, where static partitioning is
already right and elastic has nothing to win.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PEAK_RULE = 2.0  # the peak rate: at least twice the requests per second one static share serves
MEMORY_RULE = 2.0  # at the peak, the KV in flight of the busiest model: at least twice a share
RAISE_MARGIN = 1.05  # a raise overshoots the ratio it lacked by this much (Poisson draws vary)
MAX_RAISE = 4.0  # one raise multiplies the rate by at most this much
MAX_REQUESTS = 20_000  # a trace the rule would make longer than this is refused: no run could replay it


def request_kv_bytes(row: dict, block_bytes: int, page_tokens: int) -> int:
    """The KV one request holds by its end: its prompt and new tokens, in whole blocks."""
    return -(-(row["prompt_tokens"] + row["max_tokens"]) // page_tokens) * block_bytes


@dataclass(frozen=True)
class InFlight:
    """The most KV in flight in a trace: how much, for which model, when."""

    bytes: int
    model: str
    t: float
    requests: int


def in_flight(trace: list[dict], service_s: float, kv_of: Callable[[dict], int]) -> InFlight:
    """The largest KV in flight over the trace, model by model (see the module docstring)."""
    best = InFlight(0, "", 0.0, 0)
    for model in sorted({row["model"] for row in trace}):
        rows = [row for row in trace if row["model"] == model]  # the trace is sorted by arrival
        held, first = 0, 0
        for i, row in enumerate(rows):
            held += kv_of(row)
            while rows[first]["t"] <= row["t"] - service_s:
                held -= kv_of(rows[first])
                first += 1
            if held > best.bytes:
                best = InFlight(held, model, row["t"], i - first + 1)
    return best


@dataclass(frozen=True)
class Traffic:
    """The trace every run replays and how its peak rate was set."""

    trace: list[dict]
    peak_rate: float
    rate_rule_rate: float  # PEAK_RULE x a share's request rate
    service_s: float
    share_bytes: int
    busiest: InFlight
    memory_rule: bool  # whether the memory rule applied
    steady: bool  # the steady shape: every model at half the peak rate all along

    def lines(self) -> list[str]:
        """The rule and what it gave, as the run prints them."""
        from kvcached_core.sizes import format_bytes as g

        held = f"{self.busiest.model} holds {g(self.busiest.bytes)} ({self.busiest.bytes / self.share_bytes:.2f} " \
               f"shares, {self.busiest.requests} requests) at {self.busiest.t:.1f} s"
        if self.steady:
            return [f"traffic: every model at {self.peak_rate / 2:g} requests/s (half of {PEAK_RULE:g} x a share's "
                    f"rate: a share's capacity, nothing for elastic to win); KV in flight at most: {held}"]
        if not self.memory_rule:
            return [f"traffic: peak {self.peak_rate:g} requests/s per model ({PEAK_RULE:g} x a share's rate); KV in "
                    f"flight at most (the requests of the last {self.service_s:.2f} s, the measured service time): "
                    f"{held}"]
        return [f"traffic: peak {self.peak_rate:g} requests/s per model, the larger of {PEAK_RULE:g} x a share's "
                f"rate ({self.rate_rule_rate:g}) and the rate at which the KV in flight (the requests of the last "
                f"{self.service_s:.2f} s, the measured service time, each with its prompt's and new tokens' KV) "
                f"reaches {MEMORY_RULE:g} x a share ({g(int(MEMORY_RULE * self.share_bytes))}) in the trace: {held}"]

    def to_dict(self) -> dict:
        return {"peak_rate": self.peak_rate, "rate_rule_rate": self.rate_rule_rate, "service_s": self.service_s,
                "share_bytes": self.share_bytes, "memory_rule": self.memory_rule, "steady": self.steady,
                "peak_rule": PEAK_RULE,
                "memory_rule_shares": MEMORY_RULE, "in_flight_peak_bytes": self.busiest.bytes,
                "in_flight_peak_model": self.busiest.model, "in_flight_peak_t": self.busiest.t,
                "in_flight_peak_requests": self.busiest.requests}


def traffic(make: Callable[[float], list[dict]], *, share_rate: float, service_s: float, share_bytes: int,
            kv_of: Callable[[dict], int], memory_rule: bool, steady: bool = False) -> Traffic:
    """The trace ``make(peak_rate)`` at the peak rate the rules give (see the module docstring); ``memory_rule``
    False (and always for ``steady``): the rate rule alone."""
    memory_rule = memory_rule and not steady
    rate = round(PEAK_RULE * share_rate, 3)
    base = rate
    want = MEMORY_RULE * share_bytes
    while True:
        trace = make(rate)
        busiest = in_flight(trace, service_s, kv_of)
        if not memory_rule or busiest.bytes >= want:
            return Traffic(trace, rate, base, service_s, share_bytes, busiest, memory_rule, steady)
        if len(trace) > MAX_REQUESTS:
            raise RuntimeError(f"the KV in flight reaches {busiest.bytes / share_bytes:.2f} of the {MEMORY_RULE:g} "
                               f"shares the rule asks only with more than {MAX_REQUESTS} requests a run (peak "
                               f"{rate:g} requests/s, service time {service_s:.3g} s): a longer trace or shares of "
                               "fewer requests would")
        factor = RAISE_MARGIN * want / busiest.bytes if busiest.bytes else MAX_RAISE
        rate = round(rate * min(MAX_RAISE, factor), 3)
