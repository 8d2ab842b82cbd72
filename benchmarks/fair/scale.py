"""The operator-scale setup's arithmetic: which model size, and how much KV memory each static share gets, from what
a profiling pass measured.

An operator gives each engine what is left of the device after weights and the engines' working memory, as vLLM
sizes its cache (total x utilization - weights - the profiled peak). Here, for ``models`` Llama-shaped models on one
device (:class:`Measured`, per shape, by :mod:`.profile`):

- per engine: the weights (the parameters' bytes), the CUDA context (the process's device memory outside torch's
  allocator; none on CPU) and the working-memory peak measured by a profiling pass at ``max_batch_tokens`` with the
  longest prompts, for each configuration (static and elastic engines run different attention inputs);
- the device headroom (``KVCACHED_DEVICE_HEADROOM``) stays free;
- what is left of the device's free memory is the KV memory. Both configurations' engines live at once (static:
  ``models`` engines, each with a fixed cache of one share; elastic: ``models`` engines under one budget equal to the
  shares added up), so it is split in ``2 * models`` shares; a share must hold at least ``min_share`` bytes;
- when both configurations cannot live at once with such shares, they run in turn (one configuration's engines
  alive at a time, started outside the timed runs): what is left after the larger configuration's ``models`` engines
  is split in ``models``.

:func:`choose` takes the largest shape that fits both configurations at once, else the largest that fits them in
turn, measuring each shape it considers once. Everything is whole blocks of ``page_tokens`` tokens: a share is
``blocks + 2`` blocks (transformers' two padding blocks), the budget ``models`` shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

GiB = 1 << 30
MiB = 1 << 20
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PADDING_BLOCKS = 2  # transformers' paged cache keeps two blocks for padding


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model (random weights are built in place; no download)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool

    def params(self) -> int:
        """Parameters: embeddings (and the output head unless tied), per layer attention (q, k, v, o), the MLP
        (gate, up, down) and two norms, and the final norm."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return embeddings + self.layers * layer + self.hidden

    def kv_token_bytes(self, dtype: str) -> int:
        """K and V of one token, every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]


# The sizes tried on a GPU, largest first (the public models' shapes: Llama-3.1-8B, Llama-3.2-3B, Llama-3.2-1B).
GPU_SHAPES = (
    Shape("Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
          vocab=128256, tie_embeddings=False),
    Shape("Llama-3.2-3B", layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, intermediate=8192,
          vocab=128256, tie_embeddings=True),
    Shape("Llama-3.2-1B", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
          vocab=128256, tie_embeddings=True),
)
# On CPU, the one size the smoke test runs: a tiny Llama. Eight layers and no grouped KV heads, so that a layer's
# attention inputs (a copy of the KV it reads, per query head) are a small part of the KV, as on a real model.
CPU_SHAPES = (Shape("tiny Llama", layers=8, hidden=128, heads=4, kv_heads=4, head_dim=32, intermediate=256, vocab=512,
                    tie_embeddings=False),)


CONFIGS = ("static", "elastic")


@dataclass(frozen=True)
class Measured:
    """What a profiling pass found for one shape on one device (bytes; :mod:`.profile` measures it)."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free before any engine starts (the profiler's own use given back)
    context_bytes: int  # one engine's device memory outside torch's allocator (the CUDA context); 0 on CPU
    weights_bytes: int  # one model's parameters
    working_bytes: dict[str, int] = field(default_factory=dict)  # per configuration: the profiling pass's peak
    how: str = ""  # how the working memory was measured, as the plan prints it
    profile_cache_blocks: int = 0  # the static cache the static pass ran beside (its working memory grows with it)
    profile_budget_bytes: int = 0  # the budget the elastic pass ran under


@dataclass(frozen=True)
class Plan:
    """One device's operator-scale setup (bytes throughout)."""

    measured: Measured
    shape: Shape
    dtype: str
    models: int
    together: bool  # both configurations' engines alive at once (else in turn)
    headroom_bytes: int
    block_bytes: int
    share_blocks: int  # a static share's blocks, its two padding blocks not included
    page_tokens: int

    @property
    def engines(self) -> int:
        """Engines alive at once."""
        return self.models * (2 if self.together else 1)

    def engine_bytes(self, config: str) -> int:
        """One engine of ``config`` beside its KV: weights, CUDA context and measured working peak."""
        m = self.measured
        return m.weights_bytes + m.context_bytes + m.working_bytes[config]

    @property
    def share_bytes(self) -> int:
        """One static share: its blocks and its two padding blocks."""
        return (self.share_blocks + PADDING_BLOCKS) * self.block_bytes

    @property
    def budget_bytes(self) -> int:
        """Elastic's one budget: the static shares added up."""
        return self.models * self.share_bytes

    @property
    def used_bytes(self) -> int:
        """What the plan places on the device at most at once: the engines alive with their KV, and the headroom."""
        if self.together:
            engines = self.models * sum(self.engine_bytes(c) for c in CONFIGS)
        else:
            engines = self.models * max(self.engine_bytes(c) for c in CONFIGS)
        return engines + self.engines * self.share_bytes + self.headroom_bytes

    def lines(self) -> list[str]:
        """The plan as the run prints it before starting."""
        from kvcached_core.sizes import format_bytes as g

        m = self.measured
        n = self.shape.params()
        params = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        how = "both configurations' engines alive at once" if self.together else \
            "the configurations in turn (both cannot live at once; each one's engines start outside the timed runs)"
        working = ", ".join(f"{c} {g(m.working_bytes[c])}" for c in CONFIGS)
        alive = f"{self.models} static + {self.models} elastic engines" if self.together else \
            f"{self.models} engines of the larger configuration"
        return [f"plan: device {g(m.total_bytes)}, {g(m.free_bytes)} free; {self.models} x {self.shape.name}-shaped "
                f"({self.dtype}, {params} parameters); {how}",
                f"plan: per engine {g(m.weights_bytes)} weights + {g(m.context_bytes)} CUDA context + measured working "
                f"peak ({working}; {m.how}, beside a static cache of {m.profile_cache_blocks} blocks and under an "
                f"elastic budget of {g(m.profile_budget_bytes)})",
                f"plan: headroom {g(self.headroom_bytes)} (KVCACHED_DEVICE_HEADROOM) kept free; {alive} placed; the KV "
                f"memory left split in {self.engines} shares",
                f"plan: a static share {self.share_blocks} blocks of {self.page_tokens} tokens (+{PADDING_BLOCKS} "
                f"padding) = {g(self.share_bytes)}, {g(self.block_bytes)} a block; elastic budget "
                f"{g(self.budget_bytes)}; {g(self.used_bytes)} of {g(m.free_bytes)} free placed"]

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": asdict(self.shape), "engines": self.engines, "share_bytes": self.share_bytes,
                "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes,
                "engine_bytes": {c: self.engine_bytes(c) for c in CONFIGS}}


def plan(measured: Measured, shape: Shape, *, dtype: str, headroom_bytes: int, models: int = 3,
         together: bool = True, page_tokens: int = 256) -> Plan:
    """The setup for ``shape`` from ``measured`` (no check that the share is large enough: :func:`fits` says)."""
    block = shape.kv_token_bytes(dtype) * page_tokens
    probe = Plan(measured, shape, dtype, models, together, headroom_bytes, block, 0, page_tokens)
    left = measured.free_bytes - probe.used_bytes  # with shares of 0 blocks: the padding's blocks counted
    blocks = max(0, left // probe.engines // block)
    return Plan(measured, shape, dtype, models, together, headroom_bytes, block, blocks, page_tokens)


def upper_share_blocks(free_bytes: int, weights_bytes: int, context_bytes: int, *, headroom_bytes: int,
                       block_bytes: int, models: int) -> int:
    """The largest static share any plan could give (in turn, no working memory): the cache a profiling pass runs
    beside, so that the working memory it measures (which grows with the cache) is never less than a plan's."""
    left = free_bytes - headroom_bytes - models * (weights_bytes + context_bytes)
    return max(0, left // models // block_bytes - PADDING_BLOCKS)


def fits(p: Plan, min_share: int) -> bool:
    """A share holds at least ``min_share`` bytes and everything fits the device's free memory."""
    return p.share_blocks > 0 and p.share_bytes >= min_share and p.used_bytes <= p.measured.free_bytes


def choose(shapes: tuple[Shape, ...], measure: Callable[[Shape], Measured], *, free_bytes: int, total_bytes: int,
           dtype: str, headroom_bytes: int, min_share: int, models: int = 3, page_tokens: int = 256) -> Plan:
    """The largest shape whose engines of both configurations fit at once with shares of ``min_share`` or more;
    else the largest that fits them in turn. A shape whose weights alone leave no such room is not measured;
    ``measure(shape)`` profiles the others, each once. ValueError when none fits."""
    found: dict[str, Measured] = {}
    for together in (True, False):
        for shape in shapes:
            bare = Measured(total_bytes, free_bytes, 0, shape.params() * DTYPE_BYTES[dtype], dict.fromkeys(CONFIGS, 0))
            if not fits(plan(bare, shape, dtype=dtype, headroom_bytes=headroom_bytes, models=models,
                             together=together, page_tokens=page_tokens), min_share):
                continue
            if shape.name not in found:
                found[shape.name] = measure(shape)
            p = plan(found[shape.name], shape, dtype=dtype, headroom_bytes=headroom_bytes, models=models,
                     together=together, page_tokens=page_tokens)
            if fits(p, min_share):
                return p
    from kvcached_core.sizes import format_bytes

    raise ValueError(f"no model size fits {format_bytes(free_bytes)} free with shares of {format_bytes(min_share)} "
                     f"or more beside the weights, the working memory and the headroom (smallest: {shapes[-1].name})")
