"""The multimodel benchmark at operator scale: its arithmetic against declared devices, the long-context trace, the
report's preemption check and limit of sharing, and the whole command on CPU with a tiny model (the smoke test)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.fair import longctx, report, scale
from benchmarks.fair.trace import make_trace

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 1 << 30, 1 << 20
H100 = 81559 * MiB  # what an H100 80 GB reports
H200 = 143771 * MiB  # what an H200 141 GB reports
SHAPES = {s.name: s for s in scale.GPU_SHAPES}


W8B = 16_060_522_496  # Llama-3.1-8B's parameters x 2 bytes


def measured(weights: int, static: int, elastic: int, *, total: int = H100, context: int = 512 * MiB) -> scale.Measured:
    return scale.Measured(total, total, context, weights, {"static": static, "elastic": elastic},
                          "declared for the test", 100)


def test_parameters_of_the_public_shapes() -> None:
    assert SHAPES["Llama-3.1-8B"].params() * 2 == W8B
    assert SHAPES["Llama-3.2-3B"].params() == 3_212_749_824  # tied embeddings
    assert SHAPES["Llama-3.2-1B"].params() == 1_235_814_400
    assert SHAPES["Llama-3.2-3B"].kv_token_bytes("bfloat16") == 2 * 28 * 8 * 128 * 2  # 112 KiB


def test_a_plan_places_weights_context_measured_working_memory_and_headroom_then_splits_the_rest() -> None:
    """Three 8B-shaped models on an H100 in turn, by hand: what is free, less the headroom, less three engines of the
    larger configuration (weights, context, working peak), split in three shares of whole 32 MiB blocks."""
    m = measured(W8B, 3 * GiB, 2 * GiB)
    headroom = int(H100 * 0.05)
    p = scale.plan(m, SHAPES["Llama-3.1-8B"], dtype="bfloat16", headroom_bytes=headroom, together=False)
    left = H100 - headroom - 3 * (W8B + 512 * MiB + 3 * GiB)  # static's working peak is the larger
    assert p.block_bytes == 32 * MiB and p.engines == 3
    assert p.share_blocks == left // 3 // (32 * MiB) - 2 and p.share_bytes == (p.share_blocks + 2) * 32 * MiB
    assert p.budget_bytes == 3 * p.share_bytes and p.used_bytes <= H100
    assert H100 - p.used_bytes < 3 * 32 * MiB  # nothing left that a share's block could use
    assert scale.fits(p, 4 * GiB)
    together = scale.plan(m, SHAPES["Llama-3.1-8B"], dtype="bfloat16", headroom_bytes=headroom, together=True)
    assert not scale.fits(together, 4 * GiB)  # six engines' weights alone are more than the device
    lines = "\n".join(p.lines())
    assert "15.0 GiB weights + 512.0 MiB CUDA context + measured working peak (static 3.0 GiB, elastic 2.0 GiB" \
        in lines, lines
    assert "(KVCACHED_DEVICE_HEADROOM) kept free" in lines
    assert "the configurations in turn (both cannot live at once" in lines
    assert f"a static share {p.share_blocks} blocks of 256 tokens (+2 padding)" in lines


def test_choose_measures_only_shapes_whose_weights_leave_room_each_once_and_prefers_both_at_once() -> None:
    seen: list[str] = []

    def measure(shape: scale.Shape) -> scale.Measured:
        seen.append(shape.name)
        return measured(shape.params() * 2, 3 * GiB, 3 * GiB)

    kw = {"free_bytes": H100, "total_bytes": H100, "dtype": "bfloat16", "headroom_bytes": int(H100 * 0.05),
          "min_share": 4 * GiB}
    p = scale.choose(scale.GPU_SHAPES, measure, **kw)
    # 8B: six engines' weights do not fit, so it is not measured for the plans at once; 3B and 1B are, in turn
    assert seen == ["Llama-3.2-3B", "Llama-3.2-1B"]
    assert p.shape.name == "Llama-3.2-1B" and p.together
    seen.clear()
    p = scale.choose(scale.GPU_SHAPES[:1], measure, **kw)  # one shape asked for (--model)
    assert seen == ["Llama-3.1-8B"] and p.shape.name == "Llama-3.1-8B" and not p.together


def test_measured_working_memory_can_move_a_plan_in_turn_or_leave_nothing() -> None:
    def with_working(work: int) -> Callable[[scale.Shape], scale.Measured]:
        return lambda shape: measured(shape.params() * 2, work, work)

    kw = {"free_bytes": H100, "total_bytes": H100, "dtype": "bfloat16", "headroom_bytes": int(H100 * 0.05),
          "min_share": 4 * GiB}
    assert scale.choose(scale.GPU_SHAPES[1:2], with_working(GiB), **kw).together  # 3B: both at once
    assert not scale.choose(scale.GPU_SHAPES[1:2], with_working(3 * GiB), **kw).together  # in turn
    with pytest.raises(ValueError, match="no model size fits"):
        scale.choose(scale.GPU_SHAPES[:1], with_working(8 * GiB), **kw)


def test_the_mix_is_seeded_within_its_ranges_and_in_its_proportions() -> None:
    def trace(seed: int) -> list[dict]:
        return make_trace(shape="steady", models=3, duration_s=300, peak_rate=4.0, seed=seed, prompt_tokens=(0, 0),
                          output_tokens=longctx.OUTPUT_TOKENS, prompt_mix=longctx.MIX)

    rows = trace(7)
    assert rows == trace(7) and rows != trace(8)
    assert all(1024 <= r["prompt_tokens"] <= 8192 and 64 <= r["max_tokens"] <= 256 for r in rows)
    rng = random.Random(3)
    draws = [longctx.draw(rng, longctx.MIX) for _ in range(20000)]
    counts = [0] * len(longctx.MIX)
    for n in draws:
        counts[longctx.bucket_of(n, longctx.MIX)] += 1
    for (weight, _, _), count in zip(longctx.MIX, counts, strict=True):
        assert abs(count / len(draws) - weight) < 0.02, (weight, count)
    small = longctx.scaled(longctx.MIX, 100, 800)
    assert longctx.bounds(small) == (100, 800) and [w for w, _, _ in small] == [w for w, _, _ in longctx.MIX]
    assert all(100 <= longctx.draw(rng, small) <= 800 for _ in range(2000))


def _run(config: str, pair: int, preempted: list[int] | None, tokens: float = 10.0, p99: float = 1.0) -> dict:
    return {"configuration": config, "pair": pair, "counted": config != "alone", "kind": "alone" if config == "alone"
            else "pair", "preempted": preempted, "offload_rounds": len(preempted or ()), "run": 0,
            "by_model": {"m0": {"tokens_per_s": tokens, "ttft_p99_s": p99, "answered": 1, "tokens": 1}}}


def test_the_preemption_check_names_what_elastic_preempted_alone() -> None:
    fine = report.preemptions([_run("static", 1, [3, 5]), _run("elastic", 1, [5]), _run("elastic", 2, []),
                               _run("static", 2, [])])
    assert fine["preemption_check"] is True and "yes, in every pair" in "".join(fine["preemption_lines"])
    bad = report.preemptions([_run("static", 1, [3]), _run("elastic", 1, [3, 9])])
    assert bad["preemption_check"] is False and "pair 1: elastic preempted requests 9" in "".join(bad["preemption_lines"])
    assert report.preemptions([_run("static", 1, None), _run("elastic", 1, None)])["preemption_check"] is None


def test_the_limit_of_sharing_compares_the_busy_model_run_by_run() -> None:
    runs = [_run("elastic", 1, [], tokens=9.0, p99=2.0), _run("elastic", 2, [], tokens=10.0, p99=1.0),
            _run("alone", 1, [], tokens=10.0, p99=1.0), _run("alone", 2, [], tokens=10.0, p99=1.0)]
    limit = report.limit_of_sharing(runs)
    assert limit["alone_tokens_ratio_median"] == 0.95 and limit["alone_ttft_p99_ratio_median"] == 0.75
    assert report.limit_of_sharing(runs[:2]) == {}


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks", "multimodel", "--engine", "transformers", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("args", "said"), [
    (["--scale", "operator", "--device-memory", "lots"], "--device-memory lots: a size such as 80GiB"),
    (["--device-memory", "80GiB"], "--device-memory goes with --scale operator"),
    (["--scale", "operator", "--share", "8"], "--share goes with --scale small"),
])
def test_bad_operator_options_are_usage_errors(args: list[str], said: str) -> None:
    proc = cli(*args)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr


def test_a_device_nothing_fits_is_one_line() -> None:
    from test_bench_multimodel_tcb import UNSUPPORTED

    if UNSUPPORTED is not None:
        pytest.skip(UNSUPPORTED)
    proc = cli("--device", "cpu", "--scale", "operator", "--device-memory", "16MiB")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["multimodel: no model size fits 16.0 MiB free with shares of 4.0 MiB "
                                                "or more beside the weights, the working memory and the headroom "
                                                "(smallest: tiny Llama)"]


@pytest.mark.slow
def test_operator_scale_on_cpu_prints_its_plan_answers_everything_and_saves_kvtops_screen(tmp_path: Path) -> None:
    """The saturated shape, one pair, on a declared device too small for both configurations at once: the profiling
    passes first, then the plan from what they measured, in turn (pair 1 goes on from the elastic warm-up); the
    traffic's rule printed and met (the KV in flight of the busy model reaches two shares); every run of static,
    elastic and alone answers every request; the report holds the plan, the limit of sharing and the preemption
    check; kvtop's screen is an SVG naming the elastic models."""
    from test_bench_multimodel_tcb import UNSUPPORTED

    if UNSUPPORTED is not None:
        pytest.skip(UNSUPPORTED)
    svg = tmp_path / "kvtop.svg"
    proc = cli("--device", "cpu", "--scale", "operator", "--shape", "saturated", "--pairs", "1", "--duration", "1.5",
               "--device-memory", "256MiB", "--screenshot", str(svg), "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    lines = out.splitlines()
    assert lines[0].startswith("profiling tiny Llama-shaped engines (a pass at max_batch_tokens 512 with prompts of "
                               "800 tokens)"), out[:500]
    assert lines[1].startswith("plan: device 256.0 MiB, 256.0 MiB free; 3 x tiny Llama-shaped"), out[:500]
    assert "the configurations in turn (both cannot live at once" in lines[1]
    assert "measured working peak (static " in lines[2] and "peak resident memory (VmHWM)" in lines[2]
    rep = json.loads((tmp_path / "multimodel-transformers-cpu-operator-saturated.json").read_text())
    plan = rep["plan"]
    assert rep["scale"] == "operator" and not rep["together"] and plan["share_blocks"] > 0
    assert all(plan["measured"]["working_bytes"][c] > 0 for c in ("static", "elastic"))
    assert plan["headroom_bytes"] == int(256 * 1024 * 1024 * 0.05)  # KVCACHED_DEVICE_HEADROOM's default, 5%
    assert rep["budget_bytes"] == plan["budget_bytes"] == 3 * (plan["share_blocks"] + 2) * 2 * 1024 * 1024
    assert plan["used_bytes"] <= 256 * 1024 * 1024
    traffic = rep["traffic"]
    assert traffic["memory_rule"] and traffic["in_flight_peak_bytes"] >= 2 * rep["share_bytes"]
    assert traffic["peak_rate"] >= 2 * rep["calibration"]["requests_per_s"] - 0.01
    assert any(line.startswith(f"traffic: peak {traffic['peak_rate']:g} requests/s per model") for line in lines)
    assert sorted(rep["engine_working"]) == [f"{c}-m{m}" for c in ("alone", "elastic", "static") for m in range(3)
                                             if c != "alone" or m == 0]
    runs = rep["runs"]
    assert [(r["kind"], r["configuration"]) for r in runs] == [
        ("warm-up", "static"), ("warm-up", "elastic"), ("pair", "elastic"), ("pair", "static"),
        ("warm-up", "alone"), ("alone", "alone")]
    assert rep["engine_starts"] == ["static", "elastic", "static", "alone"]  # in turn: one switch inside the pair
    for run in runs:
        assert run["answered"] == run["requests"] == (rep["trace_requests"] if run["configuration"] != "alone"
                                                      else run["requests"]) > 0, run["run"]
        assert run["preempted"] is not None and run["elapsed_s"] > 0
        assert len(run["ttft_by_arrival"]) == run["requests"]
        assert f"{run['elapsed_s']:.1f} s, " in out
    assert rep["preemption_check"] in (True, False) and rep["alone_tokens_ratio_median"] is not None
    table = (tmp_path / "multimodel-transformers-cpu-operator-saturated.md").read_text()
    assert "**Check: nothing preempted by elastic that static did not preempt too:" in table
    assert "**The limit of sharing (m0, the busy model): tokens/s elastic/alone median" in table
    assert "- device 256.0 MiB, 256.0 MiB free; 3 x tiny Llama-shaped" in table
    assert "kvtop's screen (kvtop.svg, 160x50)" in table
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = svg.read_text()
    assert all(f"elastic-m{m}" in text for m in range(3)) and "kvtop" in text
    assert rep["screenshot"]["model"] in {f"elastic-m{m}" for m in range(3)}
