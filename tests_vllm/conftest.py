"""Fixtures shared by the vLLM plugin tests: the tiny model, one plain-vLLM baseline, one server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached_vllm.tiny import build_tiny_llama, prompts

from .harness import Server, base_env, run_offline, start_server

NAME = "tiny-llama"  # the server's --served-model-name: its segment's name
# Prompt sets: a few short ones, and longer ones that take several 128-token blocks each.
SHORT = prompts(6, length=40, seed=1)
LONG = prompts(16, length=900, seed=2)
REPEATED = prompts(1, length=700, seed=3)[0]
BASELINE_TOKENS = 48  # every comparison uses a prefix of these greedy tokens


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def model_dir(workdir: Path) -> Path:
    # A directory name unlike NAME: an engine without --served-model-name is named after it.
    return build_tiny_llama(workdir / "tiny-random-llama")


@pytest.fixture(scope="session")
def shm(workdir: Path) -> Path:
    path = workdir / "shm"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def baseline(model_dir: Path, workdir: Path) -> list[list[int]]:
    """Greedy tokens of plain vLLM (plugin installed, ENABLE_KVCACHED unset) for SHORT + LONG + [REPEATED],
    in one offline run with a segment directory of its own: that run creates no segment."""
    plain_shm = workdir / "shm-plain"
    plain_shm.mkdir()
    env = base_env(plain_shm, enabled=False)
    result = run_offline(model_dir, env, SHORT + LONG + [REPEATED], BASELINE_TOKENS, workdir / "baseline.json")
    assert result["models"] == [], "vLLM without ENABLE_KVCACHED published a kvcached segment"
    assert not any(plain_shm.iterdir())
    return result["tokens"]


@pytest.fixture(scope="session")
def server(model_dir: Path, workdir: Path, shm: Path) -> Iterator[Server]:
    """``vllm serve`` with the plugin: the pool is never returned by itself (trim has something to
    take) and the prefix-cache budget is 16 blocks (2048 tokens)."""
    env = base_env(shm, enabled=True, KVCACHED_IDLE_RETURN_S="-1", KVCACHED_MAX_CACHED_TOKENS="2048")
    srv = start_server(model_dir, env, workdir / "serve.log", name=NAME,
                       args=("--enable-log-requests",))  # the sleep drain test waits on its "Added request" lines
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def ctl_env(shm: Path) -> dict[str, str]:
    return base_env(shm, enabled=False)
