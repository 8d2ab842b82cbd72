"""``python -m benchmarks multimodel`` end to end on a short trace: every request answered, both ways.

One start of every engine (static and elastic side by side, as the benchmark runs them), so the
test stays under three minutes on two cores. No timing assertions: the figures come from the
benchmark itself.
"""

from __future__ import annotations

import socket
from pathlib import Path

from benchmarks import multimodel


def test_every_request_of_a_short_trace_is_answered_both_ways_and_no_port_stays_bound(tmp_path: Path) -> None:
    trace = multimodel.make_trace(seed=1, models=2, duration_s=6.0, peak_rate=2.0, prompt_tokens=(200, 400),
                                  output_tokens=(4, 8))
    assert len(trace) >= 2
    runs = multimodel.run_both(trace, 2, tmp_path)
    assert sorted(runs) == ["elastic", "static"]
    for config, run in runs.items():
        total = run["summary"]["total"]
        assert total["requests"] == len(trace), config
        assert total["answered"] == len(trace), (config, [r for r in run["requests"] if r["error"] or r["ttft"] is None])
        assert all(r["tokens"] >= 4 for r in run["requests"]), config
        # KV bytes were sampled from the engines (static: vLLM's metrics; elastic: the live segments).
        assert run["samples"] and all(s["held"][m] for s in run["samples"] for m in ("m0", "m1")), config
        for port in run["ports"]:
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", port)) != 0, f"{config}: port {port} still answers"
    # The elastic engines hold what they map, never more than the shared budget.
    capacity = multimodel.capacity_bytes(2)
    assert all(sum(s["held"].values()) <= capacity for s in runs["elastic"]["samples"])
