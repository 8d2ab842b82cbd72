"""The profiling passes: each configuration's working-memory peak, measured as vLLM's profile run measures it.

One child process (as an engine is one) builds the model and, for each configuration in turn, starts transformers'
continuous batching on it (static beside a fixed cache; elastic on kvcached under a budget), answers a warm-up
request, then runs a pass (:func:`.passes.fill_pass`): the longest prompts the trace draws, as many as the cache or
budget holds, prefilled at ``max_batch_tokens`` a step and all running at once by its end, so that a step reads as
much KV as that memory can give one batch. Working memory is what the pass took beside the weights and the KV cache
(:mod:`.passes` says how it is measured on CUDA and on CPU).

Both passes run beside the most memory a plan could give them, since transformers' attention inputs grow with the
cache (static) or with what a batch reads (elastic): the static cache is the largest share any plan could give
(:func:`.scale.upper_share_blocks`), and the elastic budget the largest a plan could give once static's peak is
known (the parent computes it from the static figures). So a plan's engines never need more than was measured.
Engines at operator scale run one share's pass as their warm-up (:func:`.tcb_child.warm_pass`), so an engine that
cannot hold it fails at its start, and an elastic engine's registered working memory (the plugin's) starts there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .passes import Meter, Pass, blocks_of, fill_pass, measure_pass, wait_warm
from .scale import PADDING_BLOCKS, Measured, upper_share_blocks
from .tcb_child import build_model, log_to, setup_of, start_batching
from .tcb_engines import Engines, context
from .tcb_errors import error_line
from .tcb_setup import PAGE_TOKENS, WARM_POOL


def profile_child(spec: dict, inbox: Any, outbox: Any) -> None:
    """A child: the static pass, its figures put on the outbox as ``("profile-static", name, None, figures, ...)``;
    then, given ``("elastic", budget_bytes)`` on the inbox, the elastic pass over that budget and every figure as
    ``("profile", ...)``; ``("died", ...)`` with the error line when it fails. It ends when told (``None``)."""
    log_to(spec.get("log"))
    os.environ.update(spec["env"])
    try:
        profiler = _Profiler(spec)
        outbox.put(("profile-static", spec["name"], None, profiler.static(), None, 0, None))
        asked = inbox.get()
        if asked is None:
            return
        outbox.put(("profile", spec["name"], None, profiler.elastic(asked[1]), None, 0, None))
    except Exception as exc:
        outbox.put(("died", spec["name"], None, None, None, 0, error_line(exc)))
        raise
    inbox.get()


class _Profiler:
    """The model, built once, and each configuration's pass on it (see the module docstring)."""

    def __init__(self, spec: dict) -> None:
        from kvcached_core.settings import settings

        self.spec = spec
        self.setup = setup = setup_of(spec)
        self.meter = meter = Meter(setup.device)
        declared = spec.get("declared_bytes")
        total, free = (declared, declared) if declared else (meter.total_bytes, meter.free_bytes)
        self.model = build_model(setup, spec["seed"])
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.figures: dict = {"total_bytes": total, "free_bytes": free, "context_bytes": meter.context_bytes,
                              "weights_bytes": weights, "working_bytes": {}, "how": meter.how}
        self.cache_blocks = upper_share_blocks(free, weights, meter.context_bytes,
                                               headroom_bytes=settings().device_headroom.of(total),
                                               block_bytes=setup.block_bytes, models=spec["models"])

    def static(self) -> dict:
        """The static pass, beside the largest static cache any plan could give."""
        p = fill_pass(self.cache_blocks, self.setup, self.spec["seed"])
        if blocks_of(p) > self.cache_blocks:
            raise RuntimeError(f"the device leaves no room for a static cache of one longest request "
                               f"({blocks_of(p)} blocks) beside {self.spec['models']} engines' weights")
        self.figures.update(profile_cache_blocks=self.cache_blocks, pass_requests=len(p.prompts),
                            pass_prompt_tokens=len(p.prompts[0]), static_pass_blocks=blocks_of(p))
        self.figures["working_bytes"]["static"] = self._measure(False, self.cache_blocks, p)
        return dict(self.figures)

    def elastic(self, budget_bytes: int) -> dict:
        """The elastic pass under a budget of ``budget_bytes`` (the largest a plan could give, from the static
        figures), reading as much of it at once as the pass holds."""
        setup = self.setup
        os.environ["KVCACHED_DEVICE_BUDGET" if setup.device == "cuda" else "KVCACHED_HOST_CAPACITY"] = \
            f"{budget_bytes >> 20}MiB"
        blocks = budget_bytes // setup.block_bytes - PADDING_BLOCKS
        p = fill_pass(blocks, setup, self.spec["seed"])
        self.figures.update(profile_budget_bytes=budget_bytes, elastic_pass_blocks=blocks_of(p))
        self.figures["working_bytes"]["elastic"] = self._measure(True, blocks, p)
        return dict(self.figures)

    def _measure(self, elastic: bool, blocks: int, p: Pass) -> int:
        import gc

        manager, handle = start_batching(self.model, self.setup, elastic=elastic, num_blocks=blocks,
                                         name=f"{self.spec['name']}-{'elastic' if elastic else 'static'}")
        try:
            wait_warm(manager)
            return measure_pass(manager, handle, self.meter, p)
        finally:
            manager.stop(block=True, timeout=60)
            if handle is not None:
                handle.close()
            del manager, handle
            gc.collect()
            if self.meter.cuda:
                import torch

                torch.cuda.empty_cache()



def measured_from(figures: dict) -> Measured:
    return Measured(**{k: figures[k] for k in ("total_bytes", "free_bytes", "context_bytes", "weights_bytes",
                                               "working_bytes", "how", "profile_cache_blocks",
                                               "profile_budget_bytes")})


def measure(setup: Any, *, models: int, seed: int, shm: Any, logs: Any, declared_bytes: int | None,
            elastic_budget: Callable[[Measured], int], timeout_s: float = 900.0) -> tuple[Measured, dict]:
    """Run the profiling passes for ``setup``'s model in a child process: static first, then elastic under
    ``elastic_budget(what static measured)`` bytes. What it measured, and its figures as it gave them. EngineDied
    with its error line when it fails."""
    spec = {"name": "profile", "seed": seed, "setup": setup.__dict__, "models": models, "page_tokens": PAGE_TOKENS,
            "declared_bytes": declared_bytes, "env": {"KVCACHED_SHM_DIR": str(shm),
                                                      "OMP_NUM_THREADS": str(setup.threads), **WARM_POOL}}
    child = Engines(context(), ["profile"], [spec], shm=None, vocab=setup.vocab, logs=logs, target=profile_child)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = child.get(deadline - time.monotonic())
            if msg is None:
                continue
            figures = msg[3]
            if msg[0] == "profile-static":
                partial = measured_from({**figures, "working_bytes": {**figures["working_bytes"], "elastic": 0},
                                         "profile_budget_bytes": 0})
                child.inboxes["profile"].put(("elastic", elastic_budget(partial)))
            elif msg[0] == "profile":
                return measured_from(figures), figures
        raise RuntimeError(f"the profiling passes did not end within {timeout_s:.0f} s")
    finally:
        child.stop()
