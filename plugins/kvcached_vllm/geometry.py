"""vLLM's KV cache configuration as kvcached geometry: the one place both processes derive it.

The scheduler (block ids) and the worker (memory) must agree on page size, page count and
layers, or the worker refuses the scheduler at attach time. Both call :func:`kv_layout` on the
same ``KVCacheConfig``.

Supported: attention layers whose pages are all the same size, in a layer-outermost layout
(vLLM's default, ``LBHNC`` on CPU), in one KV cache group or several (sliding-window layers
beside full ones, Gemma or Mistral style). Layer slot ``s`` holds block ``b`` at
``s * layer_stride + b * block_stride``. vLLM overlays its groups: the ``s``-th layer of every
group shares slot ``s`` (a block id belongs to one group at a time), so the memory is the slots',
not the layers'. kvcached gives each slot its own range and maps a page id in every slot, so a
block keeps one stride inside its layer, as attention kernels expect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvcached_core.engines import Geometry
from kvcached_core.settings import PAGE_GRAIN, settings

# The KV cache specs kvcached places (by vLLM class name), and what each is called in messages.
# MLA's latent cache is one buffer per layer like any other; what is not listed is refused at start.
SHAPES = {
    "FullAttentionSpec": "full attention",
    "SlidingWindowSpec": "sliding window",
    "MLAAttentionSpec": "MLA",
}


class UnsupportedLayout(RuntimeError):
    """The model's KV cache cannot be placed in kvcached pages; the message says why and what to do."""


@dataclass(frozen=True)
class KVGroup:
    """One vLLM KV cache group: layers that share a block table."""

    shape: str  # SHAPES' word for its spec (the segment's layout.GROUP_SHAPE_NAMES)
    window: int | None  # tokens its sliding-window layers attend to; None: the whole sequence
    layer_names: tuple[str, ...]

    def describe(self) -> str:
        shape = f"{self.shape} {self.window}" if self.window else self.shape
        return f"{shape} ({len(self.layer_names)} layers)"


@dataclass(frozen=True)
class KVLayout:
    """A vLLM KV cache in kvcached terms (one KV buffer per slot: K and V side by side).

    ``slots[i]`` is the range layer ``layer_names[i]`` lies in; empty: each layer its own, in order.
    """

    layer_names: tuple[str, ...]
    num_blocks: int
    block_bytes: int  # one layer's block, vLLM's block stride
    block_tokens: int
    page_size: int
    slots: tuple[int, ...] = ()
    groups: tuple[KVGroup, ...] = ()

    def slot(self, index: int) -> int:
        return self.slots[index] if self.slots else index

    @property
    def num_layers(self) -> int:
        """Ranges kvcached maps a page in: one per slot."""
        return max(self.slots) + 1 if self.slots else len(self.layer_names)

    @property
    def blocks_per_page(self) -> int:
        return self.page_size // self.block_bytes

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.page_size, -(-self.num_blocks // self.blocks_per_page), self.num_layers, 1)

    def describe(self) -> str:
        """The groups in a few words, for the engine's log: ``2 groups: sliding window 256 (2 layers), ...``."""
        if not self.groups:
            return f"{len(self.layer_names)} layers"
        parts = [g.describe() for g in self.groups]
        return f"{len(self.groups)} group{'s' if len(self.groups) > 1 else ''}: " + ", ".join(parts)


def layer_specs(group: Any) -> dict[str, Any]:
    """Each layer of ``group`` and its own spec (a group of several layer types lists them per layer)."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(per_layer, dict):
        return {name: per_layer[name] for name in group.layer_names}
    return {name: spec for name in group.layer_names}


def _shape(spec: Any) -> tuple[str, int | None]:
    """The shape of ``spec``'s layers and their window (None: the whole sequence)."""
    kind = type(spec).__name__
    if kind not in SHAPES or getattr(spec, "page_size_padded", None):
        served = ", ".join(SHAPES.values())
        raise UnsupportedLayout(f"this model's KV cache has {kind} layers; kvcached serves {served} layers: "
                                "run it without ENABLE_KVCACHED")
    window = getattr(spec, "sliding_window", None) if kind == "SlidingWindowSpec" else None
    return SHAPES[kind], int(window) if window else None


def kv_layout(kv_cache_config: Any, page_size: int | None = None) -> KVLayout:
    """The :class:`KVLayout` of ``kv_cache_config``, or :class:`UnsupportedLayout` saying why not."""
    page_size = settings().page_size_bytes if page_size is None else page_size
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if not groups or not tensors:
        raise UnsupportedLayout("this model keeps no KV cache (attention-free): run it without ENABLE_KVCACHED")
    specs: dict[str, Any] = {}
    shapes: list[KVGroup] = []
    for group in groups:
        per_layer = layer_specs(group)
        kinds = {_shape(spec) for spec in per_layer.values()}
        if not kinds:
            raise UnsupportedLayout("a KV cache group has no layers: run this model without ENABLE_KVCACHED")
        if len(kinds) != 1:  # vLLM groups layers of one spec; a group of several would have no one shape
            raise UnsupportedLayout(f"a KV cache group mixes {sorted(k for k, _ in kinds)} layers: run this model "
                                    "without ENABLE_KVCACHED")
        specs.update(per_layer)
        (shape, window), = kinds
        shapes.append(KVGroup(shape, window, tuple(group.layer_names)))
    num_blocks = int(kv_cache_config.num_blocks)
    block_sizes = {int(t.block_stride) for t in tensors}
    pages = {int(spec.page_size_bytes) for spec in specs.values()}
    if len(block_sizes) != 1 or len(pages) != 1 or block_sizes != pages:
        raise UnsupportedLayout(
            f"this model's layers keep KV pages of different sizes ({sorted(pages | block_sizes)} B); kvcached "
            "maps one block size per model: run it without ENABLE_KVCACHED")
    block_bytes = block_sizes.pop()
    region = num_blocks * block_bytes
    names: list[str] = []
    slots: list[int] = []
    block_tokens = {int(spec.block_size) for spec in specs.values()}
    for tensor in tensors:
        if tensor.layer_stride < region:
            raise UnsupportedLayout(
                f"the KV cache layout {kv_cache_config.kv_cache_layout} interleaves layers inside a block "
                f"(layer stride {tensor.layer_stride} B, block stride {block_bytes} B); set "
                "VLLM_KV_CACHE_LAYOUT to a layer-outermost layout such as LBHNC")
        if getattr(tensor, "host_resident", False) or tensor.offset % tensor.layer_stride:
            raise UnsupportedLayout("this model's KV cache tensors are not whole layer regions (offset "
                                    f"{tensor.offset} B, layer stride {tensor.layer_stride} B): run it without "
                                    "ENABLE_KVCACHED")
        first = tensor.offset // tensor.layer_stride
        for index, name in enumerate(tensor.layers):
            if name not in specs:
                raise UnsupportedLayout(f"layer {name} has a KV tensor but no KV cache group: run this model "
                                        "without ENABLE_KVCACHED")
            names.append(name)
            slots.append(first + index)
    if len(block_tokens) != 1:
        raise UnsupportedLayout(f"this model's groups use blocks of {sorted(block_tokens)} tokens; kvcached maps "
                                "one block size per model: run it without ENABLE_KVCACHED")
    if block_bytes > page_size or page_size % block_bytes:
        fits = math.lcm(block_bytes, PAGE_GRAIN) >> 20  # the smallest page size kvcached accepts that holds whole blocks
        raise UnsupportedLayout(
            f"a vLLM block of {block_bytes} bytes per layer does not tile a kvcached page of {page_size} bytes: "
            f"set KVCACHED_PAGE_SIZE_MB={fits} (or a multiple), or choose a --block-size whose blocks tile the page")
    own = slots == list(range(len(names)))
    return KVLayout(tuple(names), num_blocks, block_bytes, block_tokens.pop(), page_size,
                    () if own else tuple(slots), tuple(shapes))
