"""A real vLLM engine sizes its KV cache from the shared budget, not from its own share of the machine, and
registers its measured working memory with the allocator (plugins/kvcached_vllm/available.py, sizing.py).

On CPU the shared budget is the host's (``KVCACHED_HOST_CAPACITY``); vLLM's own step would answer
``--gpu-memory-utilization`` of the machine less the worker's RSS (gigabytes here), or ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_core.segment import layout as L
from kvcached_core.segment.reader import snapshot
from kvcached_vllm.tiny import prompts

from .conftest import NAME as SESSION_NAME
from .harness import Server, base_env, start_server

NAME = "planned"
BUDGET = 64 << 20  # 128 blocks of the tiny model (512 KiB each, every layer)
SPAN = re.compile(r"kvcached: KV span ([\d.]+) GiB \((budget|device|explicit size)\)")


@pytest.fixture(scope="module")
def planned(model_dir: Path, workdir: Path) -> Iterator[tuple[Server, Path]]:
    """An engine under a 64 MiB host budget with no explicit KV size: vLLM's own step would give it
    ``--gpu-memory-utilization`` of the machine less its RSS."""
    shm = workdir / "shm-sizing"
    shm.mkdir()
    env = base_env(shm, enabled=True, KVCACHED_HOST_CAPACITY=f"{BUDGET}B")
    del env["VLLM_CPU_KVCACHE_SPACE"]
    server = start_server(model_dir, env, workdir / "serve-sizing.log", name=NAME,
                          args=("--gpu-memory-utilization", "0.2"))
    try:
        yield server, shm
    finally:
        server.stop()


def test_the_span_is_the_shared_budget_and_the_working_memory_is_registered(planned: tuple[Server, Path]) -> None:
    server, shm = planned
    model = snapshot(NAME, directory=shm)
    assert model.num_blocks * model.block_bundle_bytes == BUDGET, model.num_blocks  # before: vLLM's ~4 GiB
    log = server.log.read_text()
    found = SPAN.search(log)
    assert found and found.groups() == ("0.06", "budget"), log[-3000:]
    # the profiling pass's peak beyond what the worker held before it, registered for the peers to keep free
    raw = Path(model.path).read_bytes()
    peak, now = (L.U64.unpack_from(raw, at)[0] for at in (L.WORKING_PEAK_OFF, L.WORKING_NOW_OFF))
    logged = float(re.search(r"working peak ([\d.]+) GiB", found.string[found.start():]).group(1))  # type: ignore[union-attr]
    assert peak > 0 and round(peak / (1 << 30), 2) == logged and now <= peak, (peak, now)
    assert len(server.complete(prompts(1, length=300, seed=5)[0], 8, timeout=120)) == 8


def test_an_explicit_kv_size_below_the_budget_is_the_span(server: Server, shm: Path) -> None:
    """The session's engine: VLLM_CPU_KVCACHE_SPACE=1 under the default host budget (half the RAM)."""
    model = snapshot(SESSION_NAME, directory=shm)
    assert model.num_blocks * model.block_bundle_bytes == 1 << 30
    found = SPAN.search(server.log.read_text())
    assert found and found.groups() == ("1.00", "explicit size")
