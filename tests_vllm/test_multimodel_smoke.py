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
    """The report's first row, prefix caching on (vLLM's default) in both configurations."""
    trace = multimodel.make_trace(seed=1, models=2, duration_s=6.0, peak_rate=2.0, prompt_tokens=(300, 500),
                                  output_tokens=(4, 8), system_tokens=256)
    assert len(trace) >= 2
    row = multimodel.run_row(trace, 2, tmp_path / "prefix-on", True, repeats=2)
    assert row["prefix_caching"] is True and "ttft_p99_ratio" in row and "throughput_ratio" in row
    # two repeats per configuration, interleaved, every request answered in each; the pair ratios' median and range
    assert [(r["configuration"], r["repeat"]) for r in row["repeats"]] == [
        ("static", 1), ("elastic", 1), ("static", 2), ("elastic", 2)]
    assert all(r["answered"] == r["requests"] == len(trace) for r in row["repeats"]), row["repeats"]
    assert row["ttft_p99_ratio_min"] <= row["ttft_p99_ratio_median"] <= row["ttft_p99_ratio_max"]
    assert row["throughput_ratio_median"] > 0
    # the second repeat's requests are others (no prefix hit on the first's), their system prompts the same
    assert multimodel.salted(trace, 1)[0]["seed"] != trace[0]["seed"]
    first, again = multimodel.prompt_ids(trace[0]), multimodel.prompt_ids(multimodel.salted(trace, 1)[0])
    system = trace[0]["system_tokens"]
    assert first[:system] == again[:system] and first[system:] != again[system:]
    text = multimodel.markdown({"mode": "quick", "command": "c", "date": "d", "machine": "m", "versions": {},
                                "loadavg_start": [0], "loadavg_end": [0], "seconds": 1.0, "rows": [row]})
    assert "every repeat, in order" in text and text.count("| static |") == 2 + 3  # two repeats, three table rows
    runs = row["runs"]
    assert sorted(runs) == ["elastic", "static"]
    for config, run in runs.items():
        total = run["summary"]["total"]
        assert total["requests"] == len(trace), config
        assert total["answered"] == len(trace), (config, [r for r in run["requests"] if r["error"] or r["ttft"] is None])
        assert all(r["tokens"] >= 4 for r in run["requests"]), config
        # Prefix caching is on in both configurations: the models' system prompts were found cached.
        assert total["prefix_hit_tokens"] > 0, (config, total)
        # KV bytes were sampled from the engines (static: vLLM's metrics; elastic: the live segments).
        assert run["samples"] and all(s["held"][m] for s in run["samples"] for m in ("m0", "m1")), config
        for port in run["ports"]:
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", port)) != 0, f"{config}: port {port} still answers"
    # The elastic samples carry each segment's reclaim figures, and its summary their totals.
    elastic = runs["elastic"]
    assert all(set(s["pressure"][m]) == set(multimodel.PRESSURE_KEYS) for s in elastic["samples"] for m in ("m0", "m1"))
    assert set(elastic["summary"]["total"]["reclaim"]) == set(multimodel.PRESSURE_KEYS[:-1])
    # The elastic engines hold what they map, never more than the shared budget.
    capacity = multimodel.capacity_bytes(2)
    assert all(sum(s["held"].values()) <= capacity for s in elastic["samples"])
