"""The long-context mix: prompt lengths as production traffic of retrieval and agents draws them.

The declared mix (:data:`MIX`), prompt tokens by kind of request, each length uniform within its range:

==========  ===============  ===============================================================
 weight      prompt tokens    what
==========  ===============  ===============================================================
 35 %        1,024-2,048      retrieval-augmented chat: a question and a few retrieved passages
 30 %        2,048-4,096      retrieval over long documents: more and longer passages
 25 %        4,096-6,144      an agent with its tool calls and their results in the history
 10 %        6,144-8,192      a long agent session or a multi-turn chat near its window
==========  ===============  ===============================================================

Outputs: 64-256 new tokens, uniform (:data:`OUTPUT_TOKENS`). So the KV a request holds (about 3.5k tokens on
average) bounds how many requests a share holds at once, as in production, rather than compute.

:func:`scaled` maps the mix onto a smaller range (the CPU smoke test: 100-800 tokens) keeping its weights and the
proportions of its ranges. Draws come from the trace's seeded generator (:func:`draw`).
"""

from __future__ import annotations

import random

Bucket = tuple[float, int, int]  # weight, lowest and highest prompt tokens (both included)

MIX: tuple[Bucket, ...] = ((0.35, 1024, 2048), (0.30, 2048, 4096), (0.25, 4096, 6144), (0.10, 6144, 8192))
OUTPUT_TOKENS = (64, 256)


def bounds(mix: tuple[Bucket, ...]) -> tuple[int, int]:
    """The shortest and the longest prompt the mix draws."""
    return min(lo for _, lo, _ in mix), max(hi for _, _, hi in mix)


def scaled(mix: tuple[Bucket, ...], lo: int, hi: int) -> tuple[Bucket, ...]:
    """The mix with its range mapped linearly onto ``lo``-``hi`` tokens; the weights unchanged."""
    a, b = bounds(mix)

    def at(n: int) -> int:
        return round(lo + (n - a) * (hi - lo) / (b - a))

    return tuple((w, at(x), at(y)) for w, x, y in mix)


def draw(rng: random.Random, mix: tuple[Bucket, ...]) -> int:
    """One prompt length: a bucket by weight, then a length uniform within it."""
    _, lo, hi = rng.choices(mix, weights=[w for w, _, _ in mix])[0]
    return rng.randint(lo, hi)


def bucket_of(n: int, mix: tuple[Bucket, ...]) -> int:
    """The index of the first bucket whose range holds ``n`` (ValueError if none)."""
    for i, (_, lo, hi) in enumerate(mix):
        if lo <= n <= hi:
            return i
    raise ValueError(f"{n} tokens is outside the mix")
