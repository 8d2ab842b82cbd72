"""The multimodel benchmark's traffic where memory binds (benchmarks/fair/load.py): the KV in flight read off a trace,
and the peak rate raised until, at the peak, it reaches two shares for the busiest model (steady excepted)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.fair import load
from benchmarks.fair.trace import make_trace

MiB = 1 << 20
BLOCK = 512 * 1024


def kv(row: dict) -> int:
    return load.request_kv_bytes(row, BLOCK, 256)


def test_a_request_holds_its_prompt_and_new_tokens_in_whole_blocks() -> None:
    assert kv({"prompt_tokens": 200, "max_tokens": 56}) == BLOCK  # 256 tokens: one block
    assert kv({"prompt_tokens": 200, "max_tokens": 57}) == 2 * BLOCK


def test_the_kv_in_flight_counts_the_arrivals_of_the_last_service_time_per_model() -> None:
    """By hand: m0's requests at 0, 1, 1.5 and 4 s (one block each, two for the third), W = 2 s: at 1.5 s the three
    first are in flight (4 blocks); at 4 s only the last. m1's two requests together hold 3 blocks."""
    rows = [{"t": 0.0, "model": "m0", "prompt_tokens": 100, "max_tokens": 10},
            {"t": 1.0, "model": "m0", "prompt_tokens": 100, "max_tokens": 10},
            {"t": 1.0, "model": "m1", "prompt_tokens": 300, "max_tokens": 10},
            {"t": 1.5, "model": "m0", "prompt_tokens": 400, "max_tokens": 10},
            {"t": 1.9, "model": "m1", "prompt_tokens": 100, "max_tokens": 10},
            {"t": 4.0, "model": "m0", "prompt_tokens": 100, "max_tokens": 10}]
    busiest = load.in_flight(rows, 2.0, kv)
    assert (busiest.bytes, busiest.model, busiest.t, busiest.requests) == (4 * BLOCK, "m0", 1.5, 3)
    assert load.in_flight(rows, 0.4, kv).bytes == 2 * BLOCK  # W short: the 400-token request alone (or m1's first)
    assert load.in_flight(rows, 0.4, kv).requests == 1


def make(shape: str) -> Callable[[float], list[dict]]:
    def at(rate: float) -> list[dict]:
        return make_trace(shape=shape, models=3, duration_s=20.0, peak_rate=rate, seed=7, prompt_tokens=(96, 320),
                          output_tokens=(8, 24))
    return at


@pytest.mark.parametrize("shape", ["ramps", "bursty", "saturated"])
def test_every_shape_but_steady_is_raised_until_the_kv_in_flight_reaches_two_shares(shape: str) -> None:
    """A share's rate that alone would keep the KV in flight near one share: the peak is raised above the rate rule
    until the busiest model's KV in flight reaches twice a share, and not far past it."""
    share = 8 * BLOCK
    found = load.traffic(make(shape), share_rate=1.0, service_s=1.0, share_bytes=share, kv_of=kv, memory_rule=True)
    assert found.busiest.bytes >= load.MEMORY_RULE * share
    assert found.busiest == load.in_flight(found.trace, 1.0, kv)  # what it says is what the trace holds
    assert found.peak_rate > load.PEAK_RULE * 1.0 == found.rate_rule_rate
    assert load.in_flight(make(shape)(found.rate_rule_rate), 1.0, kv).bytes < load.MEMORY_RULE * share
    line = found.lines()[0]
    assert line.startswith(f"traffic: peak {found.peak_rate:g} requests/s per model, the larger of 2 x a share's "
                           "rate (2)") and "reaches 2 x a share (8.0 MiB) in the trace" in line


def test_the_rate_rule_stands_where_it_already_binds_memory_and_steady_keeps_it() -> None:
    share = 2 * BLOCK
    found = load.traffic(make("ramps"), share_rate=5.0, service_s=2.0, share_bytes=share, kv_of=kv, memory_rule=True)
    assert found.peak_rate == 10.0 and found.busiest.bytes >= 2 * share
    steady = load.traffic(make("steady"), share_rate=0.5, service_s=1.0, share_bytes=64 * BLOCK, kv_of=kv,
                          memory_rule=True, steady=True)
    assert steady.peak_rate == 1.0 and steady.busiest.bytes < 2 * 64 * BLOCK  # a share's capacity, nothing to win
    assert not steady.memory_rule and "every model at 0.5 requests/s" in steady.lines()[0]
    small = load.traffic(make("ramps"), share_rate=0.5, service_s=1.0, share_bytes=64 * BLOCK, kv_of=kv,
                         memory_rule=False)  # the small scale: the rate rule alone
    assert small.peak_rate == 1.0 and small.lines()[0].startswith("traffic: peak 1 requests/s per model (2 x a share")


def test_a_rule_that_would_take_more_requests_than_a_run_can_replay_is_refused_in_one_line() -> None:
    with pytest.raises(RuntimeError, match=r"only with more than 20000 requests a run \(peak [0-9.]+ requests/s, "
                                           r"service time 1e-06 s\)"):
        load.traffic(make("ramps"), share_rate=0.01, service_s=1e-6, share_bytes=1 << 40, kv_of=kv, memory_rule=True)
