"""A transformers engine on kvcached under a 4-page host budget, and another process's model that fills the rest.

The engine: continuous batching (16 blocks of 256 tokens, at most 4 requests and 1024 tokens a batch, FIFO) on
kvcached's host backend, under an 8 MiB ``KVCACHED_HOST_CAPACITY``, its warm pool at most one page and never
returned idle. Its padding sectors take one page. The donor: a model in a child process whose 12 blocks in use
take the other three pages.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import send, wait_for

import kvcached_core as kc
from kvcached_transformers import cb

PAGE_TOKENS = 256  # one block: 2 layers x K,V x 4 heads x 32 x fp32 x 256 tokens = 512 KiB, 4 per 2 MiB page
BLOCK_BYTES = 512 * 1024
MIB = 1 << 20


@contextmanager
def budget_engine(monkeypatch: pytest.MonkeyPatch, model: Any, name: str, new_tokens: int,
                  wake_up_loop: Callable[[Any], threading.Event] | None = None) -> Iterator[tuple[Any, Any]]:
    """The engine, started, named ``name``, once its padding page is mapped: (the plugin's handle, transformers'
    continuous batching manager); stopped and closed after. ``wake_up_loop``, given the handle, makes the event
    transformers' loop waits on."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "8MiB")  # 4 pages
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "1")
    handle = cb.install(model, name=name)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=PAGE_TOKENS, num_blocks=16, max_batch_tokens=1024,
                                      max_requests_per_batch=4, scheduler_type="fifo")
    manager_cb = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    if wake_up_loop is not None:
        manager_cb._wake_up_loop = wake_up_loop(handle)
    manager_cb.start()
    try:
        wait_for(lambda: handle.manager is not None and kc.snapshot(name).mapped_bytes == 2 * MIB,
                 what="the engine's padding page")
        yield handle, manager_cb
    finally:
        manager_cb.stop(block=True, timeout=30)
        handle.close()


def budget_donor(spawn_allocator: Any, name: str) -> subprocess.Popen:
    """The other model, named ``name``, with ``held``: 12 blocks in use on three pages (its warm pool up to 10)."""
    donor = spawn_allocator(name, num_blocks=64, block_bytes=BLOCK_BYTES, num_layers=1, num_kv_buffers=1,
                            page_size=2 * MIB, env={"KVCACHED_MAX_RESERVED_PAGES": "10"})
    send(donor, "held = m.alloc(12)")
    return donor


def pooled_donor(spawn_allocator: Any, name: str) -> subprocess.Popen:
    """The other model with its 12 blocks freed into its warm pool: three pages reserved, the budget full."""
    donor = budget_donor(spawn_allocator, name)
    send(donor, "m.free(held)")
    assert kc.snapshot(name).pages_reserved == 3
    return donor


def finished(manager_cb: Any, ids: list[str], seconds: float = 60.0) -> dict[str, list[int]]:
    """Each request's generated tokens, once every one of ``ids`` has finished without an error (``seconds`` at most)."""
    results: dict[str, list[int]] = {}
    deadline = time.monotonic() + seconds
    while len(results) < len(ids):
        assert time.monotonic() < deadline, f"requests did not finish: {sorted(set(ids) - set(results))}"
        got = manager_cb.get_result(timeout=1)
        if got is not None and got.is_finished():
            assert got.error is None, got.error
            results[got.request_id] = list(got.generated_tokens)
    return results
