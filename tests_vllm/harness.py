"""Real vLLM engines for the plugin tests: a ``vllm serve`` server and one-shot offline scripts.

Everything runs on the CPU with the tiny random Llama the tests build (no downloads). Engines
are slow to start on two cores, so the tests share one server wherever they can.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvcached_core.segment.reader import snapshot
from kvcached_core.segment.snapshot import ModelSnapshot
from kvcached_vllm.tiny import prompts

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 420.0
MAX_MODEL_LEN = 2048
# float32: greedy tokens must not depend on batch composition (preemption recomputes a request in
# another batch); bfloat16 near-ties of the random model flip a token now and then.
DTYPE = "float32"
# What a server started with --enable-log-requests logs once its API server has passed a request on to its engine,
# and an abort (a client gone) on to it.
ADDED = "Added request"
ABORTED = "Aborted request"


def base_env(shm_dir: Path, *, enabled: bool, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ENABLE_KVCACHED", None)
    env.update({
        "KVCACHED_SHM_DIR": str(shm_dir),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(shm_dir.parent / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if enabled:
        env["ENABLE_KVCACHED"] = "true"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running ``vllm serve`` (its log in ``log``)."""

    proc: subprocess.Popen
    port: int
    log: Path
    name: str

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> list[int]:
        """Greedy completion of a token-id prompt; the generated token ids."""
        return list(self.choice(prompt, max_tokens, timeout)["token_ids"])

    def choice(self, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> dict:
        """Greedy completion of a token-id prompt: the answer's choice (``token_ids``, ``finish_reason``, ...)."""
        body = {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        req = urllib.request.Request(self.url("/v1/completions"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.load(resp)
        return dict(answer["choices"][0])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as resp:
            return resp.read().decode()

    def worker(self) -> psutil.Process:
        """The worker process: the descendant that holds the KV tensors (the largest RSS)."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        workers = [c for c in children if "Worker" in " ".join(c.cmdline()) or c.name().startswith("VLLM")]
        pool = workers or children
        return max(pool, key=lambda c: c.memory_info().rss)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(model_dir: Path, env: dict[str, str], log: Path, *, name: str = "tiny-llama",
                 args: tuple[str, ...] = ()) -> Server:
    port = free_port()
    # vllm-cpu 0.32.0's `vllm` console script looks up the metadata of a distribution named "vllm"
    # (this one is "vllm-cpu") and exits; its module entry point is the same OpenAI server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", name, "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
           "--dtype", DTYPE, "--seed", "0", "--enable-prefix-caching", *args]
    out = open(log, "w")  # noqa: SIM115 - the server writes to it for its whole life
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, port, log, name)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(server.url("/v1/models"), timeout=5):
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    server.stop()
    raise RuntimeError(f"vllm serve did not answer in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


def run_offline(model_dir: Path, env: dict[str, str], prompts: list[list[int]], max_tokens: int,
                out: Path, *, logprobs: bool = False) -> dict:
    """Greedy tokens for ``prompts`` from ``vllm.LLM`` in a fresh process (``offline_job.py``); with ``logprobs``,
    each sampled token's log-probability too."""
    job = {"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens, "max_model_len": MAX_MODEL_LEN,
           "dtype": DTYPE, "logprobs": logprobs, "out": str(out)}
    spec = out.with_suffix(".job.json")
    spec.write_text(json.dumps(job))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offline_job.py")), str(spec)],
                          env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S + 300)
    if proc.returncode != 0:
        raise RuntimeError(f"offline job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def kvctl(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "kvctl"), *args], env=env, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvctl {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc


def settled(name: str, directory: Path, *, quiet_s: float = 1.0, timeout: float = 60.0) -> ModelSnapshot:
    """The model's snapshot once its mapped and reserved pages stayed the same for ``quiet_s``: the refill
    thread maps ahead a little after traffic (at nice +10, so late on a busy host), and a figure read
    before it lands is not the one a trim or a sleep acts on."""
    deadline = time.monotonic() + timeout
    last = snapshot(name, directory=directory, with_pages=False)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = snapshot(name, directory=directory, with_pages=False)
        if (now.mapped_bytes, now.pages_reserved) != (last.mapped_bytes, last.pages_reserved):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"{name}'s mapped pages kept changing for {timeout} s")


def wait_for(predicate, timeout: float = 120.0, every: float = 0.02):
    """``predicate()``'s first true value, looked at every ``every`` seconds; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state T or t), or the process is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return all(state in ("T", "t", "Z", "X") for state in states)


@contextlib.contextmanager
def engine_stopped(server: Server) -> Iterator[None]:
    """The server's engine (every descendant of its API server: the engine core, whose scheduler owns the pages,
    and its workers) stopped with SIGSTOP until the block ends, then continued. Entered once every thread of
    theirs is stopped: from then on the engine neither schedules nor publishes, while its API server still takes
    requests and queues them for the engine. A test that must act on a state the engine would soon change
    (holes a compaction should fill, requests a drain must outlast) holds it here, whatever the host's speed.
    A segment read in the block may meet a publish the stop cut short: it reads late, with its last known figures
    (its traffic as the engine last published it)."""
    engine = psutil.Process(server.proc.pid).children(recursive=True)
    for proc in engine:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: all(_stopped(proc.pid) for proc in engine), timeout=60)
        yield
    finally:
        for proc in engine:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)


class Stream:
    """A streamed completion (``body``, posted to ``base``'s /v1/completions) read in the background: it keeps its
    engine busy, or a router's place held, until :meth:`close` shuts its connection (vLLM aborts the request) or its
    tokens run out (``ended``). Returns once its first event came."""

    def __init__(self, base: str, body: dict) -> None:
        url = urllib.parse.urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.lines = 0  # lines read: two an event (the event and the blank line after it)
        self.ended = False  # the whole answer came: the engine finished the request
        self.broken: BaseException | None = None  # the connection failed before close(): neither ended nor running
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        wait_for(lambda: self.lines >= 2 or self.ended or self.broken, timeout=60)

    @property
    def running(self) -> bool:
        """Its request still runs: not ended, not broken, not closed."""
        return not (self.ended or self.broken or self.closing.is_set())

    def _read(self) -> None:
        try:
            while chunk := self.resp.read1(65536):  # whatever has come, without a line-by-line loop's cost
                self.lines += chunk.count(b"\n")
            self.ended = not self.closing.is_set()
        except (OSError, ValueError, AttributeError, http.client.HTTPException) as exc:
            if not self.closing.is_set():  # else close() shut the connection under the read
                self.broken = exc

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        with contextlib.suppress(OSError, AttributeError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # the other end sees the client go at once
        self.conn.close()
        self.thread.join(timeout=30)


class Busy:
    """Streamed requests that keep an engine busy however long a test takes, whatever the host's speed.

    A new stream starts whenever the engine (its segment in ``shm``, read as the engine core publishes it, every
    step) has generated a third of a stream's ``tokens`` since the last one started, and whenever fewer than two
    streams run: about three run at once, their ends staggered. Watching the client's reads instead failed on a
    loaded host, where a starved API server sent a stream's whole answer in one burst after the engine had run it
    out, and the engine went idle before the next one came. ``tokens``: each request's greedy tokens, after a
    ``prompt_len``-token prompt (the tiny model's 2048-token context, less its prompt, at most)."""

    def __init__(self, server: Server, shm: Path, seed: int, *, tokens: int = 1800, prompt_len: int = 100) -> None:
        self.server, self.shm, self.seed, self.tokens, self.prompt_len = server, shm, seed, tokens, prompt_len
        self.streams: list[Stream] = []
        self.starting: list[threading.Thread] = []
        self.done = threading.Event()
        self._start()
        self.thread = threading.Thread(target=self._keep, daemon=True)
        self.thread.start()
        wait_for(lambda: self.streams, timeout=120)

    def _traffic(self) -> Any:
        """The engine's published traffic; None when a read met a publish in progress (the next look reads it)."""
        try:
            return snapshot(self.server.name, directory=self.shm, with_pages=False).traffic
        except (OSError, ValueError):
            return None

    def _generated(self) -> int | None:
        traffic = self._traffic()
        return None if traffic is None else traffic.generated_tokens

    def _start(self) -> None:
        seed = self.seed + len(self.starting)

        def start() -> None:
            stream = self._stream(seed)
            self.streams.append(stream)
            if self.done.is_set():
                stream.close()

        thread = threading.Thread(target=start, daemon=True)
        self.starting.append(thread)
        thread.start()

    def _keep(self) -> None:
        mark = self._generated()
        while not self.done.wait(0.02):
            now = self._generated()
            pending = sum(t.is_alive() for t in self.starting)
            running = sum(s.running for s in self.streams) + pending
            if running < 2 or (now is not None and (mark is None or now - mark >= self.tokens // 3)):
                self._start()
                mark = now

    def _stream(self, seed: int) -> Stream:
        body = {"model": self.server.name, "prompt": prompts(1, length=self.prompt_len, seed=seed)[0],
                "max_tokens": self.tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        return Stream(self.server.url(""), body)

    def running(self) -> bool:
        """A streamed request is still running, or one was sent and its first event has not come yet (the engine has
        it, or will: on a loaded host one is often in flight while the one before it ends), or the engine says it
        runs requests (a starved API server sends a stream's end late, and Busy's next one may be on its way)."""
        if any(s.running for s in self.streams) or any(t.is_alive() for t in self.starting):
            return True
        traffic = self._traffic()
        return traffic is not None and traffic.running > 0

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=90)
        for thread in self.starting:
            thread.join(timeout=90)
        for stream in self.streams:
            stream.close()
