"""The multimodel benchmark's vLLM driver end to end on a short trace: every request answered, both ways.

The harness's own path (``benchmarks/fair/run.py``): one start of every engine (static and elastic side by side,
as the benchmark runs them), one warm-up per configuration and one ABBA pair, the report written; under three
minutes on two cores. No timing assertions: the figures come from the benchmark itself.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from benchmarks.fair import report as rep
from benchmarks.fair import vllm as driver
from benchmarks.fair.run import run

MODELS = ("m0", "m1")


def test_every_request_of_a_short_trace_is_answered_both_ways_and_no_port_stays_bound(tmp_path: Path) -> None:
    """Prefix caching on (vLLM's default) in both configurations."""
    trace = driver.make_trace(seed=1, models=2, duration_s=6.0, peak_rate=2.0, prompt_tokens=(300, 500),
                              output_tokens=(4, 8), system_tokens=256)
    assert len(trace) >= 2
    trace_file = tmp_path / "trace.json"
    trace_file.write_text(json.dumps({"models": 2, "requests": trace}))
    bench = driver.VllmDriver(workdir=tmp_path / "work", shape="ramps", seed=1, single=False, quick=True,
                              prefix_caching=True, trace_file=trace_file)
    code = run(bench, pairs=1, seed=1, shape="ramps", single=False, command="c", stem=tmp_path / "report")
    report = json.loads((tmp_path / "report.json").read_text())
    runs = report["runs"]
    assert code == 0, [(r["configuration"], r["answered"], r["errors"]) for r in runs]
    # warm-ups, then the pair; every request answered in each run, each with at least its 4 tokens
    assert [(r["configuration"], r["kind"]) for r in runs] == [
        ("static", "warm-up"), ("elastic", "warm-up"), ("static", "pair"), ("elastic", "pair")]
    assert all(r["answered"] == r["requests"] == len(trace) for r in runs), [(r["answered"], r["errors"]) for r in runs]
    assert all(r["tokens"] >= 4 * len(trace) for r in runs)
    assert report["prefix_caching"] is True
    assert report["ttft_p99_ratio_min"] <= report["ttft_p99_ratio_median"] <= report["ttft_p99_ratio_max"]
    assert report["throughput_ratio_median"] > 0
    # Prefix caching is on in both configurations: every run found its models' system prompts cached.
    assert [(p["run"], p["configuration"]) for p in report["prefix_cache"]] == [
        (r["run"], r["configuration"]) for r in runs]
    assert all(0 < p["hit_tokens"] <= p["queried_tokens"] for p in report["prefix_cache"]), report["prefix_cache"]
    # each run's requests are others (no prefix hit on the run before's), their system prompts the same
    first, again = driver.prompt_ids(driver.salted(trace[0], "static0")), \
        driver.prompt_ids(driver.salted(trace[0], "static2"))
    system = trace[0]["system_tokens"]
    assert first[:system] == again[:system] and first[system:] != again[system:]
    # the report lists every run, in order
    text = (tmp_path / "report.md").read_text()
    assert text == rep.markdown(report) and text.count("| static |") == 2 and text.count("| elastic |") == 2
    # The elastic engines' segments were sampled through each elastic run: what each model mapped, never more than
    # the shared budget, and its reclaim figures; the run's totals from them.
    for elastic in (r for r in runs if r["configuration"] == "elastic"):
        samples = elastic["kv_samples"]
        assert samples and all(s[m]["mapped"] for s in samples for m in MODELS), samples[:3]
        assert all(s[m][k] is not None for s in samples for m in MODELS for k in ("gave", "took", "gave_count",
                                                                                  "took_count"))
        assert all(sum(s[m]["mapped"] for m in MODELS) <= bench.capacity() for s in samples)
        assert None not in (elastic["gave_bytes"], elastic["took_bytes"], elastic["unused_bytes_peak"])
    # Every engine is gone: no port answers, no process of its group is left.
    for config, engines in bench.engines.items():
        for eng in engines:
            assert not driver.group_alive(eng.proc.pid), (config, eng.name)
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", eng.port)) != 0, f"{config}: port {eng.port} still answers"
