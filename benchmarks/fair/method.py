"""The method: which runs, in which order, and what one run measures.

One discarded warm-up replay per configuration (static, then elastic), then ``pairs`` ABBA pairs (S E, E S, S E,
E S, ...): each configuration runs first in half the pairs, so neither gains from going second. Both
configurations' engines stay up through the whole comparison. A run replays the trace in time against one
configuration (:class:`Side`), collects every answer and reads the engine's counters before and after.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

CONFIGS = ("static", "elastic")
START_DELAY_S = 0.2  # the trace's time 0 is this long after the replay starts (the sampler is up by then)


@dataclass(frozen=True)
class Slot:
    """One run of the schedule: its configuration, ``warm-up`` or ``pair``, and its pair (0 for warm-ups)."""

    configuration: str
    kind: str
    pair: int


def schedule(pairs: int, *, in_turn: bool = False) -> list[Slot]:
    """Warm-ups first (one per configuration, not counted), then ABBA: pair 1 static first, pair 2 elastic first...
    ``in_turn`` (one configuration's engines alive at a time): pair 1 elastic first, going on from the elastic
    warm-up, so that the engines are switched once a pair rather than twice; still ABBA."""
    slots = [Slot(c, "warm-up", 0) for c in CONFIGS]
    for p in range(1, pairs + 1):
        order = CONFIGS if (p % 2) != in_turn else CONFIGS[::-1]
        slots += [Slot(c, "pair", p) for c in order]
    return slots


@dataclass
class Answer:
    """One request as the client saw it; times on ``time.perf_counter``'s clock, ``first`` None when no token came."""

    model: int
    arrival: float
    first: float | None
    end: float | None
    tokens: int
    error: str | None = None


class Side(Protocol):
    """One configuration's engines, as a driver runs them."""

    shm: Path | None  # the elastic engines' segment directory (None: static, no segments)

    def submit(self, rid: str, row: dict, arrival: float) -> None: ...

    def collect(self, rids: set[str], timeout_s: float) -> list[Answer]:
        """Every answer of ``rids`` (those that came within ``timeout_s``)."""
        ...

    def counters(self) -> dict:
        """The engines' counters so far, all engines together (:data:`COUNTERS`; None: this engine has none)."""
        ...


# Counters a driver reads from its engines, summed over them; a run reports the difference over the run.
COUNTERS = ("steps", "step_requests", "waiting_steps", "offload_rounds", "preemptions")


def replay(side: Side, trace: list[dict], run: str, timeout_s: float) -> dict:
    """Send ``trace`` in time to ``side``, collect every answer; the run's figures (:func:`figures`), its counters
    (:func:`counted`) and, for elastic engines, what their segments said every 0.5 s (``kv_samples``, with the
    bytes claimed but unused and the reclaims given and taken over the run)."""
    samples: list[dict] = []
    stop = threading.Event()
    t0 = time.perf_counter() + START_DELAY_S
    watcher = None
    began = time.perf_counter()
    if side.shm is not None:
        watcher = threading.Thread(target=sample_segments, args=(side.shm, t0, stop, samples), daemon=True)
        watcher.start()
    before = side.counters()
    rids: set[str] = set()
    for i, row in enumerate(trace):
        delay = t0 + row["t"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rid = f"{run}-{i}"
        rids.add(rid)
        side.submit(rid, row, t0 + row["t"])
    try:
        answers = side.collect(rids, timeout_s)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    problem = unanswered(answers, len(trace), timeout_s)
    if problem:
        raise RunFailed(f"run {run}: {problem}")
    return {**figures(answers, t0, len(trace)), **counted(before, side.counters()), **segment_figures(samples),
            "elapsed_s": round(time.perf_counter() - began, 1), "kv_samples": samples}


class RunFailed(RuntimeError):
    """A run in which not every request was answered: the comparison ends there."""


def unanswered(answers: list[Answer], requests: int, timeout_s: float) -> str | None:
    """What is wrong with a run's answers, in one line, or None when every request of the ``requests`` sent was
    answered without error and with at least one token."""
    failed = [a for a in answers if a.error]
    empty = [a for a in answers if not a.error and (a.first is None or a.tokens < 1)]
    missing = requests - len(answers)
    if not (failed or empty or missing):
        return None
    parts = [f"{requests - len(failed) - len(empty) - missing} of {requests} requests answered"]
    if missing:
        parts.append(f"{missing} with no answer within {timeout_s:.0f} s")
    if empty:
        parts.append(f"{len(empty)} answered with no token")
    if failed:
        parts.append(f"{len(failed)} failed (first: {failed[0].error})")
    return "; ".join(parts)


def percentile99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-99 * len(ordered) // 100) - 1))] if ordered else float("nan")


def figures(answers: list[Answer], t0: float, requests: int) -> dict:
    """TTFT (first token's time minus the request's arrival in the trace) p99 and mean, tokens/s over the run
    (from the trace's start to the last answer), the mean decode time per output token (TPOT: how fast each request
    ran once it ran; on a trace below saturation tokens/s follows the last requests' service, TPOT every token's),
    and every request's TTFT by arrival."""
    done = [a for a in answers if a.error is None and a.first is not None]
    ttft = [a.first - a.arrival for a in done if a.first is not None]
    ends = [a.end for a in done if a.end is not None]
    tokens = sum(a.tokens for a in done)
    # decode time per output token, each request's own (first token to last, over the tokens after the first)
    tpot = [(a.end - a.first) / (a.tokens - 1) for a in done if a.end is not None and a.first is not None
            and a.tokens > 1]
    decode = [a.end - a.first for a in done if a.end is not None and a.first is not None]  # first token to last
    return {"requests": requests, "answered": len(done), "errors": sorted({a.error for a in answers if a.error}),
            "tpot_mean_s": round(statistics.fmean(tpot), 5) if tpot else None,
            "decode_s_mean": round(statistics.fmean(decode), 4) if decode else None,
            "ttft_p99_s": round(percentile99(ttft), 4),
            "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else float("nan"),
            "tokens": tokens, "tokens_per_s": round(tokens / (max(ends) - t0), 2) if ends else 0.0,
            "ttft_by_arrival": sorted([round(a.arrival - t0, 3), a.model,
                                       None if a.first is None else round(a.first - a.arrival, 4)] for a in answers),
            "by_model": by_model(done, t0)}


def by_model(done: list[Answer], t0: float) -> dict[str, dict]:
    """Each model's own figures (``m0``...): answered, TTFT p99, tokens and tokens/s (from the trace's start to
    its last answer)."""
    out: dict[str, dict] = {}
    for m in sorted({a.model for a in done}):
        mine = [a for a in done if a.model == m]
        ends = [a.end for a in mine if a.end is not None]
        tokens = sum(a.tokens for a in mine)
        out[f"m{m}"] = {"answered": len(mine),
                        "ttft_p99_s": round(percentile99([a.first - a.arrival for a in mine if a.first is not None]), 4),
                        "tokens": tokens, "tokens_per_s": round(tokens / (max(ends) - t0), 2) if ends else 0.0}
    return out


def counted(before: dict, after: dict) -> dict:
    """The counters over a run (after less before; None where the engine has none) and the mean requests per
    step; ``refused`` (admissions refused by the shared budget, by gate) and ``pooled_bytes`` as the engine's
    stats give them (None: not published)."""
    def delta(key: str) -> float | None:
        a, b = after.get(key), before.get(key)
        return None if a is None or b is None else a - b

    out: dict = {key: delta(key) for key in COUNTERS}
    steps, reqs = out["steps"], out["step_requests"]
    out["requests_per_step"] = round(reqs / steps, 3) if steps and reqs is not None else None
    gates_a, gates_b = after.get("refused"), before.get("refused") or {}
    out["refused"] = None if gates_a is None else {g: n - gates_b.get(g, 0) for g, n in gates_a.items()}
    out["pooled_bytes"] = after.get("pooled_bytes")
    ids = after.get("offloaded")
    out["preempted"] = None if ids is None else sorted(
        int(rid.rsplit("-", 1)[1]) for rid in set(ids) - set(before.get("offloaded") or ())
        if rid.rsplit("-", 1)[-1].isdigit())
    return out


def sample_segments(shm: Path, t0: float, stop: threading.Event, samples: list[dict]) -> None:
    """Every 0.5 s, each live segment: bytes mapped, reserved (mapped, holding no block: claimed but unused),
    blocks in use, running and waiting requests, and its reclaim totals (given to and taken from the others)."""
    from kvcached_core import list_models

    while not stop.wait(0.5):
        row: dict = {"t": round(time.perf_counter() - t0, 2)}
        for m in list_models(directory=shm):
            if m.status != "live":
                continue
            p, t = m.pressure, m.traffic
            row[m.model] = {"mapped": m.mapped_bytes, "reserved": m.reserved_bytes, "blocks_used": m.blocks_used,
                            "running": None if t is None else t.running, "waiting": None if t is None else t.waiting,
                            "gave": None if p is None else p.gave_total, "gave_count": None if p is None else p.gave_count,
                            "took": None if p is None else p.took_total, "took_count": None if p is None else p.took_count}
        samples.append(row)


def segment_figures(samples: list[dict]) -> dict:
    """From a run's segment samples: reclaims given and taken over the run (bytes and times, all models), the most
    bytes claimed but unused (reserved) at once and on average, and the most bytes one model held mapped."""
    if len(samples) < 2:
        return {"gave_bytes": None, "gave_count": None, "took_bytes": None, "took_count": None,
                "unused_bytes_peak": None, "unused_bytes_mean": None, "peak_model_mapped_bytes": None}
    first, last = samples[0], samples[-1]
    names = [k for k in last if k != "t" and k in first]

    def grew(key: str) -> int:
        return sum((last[n][key] or 0) - (first[n][key] or 0) for n in names)

    unused = [sum(v["reserved"] for k, v in row.items() if k != "t") for row in samples]
    return {"gave_bytes": grew("gave"), "gave_count": grew("gave_count"), "took_bytes": grew("took"),
            "took_count": grew("took_count"), "unused_bytes_peak": max(unused),
            "unused_bytes_mean": round(statistics.fmean(unused)),
            "peak_model_mapped_bytes": max((v["mapped"] for row in samples for k, v in row.items() if k != "t"),
                                           default=0)}


Around = Callable[[Slot], AbstractContextManager]  # entered before a run's replay starts, left after it ends


@dataclass
class Clock:
    """A wall-clock limit on the comparison: no pair (or the ``alone`` runs) starts unless it fits in what is left,
    judged by the longest slot so far (a run with what ``around`` did before it, such as starting engines)."""

    deadline: float | None  # time.monotonic; None: no limit
    longest_s: float = 0.0
    stopped: str = ""  # why runs were left out, once they were

    def fits(self, slots: int, what: str) -> bool:
        if self.deadline is None or self.stopped:
            return not self.stopped
        left = self.deadline - time.monotonic()
        if slots * self.longest_s <= left:
            return True
        self.stopped = (f"{what} left out: {slots} runs of up to {self.longest_s:.0f} s each (the longest so far, "
                        f"engine starts included) would not end within the time limit ({max(0.0, left):.0f} s left)")
        return False


def compare(sides: dict[str, Side], trace: list[dict], pairs: int, timeout_s: float,
            done: Callable[[dict], None], around: Around | None = None, *, in_turn: bool = False,
            clock: Clock | None = None) -> list[dict]:
    """Every run of :func:`schedule` in order; ``done`` is called with each run as it ends (the report is rewritten
    then, so a comparison stopped part-way leaves the runs it finished). ``around(slot)`` (a driver's) is entered
    before each run's replay and left after it: outside the replay's clock (engines started in turn, a screenshot
    taken while it runs). ``clock``: a pair starts only if it fits the time left. Returns every run, warm-ups
    included."""
    return _runs(sides, trace, schedule(pairs, in_turn=in_turn), timeout_s, done, around, first=1,
                 clock=clock or Clock(None))


def alone_schedule(pairs: int) -> list[Slot]:
    """The limit of sharing: one discarded warm-up of the ``alone`` configuration, then ``pairs`` runs of it."""
    return [Slot("alone", "warm-up", 0)] + [Slot("alone", "alone", p) for p in range(1, pairs + 1)]


def compare_alone(side: Side, trace: list[dict], pairs: int, timeout_s: float, done: Callable[[dict], None],
                  first: int, clock: Clock | None = None) -> list[dict]:
    """The ``alone`` configuration's runs (:func:`alone_schedule`; not counted in the static/elastic ratios),
    numbered from ``first``."""
    return _runs({"alone": side}, trace, alone_schedule(pairs), timeout_s, done, None, first=first,
                 clock=clock or Clock(None))


def _runs(sides: dict[str, Side], trace: list[dict], slots: list[Slot], timeout_s: float,
          done: Callable[[dict], None], around: Around | None, first: int, clock: Clock) -> list[dict]:
    runs: list[dict] = []
    for i, slot in enumerate(slots, start=first):
        opens_pair = slot.kind == "pair" and (i == first or slots[i - first - 1].pair != slot.pair)
        if opens_pair and not clock.fits(2, f"pairs {slot.pair} to {slots[-1].pair}"):
            break
        began = time.monotonic()
        with around(slot) if around is not None else contextlib.nullcontext():
            result = replay(sides[slot.configuration], trace, f"{slot.configuration}{i - 1}", timeout_s)
        clock.longest_s = max(clock.longest_s, time.monotonic() - began)
        runs.append({"run": i, "configuration": slot.configuration, "kind": slot.kind, "pair": slot.pair,
                     "counted": slot.kind == "pair", **result})
        done(runs[-1])
    return runs
