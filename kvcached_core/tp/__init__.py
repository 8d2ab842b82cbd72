"""Tensor parallelism: one scheduler decides pages, one worker per rank holds the rank's KV shard.

- ``KVCacheManager.tensor_parallel(model, world=N, ...)`` starts ``world`` rank workers and returns
  the model's manager (its backend is a :class:`BroadcastBackend`); or pass ``tp_workers=[socket
  paths]`` to ``KVCacheManager`` to attach workers an engine started itself.
- :class:`TPWorker` is what an engine's per-GPU worker embeds (``.start()``, ``.buffer(layer, kv)``);
  ``python -m kvcached_core.tp.worker`` runs one on its own.

The model's segment lists every rank (pid, device, mapped bytes); its byte figures and its
limit count all ranks together, and limit and trim are acknowledged once every rank did them.
"""

from __future__ import annotations

from .broadcast import STRATEGIES, BroadcastBackend, RankLost, RankState
from .launch import WorkerGroup, attach, spawn_workers


def __getattr__(name: str):  # the worker module loads lazily (it also runs as ``-m``)
    if name in ("TPWorker", "WorkerError", "serve"):
        from . import worker

        return getattr(worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["STRATEGIES", "BroadcastBackend", "RankLost", "RankState", "TPWorker", "WorkerError", "WorkerGroup",
           "attach", "serve", "spawn_workers"]
