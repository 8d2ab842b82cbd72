"""The multimodel benchmark at operator scale: its arithmetic against declared devices, the long-context trace, the
report's preemption check and limit of sharing, and the whole command on CPU with a tiny model (the smoke test)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks.fair import longctx, report, scale
from benchmarks.fair.trace import make_trace

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 1 << 30, 1 << 20
H100 = 81559 * MiB  # what an H100 80 GB reports
H200 = 143771 * MiB  # what an H200 141 GB reports
SHAPES = {s.name: s for s in scale.GPU_SHAPES}


def gpu_plan(device: int) -> scale.Plan:
    return scale.choose(device, scale.GPU_SHAPES, dtype="bfloat16", activation_bytes=5 * GiB // 2,
                        margin_bytes=GiB, min_share=4 * GiB)


def test_parameters_of_the_public_shapes() -> None:
    assert SHAPES["Llama-3.1-8B"].params() == 8_030_261_248
    assert SHAPES["Llama-3.2-3B"].params() == 3_212_749_824  # tied embeddings
    assert SHAPES["Llama-3.2-1B"].params() == 1_235_814_400
    assert SHAPES["Llama-3.2-3B"].kv_token_bytes("bfloat16") == 2 * 28 * 8 * 128 * 2  # 112 KiB


def test_an_h100_runs_three_3b_shaped_models_both_configurations_at_once() -> None:
    p = gpu_plan(H100)
    assert p.shape.name == "Llama-3.2-3B" and p.together and p.engines == 6
    assert p.weights_bytes == 6_425_499_648  # 3.21 B parameters x 2 bytes
    assert p.block_bytes == 28 * MiB  # 112 KiB x 256 tokens
    # by hand: 85,520,809,984 - 1 GiB margin - 6 x (6,425,499,648 + 2.5 GiB) = 29,787,942,912 bytes of KV, in 6
    # shares of 4,964,657,152 bytes = 169.1 blocks of 28 MiB: 169 blocks, two of them padding
    assert H100 - GiB - 6 * (6_425_499_648 + 5 * GiB // 2) == 29_787_942_912
    assert p.share_blocks == 167 and p.share_bytes == 169 * 28 * MiB >= 4 * GiB
    assert p.budget_bytes == 3 * 169 * 28 * MiB  # 13.86 GiB: elastic's one budget, the shares added up
    assert p.used_bytes <= H100
    # 8B-shaped: six engines' weights alone (89.7 GiB) do not fit
    assert not scale.fits(scale.plan(H100, SHAPES["Llama-3.1-8B"], dtype="bfloat16", activation_bytes=5 * GiB // 2,
                                     margin_bytes=GiB), 4 * GiB)


def test_an_h200_runs_three_8b_shaped_models_both_configurations_at_once() -> None:
    p = gpu_plan(H200)
    assert p.shape.name == "Llama-3.1-8B" and p.together
    assert p.weights_bytes == 16_060_522_496 and p.block_bytes == 32 * MiB
    # by hand: 150,754,820,096 - 1 GiB - 6 x (16,060,522,496 + 2.5 GiB) = 37,211,815,936; / 6 / 32 MiB = 184.8
    assert H200 - GiB - 6 * (16_060_522_496 + 5 * GiB // 2) == 37_211_815_936
    assert p.share_blocks == 182 and p.share_bytes == 184 * 32 * MiB >= 4 * GiB
    assert p.budget_bytes == 3 * 184 * 32 * MiB and p.used_bytes <= H200


def test_a_device_too_small_for_both_at_once_runs_them_in_turn_and_none_fitting_is_refused() -> None:
    p = gpu_plan(40 * GiB)  # even 1B-shaped: (40 - 1 - 6 x 4.8) / 6 = 1.7 GiB shares, under 4 GiB
    assert p.shape.name == "Llama-3.2-3B" and not p.together and p.engines == 3
    assert p.share_bytes >= 4 * GiB and p.used_bytes <= 40 * GiB
    with pytest.raises(ValueError, match="no model size fits"):
        gpu_plan(16 * GiB)


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
    assert proc.stderr.strip().splitlines() == ["multimodel: no model size fits 16.0 MiB with shares of 4.0 MiB or "
                                                "more (smallest: tiny Llama)"]


@pytest.mark.slow
def test_operator_scale_on_cpu_prints_its_plan_answers_everything_and_saves_kvtops_screen(tmp_path: Path) -> None:
    """The saturated shape, one pair: the plan printed first; every run of static, elastic and alone answers every
    request; the report holds the plan, the limit of sharing and the preemption check; kvtop's screen is an SVG
    naming the elastic models."""
    from test_bench_multimodel_tcb import UNSUPPORTED

    if UNSUPPORTED is not None:
        pytest.skip(UNSUPPORTED)
    svg = tmp_path / "kvtop.svg"
    proc = cli("--device", "cpu", "--scale", "operator", "--shape", "saturated", "--pairs", "1", "--duration", "1.5",
               "--device-memory", "128MiB", "--screenshot", str(svg), "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("plan: device 128.0 MiB; 3 x tiny Llama-shaped"), out[:500]
    assert "both configurations' engines alive at once" in out.splitlines()[0]
    rep = json.loads((tmp_path / "multimodel-transformers-cpu-operator-saturated.json").read_text())
    assert rep["scale"] == "operator" and rep["together"] and rep["plan"]["share_blocks"] == 12
    assert rep["budget_bytes"] == rep["plan"]["budget_bytes"] == 3 * 14 * 512 * 1024
    runs = rep["runs"]
    assert [(r["kind"], r["configuration"]) for r in runs] == [
        ("warm-up", "static"), ("warm-up", "elastic"), ("pair", "static"), ("pair", "elastic"),
        ("warm-up", "alone"), ("alone", "alone")]
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
    assert "- device 128.0 MiB; 3 x tiny Llama-shaped" in table and "kvtop's screen (kvtop.svg, 160x50)" in table
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = svg.read_text()
    assert all(f"elastic-m{m}" in text for m in range(3)) and "kvtop" in text
    assert rep["screenshot"]["model"] in {f"elastic-m{m}" for m in range(3)}
