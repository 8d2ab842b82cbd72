"""The read window: the attention buffers transformers sizes by the cache's capacity, sized by what a batch reads.

For ``sdpa`` and ``paged|eager`` attention, transformers' continuous batching keeps one attention mask of
``max_batch_tokens x (N + max_batch_tokens)`` elements in the model's dtype, and read indices of
``N + max_batch_tokens`` per attention type, where N (``PagedAttentionCache.max_tokens_read``) is the cache's whole
capacity in tokens; each batch uses the corner ``[q, q + kv]`` of them (``q`` query tokens, ``kv`` cached tokens read).
On kvcached the capacity is address space (for an elastic model the whole budget it shares), so the buffers would
grow with the budget, not with what the model does. Here N is the *window*:

- the buffers start at one sector's tokens; before a batch's tensors are built, a batch that reads more than the
  window grows it to :data:`GROWTH` times its read (whole sectors, at most the capacity and the batch's read budget),
  and :data:`SHRINK_AFTER` batches in a row that read less than :data:`SHRINK_BELOW` of it shrink it the same way; an
  idle or sleeping loop shrinks it back to one sector (a batch of the decode fast path reads through its block table,
  not these buffers, and leaves the window as it is). The new buffers are fully reset (mask at the dtype's minimum, indices at the trash sector), as
  transformers leaves unused parts;
- the scheduler's per-batch read budget stays the capacity, so batches are those of the path without a window, and
  the attention sees the same inputs (``[q, q + kv]``, read by the same indices): the same tokens.

So every attention input (the mask, the indices, the keys and values read, and sdpa's copy of them per query head)
is bounded by the tokens the batch reads, which are the tokens its requests hold (a block shared by several requests
is read once per request, as transformers does). ``install(max_read_tokens=)`` bounds the reads themselves: the
batch's read budget is then that (at least the longest read of one request, which may run alone), so the working
memory is that of a static cache of that size however much the model holds; requests past the budget wait for the
next batch. The buffers are replaced only between batches; CUDA graphs, ``torch.compile`` and async batching keep
references to them (and pad reads to the capacity), so with any of these on, the window is off and transformers'
sizing stays (:func:`applies`).
"""

from __future__ import annotations

from math import ceil
from typing import Any

import torch

GROWTH = 1.25  # a window grown (or shrunk) for a read holds this many times it: fewer resizes while reads grow
SHRINK_BELOW = 0.25  # reads under this share of the window shrink it...
SHRINK_AFTER = 16  # ...after this many batches in a row (on a GPU a resize empties torch's cache: not every step)


def applies(cb_config: Any) -> bool:
    """Whether the window can serve this (resolved) ``ContinuousBatchingConfig``: no CUDA graphs, no compile, no async
    batching (each keeps the buffers or pads reads to the capacity)."""
    graphs = any(cb_config.cuda_graph_booleans)
    compiled = cb_config.varlen_compile_config is not None or cb_config.decode_compile_config is not None
    return not (graphs or compiled or cb_config.use_async_batching)


class ReadWindow:
    """The read window of one cache: ``tokens`` (N above) between ``step`` and ``capacity``, whole steps."""

    def __init__(self, capacity: int, step: int) -> None:
        if capacity <= 0 or step <= 0:
            raise ValueError(f"a read window needs a positive capacity and step, got {capacity} and {step}")
        self.capacity, self.step = capacity, step
        self.tokens = min(capacity, step)
        self.peak = self.tokens  # the largest window so far
        self.resizes = 0
        self._small = 0  # batches in a row that read under SHRINK_BELOW of the window

    def size_for(self, kv_read: int, budget: int | None = None) -> int:
        """The window for a batch that reads ``kv_read`` cached tokens: GROWTH times it in whole steps, at least one
        step, at most the capacity and the whole steps that hold ``budget`` (the most a batch may read now)."""
        most = self.capacity if budget is None else min(self.capacity, ceil(budget / self.step) * self.step)
        steps = max(1, ceil(ceil(kv_read * GROWTH) / self.step))
        return max(min(most, steps * self.step), min(self.capacity, kv_read))

    def wanted(self, kv_read: int, budget: int | None = None) -> int | None:
        """The new window before a batch of ``kv_read``, or None to keep this one."""
        small = kv_read < self.tokens * SHRINK_BELOW
        self._small = self._small + 1 if small else 0
        if kv_read <= self.tokens and self._small < SHRINK_AFTER:
            return None
        size = self.size_for(kv_read, budget)
        return None if size == self.tokens else size

    def fit(self, io: Any, kv_read: int, budget: int | None = None) -> None:
        """Before a batch's tensors are built (``ContinuousBatchingIOs.prepare_batch_tensors``): the window it needs
        (``budget``: the most the batch could read, see :meth:`size_for`)."""
        size = self.wanted(kv_read, budget)
        if size is not None:
            self.resize(io, size)

    def idle(self, io: Any) -> None:
        """The loop has nothing to run: the window back to one step."""
        if self.tokens > self.step:
            self.resize(io, min(self.capacity, self.step))

    def resize(self, io: Any, tokens: int) -> None:
        """Replace ``io``'s mask and read indices with buffers for a window of ``tokens``, fully reset. Each old buffer
        goes before its successor is taken, so the two never coexist; on a GPU torch's cache returns the old memory."""
        width = tokens + io.write_index_storage.size(-1)  # N + max_batch_tokens
        masks = io.attention_mask
        if masks is not None:
            for name in list(masks):
                old = masks.pop(name)
                rows, spec = old.shape[:-1], (old.dtype, old.device, old.is_pinned())
                del old
                masks[name] = _filled((*rows, width), torch.finfo(spec[0]).min, *spec)
        old = io.read_index_storage
        groups, spec = old.size(0), (old.dtype, old.device, old.is_pinned())
        del old
        io.read_index_storage = None  # the old indices go first
        storage = torch.empty((groups, width), dtype=spec[0], device=spec[1], pin_memory=spec[2])
        for row, allocator in zip(storage, io.cache.cache_allocators.values(), strict=True):
            row.fill_(allocator.read_trash_index)
        io.read_index_storage = storage
        if spec[1].type == "cuda":
            torch.cuda.empty_cache()  # the old buffers' segments back to the device, for KV or another engine
        self.tokens = tokens
        self.peak = max(self.peak, tokens)
        self.resizes += 1
        self._small = 0


def _filled(shape: tuple[int, ...], value: float, dtype: torch.dtype, device: torch.device,
            pinned: bool) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned)
    return tensor.fill_(value)
