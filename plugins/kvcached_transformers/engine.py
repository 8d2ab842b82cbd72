"""A small greedy serving loop over a PagedKVCache: requests join and leave between steps.

Each step feeds every running request its pending tokens (a new request its whole prompt, a
running one its last token) in one left-padded chunk; the cache stores only real tokens, so a
request of 5 tokens holds one block whatever the batch looks like. A request that reaches its
``max_new_tokens`` or emits ``eos_token_id`` leaves the batch at once and its blocks go back to
the allocator. When admitting waiting requests would exhaust the cache, they wait for running
ones to finish; when the running requests themselves cannot grow, KVCacheExhausted propagates
(after the cache's ``wait``).

Sleep (:meth:`GreedyEngine.enable_sleep`, then ``kvctl sleep``): the engine admits no new
request, lets the running ones finish (``sleep_now`` preempts them: their blocks go back and they
are recomputed from their prompt and the tokens they already have after the wake), and once it
holds no block the allocator unmaps every page. ``kvctl wake`` or the next :meth:`~GreedyEngine.submit`
wakes it. The engine has no thread of its own: whoever holds its lock (a step, a submit, or the
allocator's poller while the engine is idle) does the work.
"""

from __future__ import annotations

import threading
import time
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
    cached: int = 0  # tokens of prompt + output whose K/V the cache holds

    def pending(self) -> list[int]:
        """The tokens the next step feeds: the prompt first, then the last token (all of them again after a
        preemption)."""
        if self.cached == 0:
            return self.prompt + self.output
        return (self.prompt + self.output)[self.cached:]


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """The real tokens of each row of a padded batch, whichever side the padding is on."""
    if attention_mask is None:
        return [row.tolist() for row in input_ids]
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


class GreedyEngine:
    """Runs requests through ``model`` with their K/V in ``cache`` (ragged: see :meth:`PagedKVCache.begin_step`)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, *, max_batch: int | None = None,
                 pad_token_id: int = 0, prefix_cache: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.prefix_cache = prefix_cache  # finished requests' full blocks are kept for later prompts (and compacted)
        if prefix_cache:
            cache.enable_prefix_cache()
        self.max_batch = max_batch
        self.pad_token_id = pad_token_id
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.steps = 0
        self._next_id = 0
        self._cache_kw = cache_keyword(model)
        self.paused = False  # sleeping or draining: no new request is admitted
        self.asleep = False
        self._draining = False
        self._pending: str | None = None  # a sleep action asked, not yet served
        self._lock = threading.Lock()  # held by a step, a submit, or whoever serves sleep
        self._pending_lock = threading.Lock()

    def submit(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None) -> Request:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        req = Request(list(prompt), max_new_tokens, eos_token_id, rid=self._next_id)
        with self._lock:
            self._next_id += 1
            self.waiting.append(req)
            if self.asleep:  # the next request wakes a sleeping model
                self.cache.manager.sleep.wake()  # publishes awake, then asks us to wake (served below)
        self._kick()
        return req

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> int:
        if self.paused:
            return 0
        room = len(self.waiting) if self.max_batch is None else max(0, self.max_batch - len(self.running))
        take = min(room, len(self.waiting))
        new = [self.waiting.popleft() for _ in range(take)]
        self.running.extend(new)
        if self.prefix_cache:
            held = self.cache.add_sequences(take, [r.prompt + r.output for r in new])
            for req, tokens in zip(new, held, strict=True):
                req.cached = tokens  # a prefix hit: those tokens are not fed again
        else:
            self.cache.add_sequences(take)
        return take

    def _tokens(self, reqs: Sequence[Request]) -> list[list[int]] | None:
        """What the prefix cache keeps of leaving requests: the tokens whose K/V the cache holds."""
        return [(r.prompt + r.output)[:r.cached] for r in reqs] if self.prefix_cache else None

    def _plan(self, admitted: int):  # StepPlan
        while True:
            lengths = [len(r.pending()) for r in self.running]
            try:
                return self.cache.begin_step(lengths)
            except KVCacheExhausted:
                if admitted == 0 or len(self.running) == admitted:
                    raise
                # Not enough room for the newcomers: they wait until running requests finish.
                first = len(self.running) - admitted
                self.cache.remove_sequences(range(first, len(self.running)), self._tokens(self.running[first:]))
                for req in reversed(self.running[first:]):
                    req.cached = 0
                    self.waiting.appendleft(req)
                del self.running[first:]
                admitted = 0

    def step(self) -> list[Request]:
        """One forward pass over the running requests (admitting waiting ones); returns those that finished."""
        with self._lock:
            self._serve()
            done = self._step()
            self._serve()
        self._kick()
        return done

    @torch.inference_mode()
    def _step(self) -> list[Request]:
        admitted = self._admit()
        if not self.running:
            return []
        plan = self._plan(admitted)
        q = plan.query_len
        ids = torch.full((len(self.running), q), self.pad_token_id, dtype=torch.long)
        for row, req in enumerate(self.running):
            toks = req.pending()
            ids[row, q - len(toks):] = torch.tensor(toks, dtype=torch.long)
            req.cached += len(toks)  # in the cache once this step's forward ran
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
            self.cache.remove_sequences(finished, self._tokens(done))  # their blocks go back now (or to the prefix cache)
            self.running = [r for i, r in enumerate(self.running) if i not in set(finished)]
        return done

    def run(self, on_step: Callable[[GreedyEngine, list[Request]], None] | None = None) -> None:
        """Step until every submitted request is done (while the engine sleeps, its waiting requests wait
        for the wake)."""
        while self.busy:
            done = self.step()
            if on_step is not None:
                on_step(self, done)
            if self.paused and not self.running:
                time.sleep(0.005)

    # -- sleep ---------------------------------------------------------------------------------
    def enable_sleep(self) -> None:
        """Let ``kvctl sleep`` (and the after-idle policy) put this engine's KV cache to sleep."""
        self.cache.manager.set_sleep_handler(self._sleep_request)

    def disable_sleep(self) -> None:
        self.cache.manager.set_sleep_handler(None)

    def _sleep_request(self, action: str) -> None:
        """The allocator's handler (poller thread, or a submit's wake): record, then serve if the engine is free."""
        with self._pending_lock:
            self._pending = action  # the later request wins
        self._kick()

    def _kick(self) -> None:
        """Serve what is pending unless someone holds the engine (they serve it when they let go)."""
        while self._pending is not None or (self._draining and not self.running):
            if not self._lock.acquire(blocking=False):
                return
            try:
                self._serve()
            finally:
                self._lock.release()

    def _serve(self) -> None:
        """With the engine's lock: take a sleep or wake, and finish a drain once nothing runs."""
        with self._pending_lock:
            action, self._pending = self._pending, None
        manager = self.cache.manager
        if action == "wake":
            self.paused = self.asleep = self._draining = False
        elif action in ("sleep", "sleep_now"):
            self.paused = True
            if self.asleep:  # asked again before a wake was served: unmap what was mapped since
                manager.sleep.ready()
            else:
                if action == "sleep_now" and self.running:
                    self._preempt_all()
                self._draining = True
        if self._draining and not self.running:
            self._draining = False
            self.asleep = True
            self.cache.drop_prefix_cache()
            manager.sleep.ready()  # no block is held: every page is unmapped

    def _preempt_all(self) -> None:
        """Running requests give their blocks back and wait, first in line, to be recomputed."""
        self.cache.remove_sequences(range(len(self.running)))
        for req in reversed(self.running):
            req.cached = 0
            self.waiting.appendleft(req)
        self.running = []


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
