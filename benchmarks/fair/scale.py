"""The operator-scale setup's arithmetic: which model size, and how much KV memory each static share gets.

An operator gives each engine what is left of the device after weights and activations. Here, for ``models``
Llama-shaped models on one device of ``device_bytes``:

- weights: the parameters of one model (:meth:`Shape.params`) times the dtype's bytes, per engine;
- activations: a declared allowance per engine (CUDA context, the allocator's working set at the batch's token
  limit: logits, attention masks, MLP intermediates), and one margin for the whole device;
- what is left is the KV memory. Both configurations' engines live at once (static: ``models`` engines, each with a
  fixed cache of one share; elastic: ``models`` engines under one budget equal to the shares added up), so it is
  split in ``2 * models`` shares; a share must hold at least ``min_share`` bytes;
- when both configurations cannot live at once with such shares, they run in turn (one configuration's engines
  alive at a time, started outside the timed runs): what is left after ``models`` engines is split in ``models``.

:func:`choose` takes the largest shape that fits both configurations at once, else the largest that fits them in
turn. Everything is whole blocks of ``page_tokens`` tokens: a share is ``blocks + 2`` blocks (transformers' two
padding blocks), the budget ``models`` shares.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
# On CPU, the one size the smoke test runs: a tiny Llama.
CPU_SHAPES = (Shape("tiny Llama", layers=2, hidden=256, heads=8, kv_heads=4, head_dim=32, intermediate=512, vocab=512,
                    tie_embeddings=False),)


@dataclass(frozen=True)
class Plan:
    """One device's operator-scale setup (bytes throughout)."""

    device_bytes: int
    shape: Shape
    dtype: str
    models: int
    together: bool  # both configurations' engines alive at once (else in turn)
    weights_bytes: int  # one model
    activation_bytes: int  # one engine's allowance
    margin_bytes: int
    block_bytes: int
    share_blocks: int  # a static share's blocks, its two padding blocks not included
    page_tokens: int

    @property
    def engines(self) -> int:
        """Engines alive at once."""
        return self.models * (2 if self.together else 1)

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
        """What the plan places on the device: weights, activations and KV of every engine alive, and the margin."""
        kv = self.share_bytes * self.engines  # static shares, plus (together) elastic's budget of the same size
        return self.engines * (self.weights_bytes + self.activation_bytes) + self.margin_bytes + kv

    def lines(self) -> list[str]:
        """The plan as the run prints it before starting."""
        from kvcached_core.sizes import format_bytes as g

        n = self.shape.params()
        params = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        how = "both configurations' engines alive at once" if self.together else \
            "the configurations in turn (both cannot live at once; engines start outside the timed runs)"
        return [f"plan: device {g(self.device_bytes)}; {self.models} x {self.shape.name}-shaped ({self.dtype}, "
                f"{params} parameters, {g(self.weights_bytes)} of weights each); {how}",
                f"plan: {self.engines} engines x ({g(self.weights_bytes)} weights + {g(self.activation_bytes)} "
                f"activations) + {g(self.margin_bytes)} margin; the KV memory left split in {self.engines} shares",
                f"plan: a static share {self.share_blocks} blocks of {self.page_tokens} tokens (+{PADDING_BLOCKS} "
                f"padding) = {g(self.share_bytes)}, {g(self.block_bytes)} a block; elastic budget "
                f"{g(self.budget_bytes)}; {g(self.used_bytes)} of {g(self.device_bytes)} placed"]

    def to_dict(self) -> dict:
        return {**asdict(self), "engines": self.engines, "share_bytes": self.share_bytes,
                "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes}


def plan(device_bytes: int, shape: Shape, *, dtype: str, activation_bytes: int, margin_bytes: int, models: int = 3,
         together: bool = True, page_tokens: int = 256) -> Plan:
    """The setup for ``shape`` (no check that the share is large enough: :func:`fits` says)."""
    weights = shape.params() * DTYPE_BYTES[dtype]
    block = shape.kv_token_bytes(dtype) * page_tokens
    engines = models * (2 if together else 1)
    left = device_bytes - margin_bytes - engines * (weights + activation_bytes)
    blocks = max(0, left // engines // block - PADDING_BLOCKS)
    return Plan(device_bytes, shape, dtype, models, together, weights, activation_bytes, margin_bytes, block, blocks,
                page_tokens)


def fits(p: Plan, min_share: int) -> bool:
    """A share holds at least ``min_share`` bytes and everything fits the device."""
    return p.share_blocks > 0 and p.share_bytes >= min_share and p.used_bytes <= p.device_bytes


def choose(device_bytes: int, shapes: tuple[Shape, ...], *, dtype: str, activation_bytes: int, margin_bytes: int,
           min_share: int, models: int = 3, page_tokens: int = 256) -> Plan:
    """The largest shape whose engines of both configurations fit at once with shares of ``min_share`` or more;
    else the largest that fits them in turn. ValueError when none fits at all."""
    for together in (True, False):
        for shape in shapes:
            p = plan(device_bytes, shape, dtype=dtype, activation_bytes=activation_bytes, margin_bytes=margin_bytes,
                     models=models, together=together, page_tokens=page_tokens)
            if fits(p, min_share):
                return p
    from kvcached_core.sizes import format_bytes

    raise ValueError(f"no model size fits {format_bytes(device_bytes)} with shares of {format_bytes(min_share)} or "
                     f"more (smallest: {shapes[-1].name})")
