"""The trace: per model, Poisson arrivals whose rate follows a shape; prompt lengths drawn uniformly or from a declared
mix (:mod:`.longctx`), output lengths uniformly; seeded."""

from __future__ import annotations

import json
import random
from pathlib import Path

from .longctx import Bucket, draw

SHAPES = ("ramps", "bursty", "saturated", "steady")
BASE_FRACTION = 0.05  # arrivals between peaks (ramps, bursty), as a fraction of the peak rate


def rate_at(shape: str, m: int, models: int, t: float, duration: float, peak: float) -> float:
    """Model ``m``'s arrival rate at ``t`` (requests/s) for each shape.

    - ramps: a triangle 0 -> ``peak`` -> 0 per model, peaks staggered (the public kvcached's benchmark shape);
    - bursty: the duration cut into ``2 * models`` slots taken in turn; in its slots a model is flooded at ``peak``,
      the others idle;
    - saturated: model 0 at ``peak`` all along, the others idle (the public kvcached's overhead table);
    - steady: every model at half ``peak`` all along: with ``peak`` twice what a static share serves, each model at
      its share's capacity, where static partitioning is already right and elastic has nothing to win.
    Outside its load each model gets ``BASE_FRACTION`` of the peak (ramps and bursty) or nothing (saturated)."""
    base = peak * BASE_FRACTION
    if shape == "ramps":
        half = duration / (models + 1)
        return base + peak * max(0.0, 1.0 - abs(t - half * (m + 1)) / half)
    if shape == "bursty":
        slot = int(t / (duration / (2 * models)))
        return peak if slot % models == m else base
    if shape == "steady":
        return peak / 2
    return peak if m == 0 else 0.0


def make_trace(*, shape: str, models: int, duration_s: float, peak_rate: float, seed: int,
               prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
               prompt_mix: tuple[Bucket, ...] | None = None, **extra: object) -> list[dict]:
    """Poisson arrivals per model at :func:`rate_at`'s rate (thinning), sorted by time. Each row: ``t``, ``model``
    (``m0``...), ``prompt_tokens`` (from ``prompt_mix`` when given, else uniform in ``prompt_tokens``),
    ``max_tokens``, ``seed`` (the request's own tokens) and ``extra``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")
    rng = random.Random(seed)
    top = peak_rate * (1 + BASE_FRACTION)
    rows: list[dict] = []
    for m in range(models):
        t = 0.0
        while True:
            t += rng.expovariate(top)
            if t >= duration_s:
                break
            if rng.random() * top > rate_at(shape, m, models, t, duration_s, peak_rate):
                continue  # thinning: a non-homogeneous Poisson process
            prompt = draw(rng, prompt_mix) if prompt_mix else rng.randint(*prompt_tokens)
            rows.append({"t": round(t, 3), "model": f"m{m}", "prompt_tokens": prompt,
                         "max_tokens": rng.randint(*output_tokens), "seed": rng.randrange(1 << 30), **extra})
    rows.sort(key=lambda r: r["t"])
    return rows


FIELDS = ("t", "model", "prompt_tokens", "max_tokens", "seed")


def read_trace(path: Path, models: int) -> list[dict]:
    """A recorded trace: a JSON object whose ``requests`` are rows of :data:`FIELDS` (``t`` in seconds from the
    start, ``model`` one of ``m0``... ``m{models-1}``, token counts of at least 1, an integer seed), sorted by
    ``t``. ValueError (one line) when the file is not such a trace."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--trace {path}: cannot be read as JSON ({exc})") from None
    rows = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"--trace {path}: no 'requests' list")
    names = {f"m{m}" for m in range(models)}
    for i, row in enumerate(rows):
        ok = isinstance(row, dict) and all(k in row for k in FIELDS) and row["model"] in names and \
            isinstance(row["t"], (int, float)) and row["t"] >= 0 and all(
                isinstance(row[k], int) and not isinstance(row[k], bool) for k in ("prompt_tokens", "max_tokens", "seed")) \
            and row["prompt_tokens"] >= 1 and row["max_tokens"] >= 1
        if not ok:
            raise ValueError(f"--trace {path}: request {i} is not {{t >= 0, model in m0..m{models - 1}, "
                             f"prompt_tokens >= 1, max_tokens >= 1, seed}}")
    return sorted(({k: row[k] for k in FIELDS} for row in rows), key=lambda r: r["t"])
