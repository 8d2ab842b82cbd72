"""Several transformers continuous batching engines sharing one KV budget: static against elastic, repeated.

    python -m benchmarks multimodel --engine transformers --device cpu|cuda [--quick] [--repeats N]
                                    [--shape ramps|bursty|saturated] [--no-write]

Three models (random weights built in place, Llama-shaped; ``MODELS`` says which sizes and why), one
process each, every one running transformers' own continuous batching (``init_continuous_batching``,
greedy, ``sdpa``, no CUDA graphs, no async batching, no prefix sharing: the same in both configurations):

- **static**: plain transformers, each model with a fixed cache of a third of the budget
  (``ContinuousBatchingConfig.num_blocks``): what users run today;
- **elastic**: the same engines on kvcached (``kvcached_transformers.cb.install``), one budget shared
  by all three (``KVCACHED_DEVICE_BUDGET`` on a GPU, ``KVCACHED_HOST_CAPACITY`` on CPU), each model's
  capacity the whole budget.

The budget is the static caches added up, their two padding blocks each included (elastic keeps its
padding blocks inside the budget). The trace (``--shape``, :func:`rate_at`): per model a triangular ramp of
Poisson arrivals from 0 to a peak and back, the peaks staggered (the public kvcached's
bench_latency_benefit shape, the default); or bursty (one model flooded at a time, the others idle); or
saturated (one model at the peak rate all along, the others idle). The peak rate
comes from a declared rule applied to a measured figure: ``PEAK_RULE`` times the requests per second one
static share serves, measured in this run by a short calibration (``CALIBRATION_FACTOR`` times the
requests its cache holds at once, all submitted together to one static engine). The seed is fixed and
recorded. Both configurations' engines start once and stay up; the trace is replayed ``--repeats`` times
per configuration, interleaved (static, elastic, static, ...). Each run's TTFT (first token's time
minus the request's arrival in the trace) p99 and mean and its tokens/s are listed; the report gives
per pair of runs the ratios static/elastic for TTFT and elastic/static for throughput, their median
and range. Engines are stopped on Ctrl-C and on failure.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._common import pair_ratios

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
SEED = 31
PEAK_RULE = 2.0  # the peak rate: twice the requests per second one static share serves
BASE_FRACTION = 0.05  # arrivals between peaks, as a fraction of the peak rate
CALIBRATION_FACTOR = 3  # calibration: three times the requests a static share holds at once
PAGE_TOKENS = 256  # transformers' block (page_size): one kvcached block per sector


@dataclass(frozen=True)
class Setup:
    """One machine's models, shares and trace; ``why`` says why a static share runs out of KV memory first."""

    device: str
    dtype: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    share_blocks: int  # a static share: blocks of PAGE_TOKENS tokens (+ 2 padding blocks)
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    duration_s: float
    max_batch_tokens: int
    max_requests: int
    threads: int
    why: str

    @property
    def kv_token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (2 if self.dtype == "bfloat16" else 4)

    @property
    def block_bytes(self) -> int:
        return self.kv_token_bytes * PAGE_TOKENS

    @property
    def fits_at_once(self) -> int:
        """Requests of the longest shape one static share holds at once."""
        longest = self.prompt_tokens[1] + self.output_tokens[1]
        return max(1, self.share_blocks // -(-longest // PAGE_TOKENS))


MODELS = {
    "cuda": Setup(
        device="cuda", dtype="bfloat16", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
        intermediate=8192, vocab=32000, share_blocks=6, prompt_tokens=(256, 512), output_tokens=(32, 64),
        duration_s=30.0, max_batch_tokens=2048, max_requests=64, threads=2,
        why="Llama-3.2-1B-shaped (16 layers, 8 KV heads of 64, bf16: 32 KiB of KV per token, 8 MiB per block "
            "of 256 tokens). A static share of 6 blocks (48 MiB) holds 2-3 requests at once; on an H200 a "
            "decode step of 3 or of 12 requests costs about the same (measured there: with 64 requests at once, "
            "16x the cache gave 3.1x the tokens/s), so the share's KV memory, not compute, bounds what it serves."),
    "cpu": Setup(
        device="cpu", dtype="float32", layers=2, hidden=256, heads=8, kv_heads=4, head_dim=32,
        intermediate=512, vocab=512, share_blocks=6, prompt_tokens=(96, 320), output_tokens=(8, 24),
        duration_s=24.0, max_batch_tokens=1024, max_requests=32, threads=1,
        why="a tiny Llama (2 layers, 4 KV heads of 32, fp32: 512 KiB per block of 256 tokens); a static share "
            "of 6 blocks holds 3 requests at once. On 2 CPU cores compute grows with the batch, so lending "
            "KV memory buys little here: this run checks the benchmark, the H200 measures the headline."),
}


def shares_bytes(setup: Setup, models: int) -> int:
    """The budget: every static cache, its two padding blocks included."""
    return models * (setup.share_blocks + 2) * setup.block_bytes


# -- the trace -------------------------------------------------------------------------------------
SHAPES = ("ramps", "bursty", "saturated")


def rate_at(shape: str, m: int, models: int, t: float, duration: float, peak: float) -> float:
    """Model ``m``'s arrival rate at ``t`` (requests/s) for each trace shape.

    - ramps: a triangle 0 -> ``peak`` -> 0 per model, peaks staggered (the public benchmark's shape);
    - bursty: the duration cut into ``2 * models`` slots taken in turn; in its slots a model is flooded at
      ``peak``, the others idle;
    - saturated: model 0 at ``peak`` all along, the others idle (the public kvcached's overhead table).
    Outside its load each model gets ``BASE_FRACTION`` of the peak (ramps and bursty) or nothing (saturated)."""
    base = peak * BASE_FRACTION
    if shape == "ramps":
        half = duration / (models + 1)
        return base + peak * max(0.0, 1.0 - abs(t - half * (m + 1)) / half)
    if shape == "bursty":
        slot = int(t / (duration / (2 * models)))
        return peak if slot % models == m else base
    return peak if m == 0 else 0.0


def make_trace(setup: Setup, models: int, peak_rate: float, shape: str = "ramps", seed: int = SEED) -> list[dict]:
    """Poisson arrivals per model at :func:`rate_at`'s rate (thinning), prompt and output lengths drawn uniformly."""
    rng = random.Random(seed)
    duration = setup.duration_s
    top = peak_rate * (1 + BASE_FRACTION)
    rows: list[dict] = []
    for m in range(models):
        t = 0.0
        while True:
            t += rng.expovariate(top)
            if t >= duration:
                break
            if rng.random() * top > rate_at(shape, m, models, t, duration, peak_rate):
                continue  # thinning: a non-homogeneous Poisson process
            rows.append({"t": round(t, 3), "model": f"m{m}", "prompt_tokens": rng.randint(*setup.prompt_tokens),
                         "max_tokens": rng.randint(*setup.output_tokens), "seed": rng.randrange(1 << 30)})
    rows.sort(key=lambda r: r["t"])
    return rows


def prompt_ids(row: dict, vocab: int) -> list[int]:
    rng = random.Random(row["seed"])
    return [1] + [rng.randrange(4, vocab) for _ in range(row["prompt_tokens"] - 1)]


# -- one engine per process ------------------------------------------------------------------------
def serve(spec: dict, inbox: Any, outbox: Any) -> None:
    """A child: build the model, start continuous batching (on kvcached when elastic), serve requests."""
    os.environ.update(spec["env"])  # before kvcached reads its settings
    sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["setup"].items()}
    setup = Setup(**fields)
    torch.set_num_threads(setup.threads)
    config = LlamaConfig(hidden_size=setup.hidden, intermediate_size=setup.intermediate,
                         num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.kv_heads, head_dim=setup.head_dim, vocab_size=setup.vocab,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(spec["seed"])
    dtype = getattr(torch, setup.dtype)
    with torch.device(setup.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    offloads = [0]  # rounds in which transformers offloaded (here: restarted) requests for lack of cache
    offload = OffloadingManager.offload_requests

    def counted(self: Any) -> bool:
        done = offload(self)
        offloads[0] += bool(done)
        return done

    OffloadingManager.offload_requests = counted  # type: ignore[method-assign]
    handle = None
    if spec["elastic"]:
        from kvcached_transformers import cb

        handle = cb.install(model, name=spec["name"], num_blocks=spec["num_blocks"])
    gen = GenerationConfig(max_new_tokens=setup.output_tokens[1], do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_TOKENS, num_blocks=None if spec["elastic"] else spec["num_blocks"],
        max_batch_tokens=setup.max_batch_tokens, max_requests_per_batch=setup.max_requests,
        allow_block_sharing=False, use_async_batching=False, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    manager.start()
    stop = threading.Event()

    def results() -> None:
        while not stop.is_set():
            out = manager.get_result(timeout=0.2)
            if out is None or not out.is_finished():
                continue
            stamps = out.timestamps or []
            outbox.put(("done", spec["name"], out.request_id, stamps[0] if stamps else None,
                        stamps[-1] if stamps else None, len(out.generated_tokens), out.error))

    reader = threading.Thread(target=results, daemon=True)
    reader.start()
    manager.add_request([1, 5, 6, 7], request_id="warm", max_new_tokens=2, record_timestamps=True)
    outbox.put(("ready", spec["name"], None, None, None, 0, None))
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            if msg == "stats":
                outbox.put(("stats", spec["name"], None, offloads[0], None, 0, None))
                continue
            rid, ids, new = msg
            manager.add_request(ids, request_id=rid, max_new_tokens=new, record_timestamps=True, eos_token_id=-1)
    finally:
        stop.set()
        manager.stop(block=True, timeout=30)
        if handle is not None:
            handle.close()


class Engines:
    """One configuration's engines (child processes) and the queue their results come back on."""

    def __init__(self, ctx: Any, setup: Setup, models: int, elastic: bool, shm: Path) -> None:
        self.names = [f"{'e' if elastic else 's'}{m}" for m in range(models)]
        self.elastic, self.shm = elastic, shm
        self.outbox = ctx.Queue()
        self.inboxes = {name: ctx.Queue() for name in self.names}
        budget = shares_bytes(setup, models)
        env = {"KVCACHED_SHM_DIR": str(shm), "OMP_NUM_THREADS": str(setup.threads)}
        if elastic:  # warm pools as the vLLM benchmark sets them: a shared budget is not held in idle pools
            env.update({"KVCACHED_DEVICE_BUDGET" if setup.device == "cuda" else "KVCACHED_HOST_CAPACITY":
                        f"{budget >> 20}MiB", "KVCACHED_MIN_RESERVED_PAGES": "0",
                        "KVCACHED_MAX_RESERVED_PAGES": "1", "KVCACHED_IDLE_RETURN_S": "1"})
        blocks = budget // setup.block_bytes - 2 if elastic else setup.share_blocks
        self.procs = [ctx.Process(target=serve, daemon=True, args=(
            {"name": name, "elastic": elastic, "seed": SEED + m, "num_blocks": blocks, "env": env,
             "setup": setup.__dict__}, self.inboxes[name], self.outbox)) for m, name in enumerate(self.names)]
        for proc in self.procs:
            proc.start()
        self.pending: dict[str, list[tuple]] = {}
        self.offload_base = 0

    def wait_ready(self, timeout: float) -> None:
        waiting = set(self.names)
        warm = set(self.names)
        deadline = time.monotonic() + timeout
        while waiting or warm:
            msg = self.get(deadline - time.monotonic())
            if msg[0] == "ready":
                waiting.discard(msg[1])
            elif msg[2] == "warm":
                warm.discard(msg[1])

    def get(self, timeout: float) -> tuple:
        if timeout <= 0:
            raise RuntimeError("the engines did not answer in time")
        try:
            return self.outbox.get(timeout=min(timeout, 5.0))
        except queue.Empty:
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"an engine exited ({dead})") from None
            return self.get(timeout - 5.0)

    def offloads(self) -> int:
        """Offload rounds so far, all engines together (each engine counts from its start)."""
        for box in self.inboxes.values():
            box.put("stats")
        total, answers = 0, 0
        deadline = time.monotonic() + 30
        while answers < len(self.names):
            msg = self.get(deadline - time.monotonic())
            if msg[0] == "stats":
                total += msg[3]
                answers += 1
        count, self.offload_base = total - self.offload_base, total
        return count

    def send(self, model: int, rid: str, ids: list[int], new: int) -> None:
        self.inboxes[self.names[model]].put((rid, ids, new))

    def stop(self) -> None:
        for box in self.inboxes.values():
            with contextlib.suppress(Exception):
                box.put(None)
        deadline = time.monotonic() + 40
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def sample_segments(shm: Path, t0: float, stop: threading.Event, samples: list[dict]) -> None:
    """Every 0.5 s, each live elastic segment: bytes mapped, blocks in use, running and waiting requests, and its
    reclaim totals (bytes given to and taken from the other models)."""
    from kvcached_core import list_models

    while not stop.wait(0.5):
        row: dict = {"t": round(time.perf_counter() - t0, 2)}
        for m in list_models(directory=shm):
            if m.status != "live":
                continue
            p, t = m.pressure, m.traffic
            row[m.name] = {"mapped": m.mapped_bytes, "blocks_used": m.blocks_used,
                           "running": None if t is None else t.running, "waiting": None if t is None else t.waiting,
                           "gave": None if p is None else p.gave_total, "took": None if p is None else p.took_total}
        samples.append(row)


def replay(engines: Engines, trace: list[dict], setup: Setup, run: str, timeout_s: float) -> dict:
    """Send the trace in time; collect every answer. TTFT = first token's time - the request's arrival.
    Elastic engines' segments are sampled meanwhile (``kv_samples``)."""
    arrivals: dict[str, tuple[float, int]] = {}
    out = engines.pending.setdefault(run, [])
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.perf_counter() + 0.2
    watcher = threading.Thread(target=sample_segments, args=(engines.shm, t0, stop, samples), daemon=True)
    if engines.elastic:
        watcher.start()
    for i, row in enumerate(trace):
        delay = t0 + row["t"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rid = f"{run}-{i}"
        arrivals[rid] = (t0 + row["t"], int(row["model"][1:]))
        engines.send(int(row["model"][1:]), rid, prompt_ids(row, setup.vocab), row["max_tokens"])
        drain_nowait(engines, arrivals, out)
    deadline = time.monotonic() + timeout_s
    while len(out) < len(trace) and time.monotonic() < deadline:
        with contextlib.suppress(RuntimeError):
            msg = engines.get(min(5.0, deadline - time.monotonic()))
            keep(msg, arrivals, out)
    stop.set()
    if watcher.is_alive():
        watcher.join()
    offloads = engines.offloads()
    ttft = sorted(first - arrivals[rid][0] for rid, first, _, _ in out if first is not None)
    ends = [end for _, _, end, _ in out if end is not None]
    tokens = sum(n for _, _, _, n in out)
    span = (max(ends) - t0) if ends else float("nan")
    p99 = ttft[max(0, min(len(ttft) - 1, -(-99 * len(ttft) // 100) - 1))] if ttft else float("nan")
    by_arrival = sorted([round(arrivals[rid][0] - t0, 3), arrivals[rid][1],
                         None if first is None else round(first - arrivals[rid][0], 4)] for rid, first, _, _ in out)
    return {"requests": len(trace), "answered": len(out), "ttft_p99_s": round(p99, 4),
            "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else float("nan"),
            "tokens": tokens, "tokens_per_s": round(tokens / span, 2) if ends else 0.0,
            "offload_rounds": offloads, **reclaim_totals(samples), "kv_samples": samples,
            "ttft_by_arrival": by_arrival}


def reclaim_totals(samples: list[dict]) -> dict:
    """Bytes the models gave each other during the run (the last sample's totals less the first's), and the most
    bytes any one model held mapped at once."""
    if len(samples) < 2:
        return {}
    first, last = samples[0], samples[-1]
    names = [k for k in last if k != "t" and k in first]
    took = sum((last[n]["took"] or 0) - (first[n]["took"] or 0) for n in names)
    peak = max((row[n]["mapped"] for row in samples for n in row if n != "t"), default=0)
    return {"reclaimed_bytes": took, "peak_model_mapped_bytes": peak}


def drain_nowait(engines: Engines, arrivals: dict, out: list) -> None:
    while True:
        try:
            msg = engines.outbox.get_nowait()
        except queue.Empty:
            return
        keep(msg, arrivals, out)


def keep(msg: tuple, arrivals: dict, out: list) -> None:
    kind, _, rid, first, end, n, error = msg
    if kind == "done" and rid in arrivals:
        if error:
            raise RuntimeError(f"request {rid} failed: {error}")
        out.append((rid, first, end, n))


def calibrate(engines: Engines, setup: Setup) -> dict:
    """Requests per second one static share serves: CALIBRATION_FACTOR x what it holds, submitted at once."""
    count = CALIBRATION_FACTOR * setup.fits_at_once
    rng = random.Random(SEED - 1)
    rows = [{"t": 0.0, "model": "m0", "prompt_tokens": rng.randint(*setup.prompt_tokens),
             "max_tokens": rng.randint(*setup.output_tokens), "seed": rng.randrange(1 << 30)} for _ in range(count)]
    started = time.perf_counter()
    result = replay(engines, rows, setup, "calibration", timeout_s=300)
    took = time.perf_counter() - started - 0.2
    if result["answered"] < count:
        raise RuntimeError(f"calibration: {result['answered']} of {count} requests answered")
    return {"requests": count, "seconds": round(took, 2), "requests_per_s": round(count / took, 3)}


def check_machine(device: str) -> str | None:
    """Why this machine cannot run the benchmark (one line), or None."""
    try:
        import torch

        from kvcached_transformers.cb.seams import UnsupportedTransformers, check
    except ImportError as exc:
        return f"{exc.name or exc} is not installed: pip install -e '.[transformers]'"
    try:
        check()
    except UnsupportedTransformers as exc:
        return str(exc)
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no GPU here (torch.cuda.is_available() is False)"
    return None


def machine(device: str) -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    import torch
    import transformers

    info |= {"torch": torch.__version__, "transformers": transformers.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f} MiB"


def markdown(report: dict) -> str:
    lines = [f"# Three models, one KV budget: transformers continuous batching, static against elastic "
             f"({report['device']}, {report['date'][:10]})", "",
             f"Command: `{report['command']}`. Machine: {report['machine']}. Seed {report['seed']}.", "",
             f"Models: {report['models_why']}", "",
             f"Budget {report['budget_bytes'] >> 20} MiB: static {report['models']} x {report['share_blocks']} blocks "
             f"(+2 padding each), elastic one shared budget. Calibration: one static share served "
             f"{report['calibration']['requests_per_s']} requests/s ({report['calibration']['requests']} at once); "
             f"peak rate {report['peak_rate']} requests/s per model (rule: {PEAK_RULE} x that), "
             f"{report['trace_requests']} requests over {report['duration_s']} s.", "",
             f"**p99 TTFT static/elastic: median {report['ttft_p99_ratio_median']}x "
             f"(range {report['ttft_p99_ratio_min']}-{report['ttft_p99_ratio_max']}x); throughput elastic/static: "
             f"median {report['throughput_ratio_median']}x (range {report['throughput_ratio_min']}-"
             f"{report['throughput_ratio_max']}x)**", "",
             "| run | configuration | answered | TTFT p99 | TTFT mean | tokens/s | offload rounds | reclaimed "
             "| one model's peak |", "|---|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(report["runs"]):
        lines.append(f"| {i + 1} | {run['configuration']} | {run['answered']}/{run['requests']} | "
                     f"{run['ttft_p99_s']:.2f} s | {run['ttft_mean_s']:.2f} s | {run['tokens_per_s']:.1f} | "
                     f"{run['offload_rounds']} | {mib(run.get('reclaimed_bytes'))} | "
                     f"{mib(run.get('peak_model_mapped_bytes'))} |")
    if report.get("picture"):
        lines += ["", f"![TTFT by arrival and KV memory per model]({report['picture']})"]
    return "\n".join(lines) + "\n"


def run(device: str, quick: bool, repeats: int, write: bool, shape: str = "ramps", duration_s: float | None = None,
        out: Path | None = None) -> int:
    """Start both configurations' engines, calibrate, replay the trace ``repeats`` times each, interleaved.

    The report (JSON and markdown, under ``out`` or benchmarks/results/; not at all when ``write`` is False) is
    rewritten after every run, so a run stopped part-way leaves the runs it finished. ``duration_s`` replaces the
    setup's trace length (before --quick halves it): the smoke test's short trace."""
    problem = check_machine(device)
    if problem:
        print(f"multimodel: {problem}", file=sys.stderr)
        return 2
    setup = MODELS[device]
    models = 3
    if duration_s is not None:
        setup = Setup(**{**setup.__dict__, "duration_s": duration_s})
    if quick:
        setup = Setup(**{**setup.__dict__, "duration_s": setup.duration_s / 2})
    ctx = mp.get_context("spawn")
    shm = Path(tempfile.mkdtemp(prefix="kvc-tcb-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    started = time.monotonic()
    stem = (out or RESULTS) / (f"multimodel-transformers-{device}" + ("" if shape == "ramps" else f"-{shape}")
                      + ("-quick" if quick else ""))
    report: dict = {"engine": "transformers", "device": device, "mode": "quick" if quick else "full",
                    "command": f"python -m benchmarks multimodel --engine transformers --device {device}"
                               + (" --quick" if quick else "") + (f" --repeats {repeats}" if repeats != 3 else "")
                               + (f" --shape {shape}" if shape != "ramps" else "")
                               + (f" --duration {duration_s:g}" if duration_s is not None else ""),
                    "shape": shape,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(device), "seed": SEED, "models": models, "models_why": setup.why,
                    "setup": setup.__dict__, "share_blocks": setup.share_blocks,
                    "budget_bytes": shares_bytes(setup, models), "peak_rule": PEAK_RULE,
                    "duration_s": setup.duration_s, "runs": []}
    groups: dict[str, Engines] = {}
    try:
        groups["static"] = Engines(ctx, setup, models, False, shm)
        groups["elastic"] = Engines(ctx, setup, models, True, shm)
        for group in groups.values():
            group.wait_ready(600)
        report["calibration"] = calibrate(groups["static"], setup)
        report["peak_rate"] = round(PEAK_RULE * report["calibration"]["requests_per_s"], 3)
        trace = make_trace(setup, models, report["peak_rate"], shape)
        report["trace_requests"] = len(trace)
        for i in range(repeats):
            for config in ("static", "elastic"):
                result = replay(groups[config], trace, setup, f"{config}{i}", timeout_s=setup.duration_s * 4 + 60)
                report["runs"].append({"configuration": config, "repeat": i + 1, **result})
                print(f"{config} {i + 1}: p99 TTFT {result['ttft_p99_s']:.2f} s, mean {result['ttft_mean_s']:.2f} s, "
                      f"{result['tokens_per_s']:.1f} tokens/s, {result['answered']}/{result['requests']}, "
                      f"{result['offload_rounds']} offload rounds", flush=True)
                report |= pair_ratios(report["runs"]) | {"seconds": round(time.monotonic() - started, 1)}
                if write:
                    save(report, stem)
    except KeyboardInterrupt:
        print("interrupted: every engine was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"multimodel: {exc}", file=sys.stderr)
        return 1
    finally:
        for group in groups.values():
            group.stop()
        with contextlib.suppress(OSError):
            for leftover in shm.iterdir():
                leftover.unlink()
            shm.rmdir()
    if write and report["runs"]:
        png = plot(report, stem.with_suffix(".png"))
        if png is not None:
            report["picture"] = png.name
            save(report, stem)
    print(markdown(report))
    return 0 if all(r["answered"] == r["requests"] for r in report["runs"]) else 1


def save(report: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))


def plot(report: dict, path: Path) -> Path | None:
    """The picture of a report: every run's TTFT by arrival (static and elastic, each repeat), and each model's KV
    memory mapped in the first elastic run beside the fixed static share. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture: matplotlib is missing (pip install -e '.[plot]')", file=sys.stderr)
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    colours = {"static": "tab:red", "elastic": "tab:blue"}
    labelled: set[str] = set()
    for run in report["runs"]:
        points = [(t, ttft) for t, _, ttft in run.get("ttft_by_arrival", ()) if ttft is not None]
        config = run["configuration"]
        p99s = ", ".join(f"{r['ttft_p99_s']:.2f}" for r in report["runs"] if r["configuration"] == config)
        label = None if config in labelled else f"{config}, every repeat (p99 {p99s} s)"
        labelled.add(config)
        top.plot([p[0] for p in points], [p[1] for p in points], ".", alpha=0.6, color=colours[config], label=label)
    top.set_yscale("log")
    top.set_ylabel("TTFT (s), by arrival")
    top.set_title(f"{report['models']} models, {report['shape']} ({report['device']}): p99 TTFT static/elastic "
                  f"median {report['ttft_p99_ratio_median']}x, {report['date'][:10]}", fontsize=10)
    top.legend(loc="upper left", fontsize=8)
    elastic = next((r for r in report["runs"] if r["configuration"] == "elastic" and r["kv_samples"]), None)
    if elastic is not None:
        names = sorted({n for row in elastic["kv_samples"] for n in row if n != "t"})
        ts = [row["t"] for row in elastic["kv_samples"]]
        stacks = [[(row.get(n) or {}).get("mapped", 0) / (1 << 20) for row in elastic["kv_samples"]] for n in names]
        bottom.stackplot(ts, stacks, labels=names, alpha=0.8)
        share = shares_bytes(Setup(**report["setup"]), 1) / (1 << 20)  # one static cache, its padding included
        for k in range(1, report["models"] + 1):
            bottom.axhline(k * share, color="grey", linestyle="--", linewidth=0.8)
        bottom.set_ylim(0, report["models"] * share * 1.08)  # the whole budget in view
        bottom.legend(loc="upper left", fontsize=8)
    bottom.set_ylabel("elastic: KV MiB mapped, stacked\n(static shares dashed)")
    bottom.set_xlabel("seconds into the trace")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def replot(path: Path) -> Path | None:
    """Draw the picture of a report this module wrote, next to it; the report and its markdown then name it."""
    report = json.loads(path.read_text())
    png = plot(report, path.with_suffix(".png"))
    if png is not None:
        save(dict(report, picture=png.name), path.with_suffix(""))
    return png
