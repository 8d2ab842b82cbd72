"""One configuration's transformers engines, seen from the harness: child processes (:mod:`.tcb_child`) and the queue
their answers come back on (a :class:`.method.Side`).

An engine that cannot serve any more (its generation loop died, its process failed or exited) fails what waits on it
at once with :class:`EngineDied`, whose message is the engine's own error line: no wait runs to its timeout on a
dead engine.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .method import Answer
from .tcb_child import serve

POLL_S = 0.5  # the longest wait on the answers before the engines' processes are looked at again


def context() -> Any:
    """Engines' processes are spawned: a fresh interpreter each, with none of the harness's threads or CUDA state."""
    return mp.get_context("spawn")


class EngineDied(RuntimeError):
    """An engine stopped serving; the message names it and gives its error line (and its log)."""


class Engines:
    """``names``' engines, started at construction, each from its spec (see :func:`.tcb_child.serve`)."""

    def __init__(self, ctx: Any, names: list[str], specs: list[dict], *, shm: Path | None, vocab: int,
                 logs: Path, target: Callable[[dict, Any, Any], None] = serve) -> None:
        """``target``: what each child runs (:func:`.tcb_child.serve`, or :func:`.profile.profile_child`)."""
        self.names, self.shm, self.vocab, self.logs = names, shm, vocab, logs
        self.outbox = ctx.Queue()
        self.inboxes = {name: ctx.Queue() for name in names}
        self.procs = {name: ctx.Process(target=target, daemon=True, args=(
            {**spec, "log": str(logs / f"{name}.log")}, self.inboxes[name], self.outbox))
            for name, spec in zip(names, specs, strict=True)}
        for proc in self.procs.values():
            proc.start()
        self.arrivals: dict[str, tuple[float, int]] = {}
        self.answers: dict[str, Answer] = {}
        self.stats: list[dict] = []
        self.working: dict[str, int | None] = {}  # per engine: its warm-up pass's working memory (operator scale)
        self.looked = time.monotonic()  # when the processes were last looked at

    def wait_ready(self, timeout: float) -> None:
        """Until every engine answered its warm-up request; EngineDied if one cannot, RuntimeError after
        ``timeout``."""
        waiting, warm = set(self.names), set(self.names)
        deadline = time.monotonic() + timeout
        while waiting or warm:
            msg = self.get(deadline - time.monotonic())
            if msg is None:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"engines {', '.join(sorted(waiting | warm))} were not up in {timeout:.0f} s")
                continue
            if msg[0] == "ready":
                waiting.discard(msg[1])
                self.working[msg[1]] = (msg[3] or {}).get("working_bytes")
            elif msg[0] == "done" and msg[2] == "warm":
                if msg[6]:
                    raise self.died(msg[1], msg[6])
                warm.discard(msg[1])

    def died(self, name: str, line: str) -> EngineDied:
        return EngineDied(f"engine {name} died: {line} (its log: {self.logs / f'{name}.log'})")

    def get(self, timeout: float) -> tuple | None:
        """The next message, or None when none came within ``timeout`` (at most :data:`POLL_S`). EngineDied when an
        engine said it died, or when one's process is gone."""
        if time.monotonic() - self.looked >= POLL_S:  # also while the others keep answering
            self._check_processes()
        try:
            msg = self.outbox.get(timeout=max(0.0, min(timeout, POLL_S)))
        except queue.Empty:
            self._check_processes()
            return None
        if msg[0] == "died":
            raise self.died(msg[1], msg[6])
        return msg

    def _check_processes(self) -> None:
        self.looked = time.monotonic()
        for name, proc in self.procs.items():
            if proc.exitcode is not None:
                with contextlib.suppress(queue.Empty):  # its last words, when it said them before it ended
                    while True:
                        msg = self.outbox.get(timeout=1.0)
                        if msg[0] == "died":
                            raise self.died(msg[1], msg[6])
                        self.keep(msg)
                raise self.died(name, f"its process exited with code {proc.exitcode}")

    def keep(self, msg: tuple) -> None:
        kind, name, rid, first, end, n, error = msg
        if kind == "stats":
            self.stats.append(first)
        elif kind == "done" and rid in self.arrivals:
            if error:
                raise EngineDied(f"engine {name}: request {rid} failed: {error} (its log: {self.logs / f'{name}.log'})")
            arrival, model = self.arrivals.pop(rid)
            self.answers[rid] = Answer(model, arrival, first, end, n)

    def submit(self, rid: str, row: dict, arrival: float) -> None:
        from .tcb_setup import prompt_ids

        model = int(row["model"][1:])
        self.arrivals[rid] = (arrival, model)
        self.inboxes[self.names[model]].put((rid, prompt_ids(row, self.vocab), row["max_tokens"]))
        while True:  # keep the queue short while sending
            try:
                msg = self.outbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "died":
                raise self.died(msg[1], msg[6])
            self.keep(msg)

    def collect(self, rids: set[str], timeout_s: float) -> list[Answer]:
        """Every answer of ``rids`` that came within ``timeout_s``; EngineDied as soon as an engine cannot answer."""
        deadline = time.monotonic() + timeout_s
        while not rids <= set(self.answers) and time.monotonic() < deadline:
            msg = self.get(deadline - time.monotonic())
            if msg is not None:
                self.keep(msg)
        return [self.answers.pop(rid) for rid in rids if rid in self.answers]

    def counters(self) -> dict:
        """Every engine's tally so far, summed (each engine counts from its start)."""
        self.stats = []
        for box in self.inboxes.values():
            box.put("stats")
        deadline = time.monotonic() + 30
        while len(self.stats) < len(self.names):
            if time.monotonic() >= deadline:
                raise RuntimeError("the engines did not give their counters within 30 s")
            msg = self.get(deadline - time.monotonic())
            if msg is not None:
                self.keep(msg)
        total: dict = {"preemptions": None}
        for key in ("steps", "step_requests", "waiting_steps", "offload_rounds"):
            total[key] = sum(s[key] for s in self.stats)
        gates = [s["refused"] for s in self.stats if s["refused"] is not None]
        names = sorted({g for x in gates for g in x})
        total["refused"] = {g: sum(x.get(g, 0) for x in gates) for g in names} if gates else None
        pooled = [s["pooled_bytes"] for s in self.stats if s["pooled_bytes"] is not None]
        total["pooled_bytes"] = sum(pooled) if pooled else None
        total["offloaded"] = sorted({rid for s in self.stats for rid in s["offloaded"]})
        return total

    def stop(self) -> None:
        """Ask every engine to end, and end those that do not within 40 s."""
        for box in self.inboxes.values():
            with contextlib.suppress(Exception):
                box.put(None)
        deadline = time.monotonic() + 40
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
