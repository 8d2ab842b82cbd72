"""A request that can never fit under a model's limit ends, as at vLLM's length cap, instead of waiting or being
preempted and recomputed without end (plugins/kvcached_vllm/fit.py). A real engine of a model with wide KV
(few 128-token blocks a page), limited to one page: its blocks but vLLM's placeholder are all a request gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_core.segment.reader import snapshot
from kvcached_vllm.tiny import build_tiny_llama, prompts

from .harness import Server, base_env, kvctl, start_server, wait_for

NAME = "wide"
BLOCK_TOKENS = 128  # vLLM's block size on CPU


@pytest.fixture(scope="module")
def wide(workdir: Path) -> Iterator[tuple[Server, Path]]:
    model = build_tiny_llama(workdir / "tiny-wide-kv", layers=2, hidden=512, heads=8, kv_heads=8)
    shm = workdir / "shm-fit"
    shm.mkdir()
    server = start_server(model, base_env(shm, enabled=True), workdir / "serve-wide.log", name=NAME)
    try:
        yield server, shm
    finally:
        server.stop()


def test_a_request_that_can_never_fit_under_the_limit_ends_as_length(wide: tuple[Server, Path]) -> None:
    server, shm = wide
    ctl = base_env(shm, enabled=False)
    model = snapshot(NAME, directory=shm)
    most = (model.blocks_per_page - 1) * BLOCK_TOKENS  # the tokens one page holds beside the placeholder
    assert 100 + 16 < most < 1024, model  # the geometry this test is built on
    kvctl("limit", NAME, f"{model.bundle_bytes}B", env=ctl)  # one page
    try:
        wait_for(lambda: snapshot(NAME, directory=shm).limit_status == "applied")  # an idle engine: a poller tick
        too_long, growing, short = prompts(3, length=most + 100, seed=11)
        # a prompt beyond the limit: ended at once, no token (before: it waited at the head of the queue forever)
        first = server.choice(too_long, 16, timeout=120)
        assert first["finish_reason"] == "length" and first["token_ids"] == []
        # a request that outgrows the limit while it runs: ends with the tokens it had (before: preempted and
        # recomputed without end)
        grown = server.choice(growing[:most - 40], 200, timeout=120)
        assert grown["finish_reason"] == "length" and 0 < len(grown["token_ids"]) <= 41
        assert len(server.complete(short[:100], 16, timeout=120)) == 16  # what fits still runs
        assert "more than model 'wide' can ever hold" in server.log.read_text()
    finally:
        kvctl("limit", NAME, "none", env=ctl)
    assert len(server.complete(too_long, 16, timeout=120)) == 16  # the limit lifted, the long prompt runs
