"""``python -m benchmarks multimodel`` end to end on a short trace: every request answered, both ways.

No timing assertions: the figures come from the benchmark itself.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from benchmarks import multimodel


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_every_request_of_a_short_trace_is_answered_and_no_port_stays_bound(elastic: bool, tmp_path: Path) -> None:
    trace = multimodel.make_trace(seed=1, models=2, duration_s=12.0, peak_rate=1.0, prompt_tokens=(200, 400),
                                  output_tokens=(4, 8))
    assert len(trace) >= 2
    run = multimodel.run_config(elastic, trace, 2, tmp_path)
    total = run["summary"]["total"]
    assert total["requests"] == len(trace)
    assert total["answered"] == len(trace), [r for r in run["requests"] if r["error"] or r["ttft"] is None]
    assert all(r["tokens"] >= 4 for r in run["requests"])
    for port in run["ports"]:
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
