"""The multimodel benchmark's rows: prefix caching on or off alike in both configurations, over prompts
that begin with their model's system prompt (no engine is started here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import multimodel
from benchmarks.fair import vllm as driver


@pytest.mark.parametrize("on", [True, False])
def test_static_and_elastic_engines_run_with_the_same_prefix_caching(on: bool) -> None:
    flag = "--enable-prefix-caching" if on else "--no-enable-prefix-caching"
    for elastic in (False, True):
        cmd = driver.engine_cmd(Path("/m"), "m0", 8000, elastic, on)
        assert flag in cmd and sum("prefix-caching" in arg for arg in cmd) == 1, cmd
        assert ("--num-gpu-blocks-override" in cmd) is not elastic


def test_the_prefix_option_names_its_rows_in_order() -> None:
    assert multimodel.PREFIX == {"on": (True,), "off": (False,), "both": (True, False)}


def test_every_prompt_of_a_model_begins_with_its_system_prompt_of_whole_blocks() -> None:
    data = json.loads(driver.TRACE.read_text())
    assert data["system_prompt_tokens"] == driver.SYSTEM_PROMPT_TOKENS
    assert driver.SYSTEM_PROMPT_TOKENS % driver.BLOCK_TOKENS == 0
    rows, _ = driver.load_trace(quick=True)
    system = driver.SYSTEM_PROMPT_TOKENS
    prompts: dict[str, list[list[int]]] = {}
    for row in rows:
        ids = driver.prompt_ids(row)
        assert len(ids) == row["prompt_tokens"] > system
        prompts.setdefault(row["model"], []).append(ids)
    heads = {model: {tuple(p[:system]) for p in ps} for model, ps in prompts.items()}
    assert all(len(h) == 1 for h in heads.values()), "one system prompt per model"
    assert len({next(iter(h)) for h in heads.values()}) == len(heads), "each model its own"
    # After the system prompt, each request's own tokens: no further block is shared.
    for ps in prompts.values():
        assert len({tuple(p[system:system + driver.BLOCK_TOKENS]) for p in ps}) == len(ps)
