"""A small greedy serving loop over a PagedKVCache: requests join and leave between steps.

Each step feeds every running request its pending tokens (a new request its whole prompt, a
running one its last token) in one left-padded chunk; the cache stores only real tokens, so a
request of 5 tokens holds one block whatever the batch looks like. A request that reaches its
``max_new_tokens`` or emits ``eos_token_id`` leaves the batch at once and its blocks go back to
the allocator. When admitting waiting requests would exhaust the cache, they wait for running
ones to finish; when the running requests themselves cannot grow, KVCacheExhausted propagates
(after the cache's ``wait``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvcached_core.engines import KVCacheExhausted

from .cache import PagedKVCache
from .compat import cache_keyword


@dataclass
class Request:
    """One prompt's generation; ``output`` fills in as it runs."""

    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    rid: int = 0
    output: list[int] = field(default_factory=list)
    done: bool = False

    def pending(self) -> list[int]:
        return self.prompt if not self.output else self.output[-1:]


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """The real tokens of each row of a padded batch, whichever side the padding is on."""
    if attention_mask is None:
        return [row.tolist() for row in input_ids]
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


class GreedyEngine:
    """Runs requests through ``model`` with their K/V in ``cache`` (ragged: see :meth:`PagedKVCache.begin_step`)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, *, max_batch: int | None = None,
                 pad_token_id: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.max_batch = max_batch
        self.pad_token_id = pad_token_id
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.steps = 0
        self._next_id = 0
        self._cache_kw = cache_keyword(model)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None) -> Request:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        req = Request(list(prompt), max_new_tokens, eos_token_id, rid=self._next_id)
        self._next_id += 1
        self.waiting.append(req)
        return req

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> int:
        room = len(self.waiting) if self.max_batch is None else max(0, self.max_batch - len(self.running))
        take = min(room, len(self.waiting))
        for _ in range(take):
            self.running.append(self.waiting.popleft())
        self.cache.add_sequences(take)
        return take

    def _plan(self, admitted: int):  # noqa: ANN202 - StepPlan
        while True:
            lengths = [len(r.pending()) for r in self.running]
            try:
                return self.cache.begin_step(lengths)
            except KVCacheExhausted:
                if admitted == 0 or len(self.running) == admitted:
                    raise
                # Not enough room for the newcomers: they wait until running requests finish.
                first = len(self.running) - admitted
                self.cache.remove_sequences(range(first, len(self.running)))
                for req in reversed(self.running[first:]):
                    self.waiting.appendleft(req)
                del self.running[first:]
                admitted = 0

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One forward pass over the running requests (admitting waiting ones); returns those that finished."""
        admitted = self._admit()
        if not self.running:
            return []
        plan = self._plan(admitted)
        q = plan.query_len
        ids = torch.full((len(self.running), q), self.pad_token_id, dtype=torch.long)
        for row, req in enumerate(self.running):
            toks = req.pending()
            ids[row, q - len(toks):] = torch.tensor(toks, dtype=torch.long)
        out = self.model(input_ids=ids.to(self.cache.device), attention_mask=plan.attention_mask,
                         position_ids=plan.position_ids, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: self.cache})
        next_tokens = out.logits[:, -1, :].argmax(dim=-1).tolist()
        self.steps += 1
        finished: list[int] = []
        for row, (req, tok) in enumerate(zip(self.running, next_tokens, strict=True)):
            req.output.append(int(tok))
            if len(req.output) >= req.max_new_tokens or (req.eos_token_id is not None and tok == req.eos_token_id):
                req.done = True
                finished.append(row)
        done = [self.running[i] for i in finished]
        if finished:
            self.cache.remove_sequences(finished)  # their blocks go back now
            self.running = [r for i, r in enumerate(self.running) if i not in set(finished)]
        return done

    def run(self, on_step: Callable[[GreedyEngine, list[Request]], None] | None = None) -> None:
        """Step until every submitted request is done."""
        while self.busy:
            done = self.step()
            if on_step is not None:
                on_step(self, done)


def generate(model: torch.nn.Module, cache: PagedKVCache, prompts: Iterable[Sequence[int]] | torch.Tensor, *,
             max_new_tokens: int | Sequence[int], attention_mask: torch.Tensor | None = None,
             eos_token_id: int | None = None, max_batch: int | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token lists, or a padded ``input_ids`` tensor with its mask,
    padded on either side); returns the new tokens of each prompt, in order."""
    rows = unpad(prompts, attention_mask) if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
    budgets = [max_new_tokens] * len(rows) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(rows):
        raise ValueError(f"{len(budgets)} max_new_tokens for {len(rows)} prompts")
    engine = GreedyEngine(model, cache, max_batch=max_batch)
    reqs = [engine.submit(p, n, eos_token_id) for p, n in zip(rows, budgets, strict=True)]
    engine.run()
    return [r.output for r in reqs]
