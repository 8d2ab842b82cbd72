"""kvctl route against a direct request to the same vLLM engine: the latency the router adds, and streamed tokens/s.

One real engine (``vllm serve``, the tiny random Llama of ``kvcached_vllm.tiny``, the plugin on) and one
``kvctl route`` in front of it, on this machine. Requests go one at a time, direct and through the router
in turn (the order alternates every pair), so drift on a shared machine hits both:

- added latency: a short prompt and one generated token, not streamed; p50 and p99 of each path and their
  differences (the target is an added p99 of at most 2 ms);
- streamed tokens/s: 256 tokens streamed (server-sent events), tokens over the time to the last event;
  the median of per-pair ratios, routed over direct;
- the router's own cost, without the engine's variance: the same short request, direct and routed, to a
  minimal aiohttp server in a process of its own that answers at once (its segment published like an
  engine's), 2000 pairs.

Needs vLLM: runs under ``.venv-vllm`` when this interpreter has none (see README, "With vLLM").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_ADDED_P99_MS = 2.0


def run(quick: bool) -> list[dict]:
    import benchmarks
    from benchmarks._common import vllm_python

    python = vllm_python()
    if python is None:
        raise benchmarks.Skip("needs vLLM: build .venv-vllm as the README's 'With vLLM' says")
    with tempfile.TemporaryDirectory(prefix="kvc-bench-route-") as tmp:
        out = Path(tmp) / "route.json"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "plugins") + os.pathsep + str(ROOT))
        cmd = [python, __file__, "--workdir", tmp, "--out", str(out)] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"route benchmark exited {proc.returncode}: " + " | ".join(tail))
        r = json.loads(out.read_text())
    added_p99 = r["routed_p99_ms"] - r["direct_p99_ms"]
    stub_added_p99 = r["stub_routed_p99_ms"] - r["stub_direct_p99_ms"]
    return [
        {"name": "latency kvctl route adds, instant upstream", "value": round(r["stub_routed_p50_ms"]
                                                                           - r["stub_direct_p50_ms"], 3),
         "unit": "ms p50",
         "note": f"p99 {stub_added_p99:.3f} ms; direct p50/p99 {r['stub_direct_p50_ms']:.3f}/"
                 f"{r['stub_direct_p99_ms']:.3f} ms, routed {r['stub_routed_p50_ms']:.3f}/"
                 f"{r['stub_routed_p99_ms']:.3f} ms over {r['stub_pairs']} pairs; target p99 <= "
                 f"{TARGET_ADDED_P99_MS} ms" + (" (met)" if stub_added_p99 <= TARGET_ADDED_P99_MS else " (MISSED)")},
        {"name": "request latency, direct", "value": round(r["direct_p50_ms"], 3), "unit": "ms p50",
         "note": f"p99 {r['direct_p99_ms']:.3f} ms; {r['pairs']} requests of {r['prompt_tokens']} prompt tokens, "
                 "1 generated, not streamed"},
        {"name": "request latency, through kvctl route", "value": round(r["routed_p50_ms"], 3), "unit": "ms p50",
         "note": f"p99 {r['routed_p99_ms']:.3f} ms; the same requests, in turn with the direct ones"},
        {"name": "latency kvctl route adds", "value": round(r["routed_p50_ms"] - r["direct_p50_ms"], 3),
         "unit": "ms p50",
         "note": f"p99 {added_p99:.3f} ms (routed p99 - direct p99); target p99 <= {TARGET_ADDED_P99_MS} ms"
                 + (" (met)" if added_p99 <= TARGET_ADDED_P99_MS else " (MISSED)")},
        {"name": "streamed tokens/s through kvctl route / direct", "value": round(r["stream_ratio_median"], 3),
         "unit": "x",
         "note": f"median of {r['stream_rounds']} per-pair ratios ({min(r['stream_ratios']):.3f}-"
                 f"{max(r['stream_ratios']):.3f}); {r['stream_tokens']} tokens streamed, "
                 f"direct {r['direct_tokens_s']:.0f}, routed {r['routed_tokens_s']:.0f} tokens/s (medians)"},
    ]


# -- the driver, under the vLLM interpreter --------------------------------------------------

def _pct(values: list[float], q: float) -> float:
    from benchmarks._common import percentile

    return percentile(sorted(values), q)


STUB = """
import sys
from aiohttp import web
async def answer(request):
    await request.read()
    return web.json_response({"choices": [{"text": "", "token_ids": []}]})
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})
app = web.Application()
app.router.add_post("/v1/completions", answer)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


async def _pairs(direct: str, routed: str, body: dict, pairs: int, warm: int = 20) -> dict[str, list[float]]:
    """Latency (ms) of ``pairs`` requests on each path, one at a time, the order alternating every pair."""
    import aiohttp

    lat: dict[str, list[float]] = {"direct": [], "routed": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
        for i in range(warm + pairs):
            order = (("direct", direct), ("routed", routed)) if i % 2 == 0 else (("routed", routed), ("direct", direct))
            for label, base in order:
                started = time.perf_counter()
                async with session.post(base + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                if i >= warm:
                    lat[label].append((time.perf_counter() - started) * 1e3)
    return lat


def _stub(shm: Path, router: str, quick: bool) -> dict:
    """The router's own cost: a minimal server that answers at once, published as a model, direct and routed."""
    from kvcached_core import KVCacheManager

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    manager = None
    try:
        os.environ["KVCACHED_SHM_DIR"] = str(shm)
        manager = KVCacheManager("stub", name="stub", num_blocks=64, block_bytes=65536, num_layers=1,
                                 page_size=262144)
        manager.publish_endpoint(f"http://127.0.0.1:{port}")
        body = {"model": "stub", "prompt": [1] * 16, "max_tokens": 1}
        _wait(lambda: _answers(f"http://127.0.0.1:{port}/v1/models"), 30, "the instant upstream")
        pairs = 300 if quick else 2000
        lat = asyncio.run(_pairs(f"http://127.0.0.1:{port}", router, body, pairs, warm=100))
    finally:
        if manager is not None:
            manager.close()
        proc.terminate()
        proc.wait(timeout=30)
    return {"stub_pairs": pairs, "stub_direct_p50_ms": _pct(lat["direct"], 50),
            "stub_direct_p99_ms": _pct(lat["direct"], 99), "stub_routed_p50_ms": _pct(lat["routed"], 50),
            "stub_routed_p99_ms": _pct(lat["routed"], 99)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout:.0f} s")
        time.sleep(0.5)


def _env(shm: Path, enabled: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_KVCACHED"}
    env.update(KVCACHED_SHM_DIR=str(shm), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(shm.parent / "vllm-cache"),
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if enabled:
        env["ENABLE_KVCACHED"] = "true"
    return env


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


async def _measure(direct: str, routed: str, quick: bool) -> dict:
    import aiohttp

    from kvcached_vllm.tiny import prompts

    pairs, rounds, stream_tokens = (60, 4, 128) if quick else (400, 12, 256)
    prompt = prompts(1, length=16, seed=5)[0]
    short = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    stream = {"model": "bench", "prompt": prompt, "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True,
              "stream": True}
    connector = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def once(base: str, body: dict) -> tuple[float, int]:
            started = time.perf_counter()
            events = 0
            async with session.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                if body.get("stream"):
                    async for line in resp.content:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            events += 1
                else:
                    await resp.read()
            return time.perf_counter() - started, events

        for _ in range(20):  # warm both paths: connections, the engine's first steps
            await once(direct, short)
            await once(routed, short)
        lat: dict[str, list[float]] = {"direct": [], "routed": []}
        for i in range(pairs):
            order = (("direct", direct), ("routed", routed)) if i % 2 == 0 else (("routed", routed), ("direct", direct))
            for label, base in order:
                lat[label].append((await once(base, short))[0] * 1e3)
        ratios, rates = [], {"direct": [], "routed": []}
        for i in range(rounds):
            got = {}
            order = (("direct", direct), ("routed", routed)) if i % 2 == 0 else (("routed", routed), ("direct", direct))
            for label, base in order:
                took, events = await once(base, stream)
                assert events == stream_tokens, (label, events)
                got[label] = events / took
                rates[label].append(got[label])
            ratios.append(got["routed"] / got["direct"])
    return {
        "pairs": pairs, "prompt_tokens": len(prompt),
        "direct_p50_ms": _pct(lat["direct"], 50), "direct_p99_ms": _pct(lat["direct"], 99),
        "routed_p50_ms": _pct(lat["routed"], 50), "routed_p99_ms": _pct(lat["routed"], 99),
        "stream_rounds": rounds, "stream_tokens": stream_tokens, "stream_ratios": ratios,
        "stream_ratio_median": statistics.median(ratios),
        "direct_tokens_s": statistics.median(rates["direct"]), "routed_tokens_s": statistics.median(rates["routed"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvcached_vllm.tiny import build_tiny_llama

    work = Path(args.workdir)
    shm = work / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(work / "tiny-random-llama")
    port = _free_port()
    with open(work / "serve.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
             "--host", "127.0.0.1", "--served-model-name", "bench", "--max-model-len", "2048", "--enforce-eager",
             "--dtype", "float32", "--seed", "0"],
            env=_env(shm, True), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = None
    try:
        _wait(lambda: server.poll() is not None or _answers(f"http://127.0.0.1:{port}/v1/models"), 420, "vllm serve")
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited {server.returncode}: see {work / 'serve.log'}")
        router = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "route", "--listen", "127.0.0.1:0"],
                                  env=_env(shm, False), stderr=subprocess.PIPE, text=True)
        line = router.stderr.readline() if router.stderr else ""
        found = re.search(r"serving (http://\S+)/v1 ", line)
        if not found:
            raise RuntimeError(f"kvctl route did not start: {line}")
        result = asyncio.run(_measure(f"http://127.0.0.1:{port}", found.group(1), args.quick))
        result.update(_stub(shm, found.group(1), args.quick))
    finally:
        for proc in (router, server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
