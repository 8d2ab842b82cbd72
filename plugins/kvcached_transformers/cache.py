"""A transformers 5.x ``Cache`` whose keys and values live in blocks from a KVCacheManager.

Each batch row is a *sequence* with a block table: ``block_tokens`` tokens per block, a block id
being valid in every layer and in K and V alike (the allocator maps a page id in all of them).
Blocks are allocated as a sequence grows, in one atomic ``alloc`` per forward step, before any
layer writes; they go back when a sequence leaves the batch (:meth:`PagedKVCache.remove_sequences`,
``batch_select_indices``), on :meth:`~PagedKVCache.reset` and on :meth:`~PagedKVCache.close`.

Two ways to drive it:

* as any transformers cache: ``model.generate(..., **cache_arg(model, PagedKVCache.for_model(model)))``
  (:func:`~.compat.cache_arg`: ``cache=`` from transformers 5.20, ``past_key_values=`` before). Every
  row then stores every position the model sees (padding included, as DynamicCache does), and
  ``update`` returns exactly the tensors DynamicCache would.
* ragged, from an engine (:mod:`.engine`): :meth:`PagedKVCache.begin_step` tells the cache how
  many of each row's new positions are real tokens (the chunk is left-padded); only those are
  stored, each row keeps its own length, rows join and leave between steps, and the cache
  returns each row right-aligned in a left-padded rectangle with the matching attention mask and
  position ids.

Attention reads a gathered copy of each row's tokens (``[batch, kv_heads, width, head_dim]``),
which is what the eager/SDPA attention of transformers consumes; a paged attention kernel would
read the pools directly through :attr:`PagedKVCache.pools`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcached_core import KVCacheManager
from kvcached_core.engines import ENGINE_LINGER_S, alloc_blocks

from .pools import kv_pool
from .prefix import PrefixIndex

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_MAX_TOKENS = 1 << 16  # virtual capacity: address space only, nothing is committed until used


@dataclass
class _Seq:
    """One batch row: its blocks, in token order, and how many tokens it holds."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class StepPlan:
    """Where one forward step's tokens go and what attention reads, shared by every layer."""

    batch: int
    query_len: int
    width: int  # key/value length attention sees: the longest past + query_len
    attention_mask: torch.Tensor  # [batch, width], 1 where a row holds a real token
    position_ids: torch.Tensor  # [batch, query_len], each real token's position in its own sequence
    write_rows: torch.Tensor | None  # None: every chunk position is stored
    write_cols: torch.Tensor | None
    write_page: torch.Tensor
    write_tok: torch.Tensor
    read_page: torch.Tensor  # [batch, width]
    read_tok: torch.Tensor
    new_width: int  # the longest row after the step
    layers_done: int = 0


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared block tables; the data lives in the cache's pools."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: PagedKVCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.width = 0
        self.device = owner.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._owner._update_layer(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.width

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.width = 0

    # The block tables are shared by all layers, so the cache acts on all of them at once.
    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - the cache overrides the loop
        raise NotImplementedError("crop the PagedKVCache, not one of its layers")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # pragma: no cover
        raise NotImplementedError("reorder the PagedKVCache, not one of its layers")

    def batch_repeat_interleave(self, repeats: int) -> None:  # pragma: no cover
        raise NotImplementedError("repeat the PagedKVCache, not one of its layers")

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError("select rows of the PagedKVCache, not one of its layers")

    def offload(self) -> None:
        raise NotImplementedError("a PagedKVCache lives in allocator pages and cannot be offloaded")

    def prefetch(self) -> None:
        return None


class PagedKVCache(Cache):
    """Keys and values in KVCacheManager blocks; see the module docstring.

    ``wait``: seconds to wait for blocks when the allocator says no (0 raises
    :class:`~kvcached_core.engines.KVCacheExhausted` at once; ``float('inf')`` waits forever).
    """

    def __init__(self, manager: KVCacheManager, *, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", wait: float = 0.0, owns_manager: bool = False) -> None:
        self.manager = manager
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.wait = wait
        self.owns_manager = owns_manager
        token_bytes = kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if manager.block_bytes % token_bytes:
            raise ValueError(f"the manager's block_bytes {manager.block_bytes} is not a multiple of a token's "
                             f"{token_bytes} bytes ({kv_heads} heads x {head_dim} x {dtype})")
        if manager.num_kv_buffers != 2:
            raise ValueError("a PagedKVCache needs a manager with num_kv_buffers=2 (K and V)")
        self.block_tokens = manager.block_bytes // token_bytes
        self._bpp = manager.blocks_per_page
        self._tpp = self._bpp * self.block_tokens
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = [
            tuple(kv_pool(manager, layer, kv, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=self.device)
                  for kv in (0, 1))  # type: ignore[misc]
            for layer in range(manager.num_layers)
        ]
        self._seqs: list[_Seq] = []
        self._plan: StepPlan | None = None
        self._closed = False
        self.prefix: PrefixIndex | None = None  # see enable_prefix_cache
        self.prefix_hit_tokens = 0
        super().__init__(layers=[PagedLayer(self, i) for i in range(manager.num_layers)])

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, name: str | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                  max_tokens: int = DEFAULT_MAX_TOKENS, page_size: int | None = None, backend: str | None = None,
                  wait: float = 0.0) -> PagedKVCache:
        """A cache sized for ``model`` (a transformers decoder) with its own KVCacheManager.

        ``max_tokens`` is the virtual capacity in tokens, summed over sequences; memory is
        committed page by page as it is used. The backend is ``cuda`` for a model on a GPU,
        ``host`` otherwise. The manager publishes a segment named after the model (``name``).
        """
        config = cast("PreTrainedConfig", model.config).get_text_config(decoder=True)
        layers = config.num_hidden_layers
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        item = torch.empty((), dtype=dtype).element_size()
        block_bytes = block_tokens * heads * head_dim * item
        backend = backend or ("cuda" if device.type == "cuda" else "host")
        model_name = name or getattr(config, "name_or_path", "") or type(model).__name__
        manager = KVCacheManager(
            model_name, num_blocks=-(-max_tokens // block_tokens), block_bytes=block_bytes, num_layers=layers,
            page_size=page_size, backend=backend, device=device.index or 0, engine="transformers",
            block_tokens=block_tokens, name=name, refill_linger_s=ENGINE_LINGER_S,
        )
        try:
            return cls(manager, kv_heads=heads, head_dim=head_dim, dtype=dtype, device=device, wait=wait,
                       owns_manager=True)
        except BaseException:
            manager.close()
            raise

    # -- sequences ---------------------------------------------------------------------------
    @property
    def seq_lengths(self) -> list[int]:
        return [s.length for s in self._seqs]

    @property
    def blocks_held(self) -> int:
        return sum(len(s.blocks) for s in self._seqs)

    def add_sequences(self, count: int, tokens: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Append ``count`` rows to the batch; returns how many of each row's tokens the cache already holds.

        Without a prefix cache (or ``tokens``) the rows start empty and take blocks at their first step.
        With one, a row whose ``tokens`` begin with the tokens of cached blocks starts with those blocks
        (a prefix hit): feed it only the tokens after the returned count.
        """
        self._check_idle()
        if self.prefix is None or tokens is None:
            self._seqs.extend(_Seq() for _ in range(count))
            return [0] * count
        if len(tokens) != count:
            raise ValueError(f"{len(tokens)} token lists for {count} new rows")
        held: list[int] = []
        manager = self.manager
        for toks in tokens:
            with manager.lock:  # a compaction (the poller's) moves cached blocks only while this is held
                blocks = self.prefix.match(toks)
                if blocks:
                    manager.reuse(blocks)
                    self.prefix.forget(blocks)
            self._seqs.append(_Seq(blocks, len(blocks) * self.block_tokens))
            held.append(len(blocks) * self.block_tokens)
        self.prefix_hit_tokens += sum(held)
        self._set_width()  # attention's mask spans the longest row, a hit's cached tokens included
        return held

    def remove_sequences(self, rows: Iterable[int], tokens: Sequence[Sequence[int]] | None = None) -> None:
        """Drop rows from the batch (the others keep their order) and free their blocks now.

        With a prefix cache and ``tokens`` (each dropped row's tokens, in the order of ``rows``), the
        rows' full blocks join the cache instead of being freed (a block whose prefix is already
        cached is freed).
        """
        rows = list(rows)
        drop = set(rows)
        keep = [i for i in range(len(self._seqs)) if i not in drop]
        if len(keep) + len(drop) != len(self._seqs):
            raise IndexError(f"rows {sorted(drop)} are not all in a batch of {len(self._seqs)}")
        if self.prefix is not None and tokens is not None:
            if len(tokens) != len(rows):
                raise ValueError(f"{len(tokens)} token lists for {len(rows)} rows")
            self._check_idle()
            self._keep_prefixes([self._seqs[i] for i in rows], tokens)
        self._select(keep)

    # -- prefix cache ------------------------------------------------------------------------
    def enable_prefix_cache(self) -> None:
        """Keep the full blocks of finished sequences for later prompts that begin with the same tokens, and
        let the allocator compact them (``kvctl compact``, idle packing) and evict them for a lowered limit:
        this cache is its compact and evict handler."""
        if self.prefix is None:
            self.prefix = PrefixIndex(self.block_tokens)
            self.manager.set_compact_handler(self._compact_moves)
            self.manager.set_evict_handler(self._evict_for_limit)

    def drop_prefix_cache(self) -> int:
        """Free every cached block (sleep does this first); returns how many."""
        if self.prefix is None:
            return 0
        manager = self.manager
        with manager.lock:
            blocks = self.prefix.clear()
            if blocks:
                manager.free(blocks)
        return len(blocks)

    def _keep_prefixes(self, seqs: list[_Seq], tokens: Sequence[Sequence[int]]) -> None:
        """The sequences' full blocks go to the prefix cache; their other blocks stay with them to be freed."""
        assert self.prefix is not None
        index, manager = self.prefix, self.manager
        keep: list[int] = []
        with manager.lock:
            for seq, toks in zip(seqs, tokens, strict=True):
                full = min(seq.length, len(toks)) // self.block_tokens
                taken = [block for key, block in zip(index.keys(toks, full), seq.blocks[:full], strict=True)
                         if index.add(key, block)]
                keep += taken
                kept = set(taken)  # this sequence's blocks now cached: not its to free
                seq.blocks = [b for b in seq.blocks if b not in kept]
            if keep:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # their K/V is written before anyone may move them
                index.forget(manager.mark_cached(keep))  # what the budget (or idle packing) evicted

    def _compact_moves(self, moves: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The allocator's compact handler (its lock held): copy each block's K/V in every layer, remap the index."""
        if self.prefix is None or not self.pools:
            return []
        moves = [(s, d) for s, d in moves if s in self.prefix.hash_of]  # only blocks this cache indexes
        if not moves:
            return []
        with torch.inference_mode():
            self._copy_blocks([s for s, _ in moves], [d for _, d in moves])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sources are freed (and may be unmapped) when this returns
        self.prefix.remap(moves)
        return moves

    def _evict_for_limit(self) -> None:
        """The allocator's evict handler (a lowered limit waits on cached blocks): evict them and drop them from
        the index now. It runs on the poller's thread (or the one that set the limit) with the allocator's lock
        held, and this cache reads its index only under that lock (lookup to ``reuse``), so it is never torn."""
        if self.prefix is None:
            return
        with self.manager.lock:
            self.prefix.forget(self.manager.evict_for_limit())

    # -- stepping ----------------------------------------------------------------------------
    def begin_step(self, new_lengths: Sequence[int], query_len: int | None = None) -> StepPlan:
        """Allocate blocks for a forward step in which row ``i`` adds ``new_lengths[i]`` real tokens.

        The step's chunk is ``query_len`` wide (default: the longest), each row's tokens at its right
        end. Raises KVCacheExhausted (nothing changed) when the allocator cannot give the blocks.
        Returns the plan, whose ``attention_mask`` and ``position_ids`` go to the model's forward.
        The rows' lengths count the new tokens from here on: if that forward fails, drop the rows
        (``remove_sequences``) or ``reset()``, as their new positions were never written.
        """
        self._check_idle()
        if len(new_lengths) != len(self._seqs):
            raise ValueError(f"{len(new_lengths)} lengths for a batch of {len(self._seqs)} sequences")
        q = max(new_lengths, default=0) if query_len is None else query_len
        if any(n < 0 or n > q for n in new_lengths):
            raise ValueError(f"new lengths {list(new_lengths)} must lie in [0, {q}]")
        bt = self.block_tokens
        need = [max(0, -(-(s.length + n) // bt) - len(s.blocks)) for s, n in zip(self._seqs, new_lengths, strict=True)]
        # One alloc per growing row keeps each sequence's blocks together (a prompt's run, a decode
        # block) as the placement policy intends; a miss gives back what this step took.
        got: list[list[int]] = []
        try:
            for n in need:
                got.append(self._alloc(n) if n else [])
        except BaseException:
            taken = [b for ids in got for b in ids]
            if taken:
                self._free(taken)
            raise
        for seq, ids in zip(self._seqs, got, strict=True):
            seq.blocks.extend(ids)
        past = [s.length for s in self._seqs]
        for seq, n in zip(self._seqs, new_lengths, strict=True):
            seq.length += n
        self._plan = self._make_plan(past, list(new_lengths), q)
        return self._plan

    def _alloc(self, n: int) -> list[int]:
        """``n`` blocks; with a prefix cache, cached blocks are evicted (and forgotten) to make room first."""
        if self.prefix is not None and len(self.prefix):
            manager = self.manager
            with manager.lock:
                ids = manager.alloc(n)
                if ids is not None:
                    return ids
                self.prefix.forget(manager.evict(n))
        return alloc_blocks(self.manager, n, wait=self.wait)

    def _token_slots(self, seq: _Seq) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, token-in-page) of each of the sequence's tokens, in order."""
        blocks = torch.tensor(seq.blocks, dtype=torch.long)
        offs = torch.arange(self.block_tokens, dtype=torch.long)
        page = (blocks // self._bpp).repeat_interleave(self.block_tokens)
        tok = ((blocks % self._bpp) * self.block_tokens).unsqueeze(1).add(offs).reshape(-1)
        return page[:seq.length], tok[:seq.length]

    def _make_plan(self, past: list[int], new: list[int], q: int) -> StepPlan:
        batch = len(self._seqs)
        width = max(past, default=0) + q
        slots = [self._token_slots(s) if s.length else (torch.zeros(0, dtype=torch.long),) * 2 for s in self._seqs]
        # Every index must land on a block we hold (an unmapped page faults on a GPU): an empty
        # row reads some row's first token, masked out like any padding.
        anchor = next(((page[0], tok[0]) for page, tok in slots if len(page)), (0, 0))
        read_page = torch.full((batch, width), int(anchor[0]), dtype=torch.long)
        read_tok = torch.full((batch, width), int(anchor[1]), dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        positions = torch.zeros((batch, q), dtype=torch.long)
        wp, wt = [], []
        for row, ((page, tok), seq, p, n) in enumerate(zip(slots, self._seqs, past, new, strict=True)):
            if seq.length:
                # Right-aligned; left padding reads the row's first token (mapped, finite, masked out).
                src = (torch.arange(width) - (width - seq.length)).clamp_(min=0)
                read_page[row], read_tok[row] = page[src], tok[src]
                mask[row, width - seq.length:] = 1
            positions[row, q - n:] = torch.arange(p, p + n)
            wp.append(page[p:p + n])
            wt.append(tok[p:p + n])
        full = all(n == q for n in new)
        rows = cols = None
        if not full:
            rows = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(new)])
            cols = torch.cat([torch.arange(q - n, q) for n in new])
        dev = self.device

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dev, non_blocking=True)

        return StepPlan(
            batch=batch, query_len=q, width=width, attention_mask=mask.to(dev), position_ids=positions.to(dev),
            write_rows=put(rows), write_cols=put(cols),
            write_page=(torch.cat(wp).to(dev, non_blocking=True) if wp
                       else torch.zeros(0, dtype=torch.long, device=dev)),
            write_tok=(torch.cat(wt).to(dev, non_blocking=True) if wt
                       else torch.zeros(0, dtype=torch.long, device=dev)),
            read_page=read_page.to(dev), read_tok=read_tok.to(dev),
            new_width=max((s.length for s in self._seqs), default=0),
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(PagedLayer, self.layers[layer_idx]).update(key_states, value_states, *args, **kwargs)

    def _update_layer(self, layer: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, q, dim = key_states.shape
        if self._plan is None:
            # Driven by plain transformers code (generate, forward): every position is a token.
            if layer.layer_idx != 0:
                raise RuntimeError(f"layer {layer.layer_idx} updated before layer 0 in a step")
            if not self._seqs:
                self._seqs = [_Seq() for _ in range(batch)]
            self.begin_step([q] * batch, q)
        plan = self._plan
        assert plan is not None
        if (batch, q) != (plan.batch, plan.query_len) or (heads, dim) != (self.kv_heads, self.head_dim):
            raise ValueError(f"layer {layer.layer_idx} got keys {tuple(key_states.shape)}; the step planned "
                             f"[{plan.batch}, {self.kv_heads}, {plan.query_len}, {self.head_dim}]")
        if key_states.dtype != self.dtype:
            raise TypeError(f"keys are {key_states.dtype}, the cache holds {self.dtype}")
        k_pool, v_pool = self.pools[layer.layer_idx]
        for pool, states in ((k_pool, key_states), (v_pool, value_states)):
            tokens = states.transpose(1, 2)  # [batch, q, heads, dim]
            new = tokens.reshape(-1, heads, dim) if plan.write_rows is None else tokens[plan.write_rows, plan.write_cols]
            pool[plan.write_page, plan.write_tok] = new
        keys = k_pool[plan.read_page, plan.read_tok].transpose(1, 2).contiguous()
        values = v_pool[plan.read_page, plan.read_tok].transpose(1, 2).contiguous()
        layer.width = plan.new_width
        plan.layers_done += 1
        if plan.layers_done == len(self.layers):
            self._plan = None
        return keys, values

    # -- transformers' batch operations ------------------------------------------------------
    def _check_idle(self) -> None:
        if self._closed:
            raise RuntimeError("the PagedKVCache is closed")
        if self._plan is not None and self._plan.layers_done:
            raise RuntimeError("a forward step is half done; finish it (or reset the cache) first")

    def _select(self, order: Sequence[int]) -> None:
        """Rows become ``[old[i] for i in order]``; repeated rows get copies, dropped rows are freed."""
        self._check_idle()
        self._plan = None
        first: set[int] = set()
        copies: list[int] = []
        for i in order:
            if i in first:
                copies.append(i)
            first.add(i)
        fresh = alloc_blocks(self.manager, sum(len(self._seqs[i].blocks) for i in copies), wait=self.wait)
        dropped = [b for i, s in enumerate(self._seqs) if i not in first for b in s.blocks]
        seen: set[int] = set()
        new: list[_Seq] = []
        src_blocks: list[int] = []
        dst_blocks: list[int] = []
        at = 0
        for i in order:
            seq = self._seqs[i]
            if i not in seen:
                seen.add(i)
                new.append(seq)
                continue
            blocks = fresh[at:at + len(seq.blocks)]
            at += len(seq.blocks)
            src_blocks += seq.blocks
            dst_blocks += blocks
            new.append(_Seq(blocks, seq.length))
        if src_blocks:
            self._copy_blocks(src_blocks, dst_blocks)
        self._seqs = new
        if dropped:
            self._free(dropped)
        self._set_width()

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        offs = torch.arange(self.block_tokens)

        def index(blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            b = torch.tensor(blocks, dtype=torch.long)
            page = (b // self._bpp).repeat_interleave(self.block_tokens)
            tok = ((b % self._bpp) * self.block_tokens).unsqueeze(1).add(offs).reshape(-1)
            return page.to(self.device), tok.to(self.device)

        sp, st = index(src)
        dp, dt = index(dst)
        for k_pool, v_pool in self.pools:
            k_pool[dp, dt] = k_pool[sp, st]
            v_pool[dp, dt] = v_pool[sp, st]

    def _free(self, blocks: list[int]) -> None:
        """Give blocks back once no queued kernel can still touch them (their page may be unmapped next)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.manager.free(blocks)

    def _set_width(self) -> None:
        width = max((s.length for s in self._seqs), default=0)
        for layer in cast("list[PagedLayer]", self.layers):
            layer.width = width

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select([int(i) for i in beam_idx.reshape(-1).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([i for i in range(len(self._seqs)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row, freeing blocks that empty."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        self._check_idle()
        freed: list[int] = []
        for seq in self._seqs:
            seq.length = max(0, seq.length + tokens_to_remove)
            keep = -(-seq.length // self.block_tokens)
            freed += seq.blocks[keep:]
            del seq.blocks[keep:]
        if freed:
            self._free(freed)
        self._set_width()

    def reset(self) -> None:
        """Forget every sequence and give all blocks back, cached ones too (the cache stays usable)."""
        if self._closed:
            return
        self.drop_prefix_cache()
        self._plan = None
        blocks = [b for s in self._seqs for b in s.blocks]
        self._seqs = []
        if blocks:
            self._free(blocks)
        self._set_width()

    def close(self) -> None:
        """Free every block; close the manager (and remove its segment) when the cache created it."""
        if self._closed:
            return
        self.reset()
        if self.prefix is not None and not self.manager._closed:  # a manager closed first needs nothing
            self.manager.set_compact_handler(None)
            self.manager.set_evict_handler(None)
        self._closed = True
        self.pools = []  # release the views so the backend can unmap its range
        if self.owns_manager:
            self.manager.close()

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def batch_size(self) -> int:
        return len(self._seqs) if self._seqs else -1

    def __repr__(self) -> str:
        return (f"PagedKVCache(model={self.manager.model!r}, sequences={len(self._seqs)}, "
                f"blocks={self.blocks_held}, block_tokens={self.block_tokens})")
