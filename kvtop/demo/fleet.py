"""A demo fleet: simulated serving models on the host backend, in child processes.

Each model runs an engine-like loop: requests arrive in bursts and idle phases, prefill
allocates a prompt's blocks at once (reusing shared hot prefixes from the prefix cache),
decode adds one block at a time, requests finish at different moments and their prompt blocks
go to the prefix cache. Memory is real (host backend), so sizes are kept small.

Each model can sleep (``kvctl sleep``, kvtop's ``w``): it stops admitting requests, lets the
running ones finish (``--now``: preempts them), drops its prefix cache, frees every block and
calls ``ready()``, so every page is unmapped. It stays asleep until ``kvctl wake`` or a request
through its endpoint (the router, curl) wakes it, as a serving engine does: its simulated users
wait while it sleeps, whatever phase its traffic is in, and come back once it is awake.

Each model also serves a toy OpenAI-compatible endpoint on 127.0.0.1 (:mod:`kvtop.demo.serve`) and
publishes its address in its segment, as a real engine does, so ``kvctl route`` serves the demo too; its
requests allocate blocks beside the simulated ones and wake a sleeping model.

Not part of the allocator: a client of kvcached_core's public API, as an engine is, that
``kvctl demo`` and ``kvtop --demo`` start (each model is ``python -m kvtop.demo.fleet`` in a child).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, cast

if TYPE_CHECKING:
    from kvcached_core import KVCacheManager

DEMO_MODELS = (
    ("llama-3-8b", "vllm", 4),
    ("qwen2-7b", "sglang", 4),
    ("mistral-7b", "vllm", 2),
    ("phi-3-mini", "custom", 2),
    ("gemma-2-9b", "sglang", 4),
    ("llama-3-70b", "vllm", 8),
)
KiB = 1024


@dataclass
class Request:
    blocks: list[int]
    prefix: list[int]  # cached prefix blocks taken back into use
    decode_left: int
    key: int | None
    prompt_blocks: int = 0


@dataclass
class DemoEngine:
    """The traffic of one model, deterministic for a seed."""

    manager: KVCacheManager
    rng: random.Random
    max_running: int = 24
    running: list[Request] = field(default_factory=list)
    prefixes: dict[int, list[int]] = field(default_factory=dict)  # hot prefix key -> cached blocks
    # What the sleep handler asked, from the allocator's poller thread, for step() to act on: "sleep"
    # drains, "sleep_now" preempts, "wake" admits again (a deque: append and popleft need no lock).
    asked: deque[str] = field(default_factory=deque)
    draining: bool = False
    asleep: bool = False
    # Held by step() and by the requests the model's server takes (kvtop.demo.serve), which run in its thread.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_sleep(self, action: str) -> None:
        """The engine's sleep handler: returns at once; the serving loop does the work at its next step."""
        self.asked.append(action)

    def step(self, phase: str) -> None:
        arrivals = self.rng.randint(0, {"burst": 3, "steady": 1, "idle": 0}[phase])
        with self.lock:
            self._take_sleep_request()
            if not (self.draining or self.asleep):  # asleep, the simulated users wait: only a served request wakes it
                for _ in range(arrivals):
                    if len(self.running) < self.max_running:
                        self._admit()
            self._decode()
            if self.draining and not self.running:
                self._fall_asleep()

    def take_request(self, blocks: int) -> list[int] | None:
        """A request from the model's server arrives: the model woken if it sleeps (or is going to sleep), and
        ``blocks`` blocks for its prompt (None: no room now)."""
        with self.lock:
            self._take_sleep_request()
            if self.asleep or self.draining:
                self._wake_for_request()
            return self.manager.alloc(blocks)

    def _wake_for_request(self) -> None:
        self.manager.sleep.wake()  # a request for a sleeping model wakes it, as in a serving engine
        self.asleep = self.draining = False  # and its simulated users come back

    def _take_sleep_request(self) -> None:
        while self.asked:
            asked = self.asked.popleft()
            if asked == "wake":
                self.draining = self.asleep = False
            elif not self.asleep:
                self.draining = True
                if asked == "sleep_now":  # preempted: their blocks go at once
                    for req in self.running:
                        self.manager.free(req.prefix + req.blocks)
                    self.running.clear()

    def _fall_asleep(self) -> None:
        """Drained: drop the prefix cache, so no block is held, and let the allocator unmap every page.
        Tried again at the next step if a block is still held (an eviction raced the free)."""
        m = self.manager
        self.prefixes.clear()
        try:
            m.free(list(m.cache.blocks))  # with no request running, every block held is a cached one
            m.sleep.ready()
        except (RuntimeError, ValueError):
            return
        self.draining = False
        self.asleep = True

    def _decode(self) -> None:
        m = self.manager
        for req in list(self.running):
            if req.decode_left <= 0:
                self._finish(req)
                continue
            req.decode_left -= 1
            if self.rng.random() < 0.35:  # a block fills every few tokens
                got = m.alloc(1)
                if got is None:
                    self._finish(req)
                    continue
                req.blocks += got

    def _admit(self) -> None:
        m = self.manager
        key = self.rng.randrange(6) if self.rng.random() < 0.6 else None
        prefix: list[int] = []
        if key is not None and key in self.prefixes:
            prefix = self.prefixes.pop(key)
            m.reuse(prefix)
        prompt = self.rng.randint(1, 24)
        blocks = m.alloc(prompt)
        if blocks is None:
            if prefix:
                self._cache(key, prefix)
            return
        self.running.append(Request(blocks, prefix, self.rng.randint(5, 120), key, prompt))

    def _cache(self, key: int | None, blocks: list[int]) -> None:
        evicted = set(self.manager.mark_cached(blocks))
        if key is not None and not (evicted & set(blocks)):
            old = self.prefixes.pop(key, None)
            if old:
                self.manager.free(b for b in old if b in self.manager.cache)
            self.prefixes[key] = blocks
        else:
            gone = [b for b in blocks if b not in evicted]
            if gone:
                self.manager.free(gone)
        for k, cached in list(self.prefixes.items()):
            if evicted & set(cached):
                survivors = [b for b in cached if b not in evicted]
                del self.prefixes[k]
                if survivors:
                    self.manager.free(survivors)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        keep = req.prefix + req.blocks[: req.prompt_blocks]
        rest = req.blocks[req.prompt_blocks:]
        if rest:
            self.manager.free(rest)
        if req.key is not None and keep:
            self._cache(req.key, keep)
        elif keep:
            self.manager.free(keep)


def _phase(t: float, period: float, offset: float) -> str:
    x = ((t + offset) % period) / period
    return "burst" if x < 0.3 else "steady" if x < 0.7 else "idle"


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(stop: Callable[[], None]) -> None:
    """Tie a child to its parent, whatever ends the parent (SIGKILL too).

    The kernel sends SIGTERM when the parent goes (``PR_SET_PDEATHSIG``), and a watchdog thread
    calls ``stop`` when stdin, a pipe only the parent holds open, reaches end of file: that also
    covers a parent gone before the prctl call, and systems without prctl.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            while os.read(0, 4096):
                pass
        stop()

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_model(name: str, engine: str, layers: int, seed: int, duration: float | None, tick: float = 0.05) -> None:
    """Child-process body: serve simulated traffic until ``duration``, SIGTERM/SIGINT or the parent's end.

    Says ``ready`` on stdout once its segment exists and its server (:mod:`kvtop.demo.serve`) listens, its
    address published, or ``failed: <why>`` (one line) and exits 1.
    """
    from kvcached_core import KVCacheManager
    from kvtop.demo.serve import DemoServer

    stopping = threading.Event()
    signalled = False

    def _stop(*_: object) -> None:
        # Only a plain assignment here: Event.set() takes a lock that the interrupted main
        # thread may hold inside stopping.wait(), and the handler would wait for it forever.
        nonlocal signalled
        signalled = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    die_with_parent(stopping.set)
    rng = random.Random(seed)
    try:
        manager = KVCacheManager(name, num_blocks=4096, block_bytes=16 * KiB, num_layers=layers,
                                 num_kv_buffers=2, page_size=256 * KiB, engine=engine, name=name)
    except (OSError, ValueError) as exc:  # SegmentError and ConfigError are ValueErrors
        print(f"failed: {' '.join(str(exc).split()) or type(exc).__name__}", flush=True)
        raise SystemExit(1) from None
    demo = DemoEngine(manager, rng)
    try:
        server = DemoServer(name, demo).start()
    except (OSError, ValueError) as exc:
        manager.close()
        print(f"failed: its server cannot listen: {' '.join(str(exc).split()) or type(exc).__name__}", flush=True)
        raise SystemExit(1) from None
    print("ready", flush=True)
    with manager, server:
        manager.set_sleep_handler(demo.on_sleep)
        start = time.monotonic()
        period, offset = rng.uniform(12, 24), rng.uniform(0, 10)
        while not (signalled or stopping.is_set()):
            now = time.monotonic() - start
            if duration is not None and now >= duration:
                break
            demo.step(_phase(now, period, offset))
            stopping.wait(tick)


class DemoFleet:
    """Start N demo models as child processes; stop them (and their segments) on exit."""

    def __init__(self, models: int = 3, seed: int = 0, duration: float | None = None, prefix: str = "demo") -> None:
        if not 1 <= models <= 64:
            raise ValueError("models must be between 1 and 64")
        self.count, self.seed, self.duration, self.prefix = models, seed, duration, prefix
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None  # why a model did not start, as its child said it

    def names(self) -> list[str]:
        out = []
        for i in range(self.count):
            base = DEMO_MODELS[i % len(DEMO_MODELS)][0]
            suffix = f"-{i // len(DEMO_MODELS)}" if i >= len(DEMO_MODELS) else ""
            out.append(f"{self.prefix}-{base}{suffix}")
        return out

    def start(self) -> DemoFleet:
        """Start the models; call it from a thread that outlives the fleet (the kernel's parent-death
        signal follows the thread that started a child, not the process)."""
        for i, name in enumerate(self.names()):
            _base, engine, layers = DEMO_MODELS[i % len(DEMO_MODELS)]
            cmd = [sys.executable, "-m", "kvtop.demo.fleet", name, engine, str(layers),
                   str(self.seed * 1000 + i), "" if self.duration is None else str(self.duration)]
            # stdin: a pipe only this process holds, so a child sees end of file when we are gone;
            # stdout: the child's one line, "ready" or "failed: <why>".
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        return self

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait until every model says it is ready; False (and ``failure`` says why) when one is not."""
        waiting = {p.stdout: name for p, name in zip(self.procs, self.names(), strict=False) if p.stdout}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for pipe in waiting:
                selector.register(pipe, selectors.EVENT_READ)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.failure = f"{', '.join(waiting.values())} did not start within {timeout:g} s"
                    return False
                for key, _ in selector.select(left):
                    pipe = cast(IO[bytes], key.fileobj)
                    line = pipe.readline().decode(errors="replace").strip()
                    name = waiting.pop(pipe)
                    selector.unregister(pipe)
                    if line != "ready":
                        why = line.removeprefix("failed: ") or "its process ended before its segment existed"
                        self.failure = f"demo model {name} did not start: {why}"
                        return False
        return True

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self) -> None:
        for proc in self.procs:
            proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(1)
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """A child killed hard cannot unlink its segment: do it for it."""
        from kvcached_core import segment_path

        for name in self.names():
            with contextlib.suppress(FileNotFoundError, ValueError):
                segment_path(name).unlink()

    def __enter__(self) -> DemoFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # child process: NAME ENGINE LAYERS SEED [DURATION]
    _name, _engine, _layers, _seed, _duration = (sys.argv[1:] + [""])[:5]
    run_model(_name, _engine, int(_layers), int(_seed), float(_duration) if _duration else None)
