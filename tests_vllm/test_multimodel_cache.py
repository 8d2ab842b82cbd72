"""The multimodel benchmark's vLLM driver keeps its tiny model and vLLM's cache between runs (start-up is most of its wall time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.fair import vllm as driver


def test_the_tiny_model_is_built_once_and_a_stale_build_is_replaced(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kept = tmp_path / "cache" / "kvcached" / "multimodel-tiny-llama"
    assert driver.tiny_model(tmp_path / "run1") == kept
    assert json.loads((kept / "kvcached-tiny.json").read_text()) == driver.TINY
    assert (kept / "model.safetensors").is_file()
    # A second run takes the kept build as it is, without building (run2 stays empty).
    weights = (kept / "model.safetensors").stat().st_mtime_ns
    assert driver.tiny_model(tmp_path / "run2") == kept
    assert not (tmp_path / "run2").exists()
    assert (kept / "model.safetensors").stat().st_mtime_ns == weights
    # A build with another stamp is not used: it is built again and replaced.
    (kept / "kvcached-tiny.json").write_text(json.dumps(dict(driver.TINY, layers=2)))
    assert driver.tiny_model(tmp_path / "run3") == kept
    assert (tmp_path / "run3" / "tiny-llama").is_dir()
    assert json.loads((kept / "kvcached-tiny.json").read_text()) == driver.TINY
    assert not list(kept.parent.glob("multimodel-tiny-llama.*")), "a staged copy was left behind"


def test_every_engine_of_both_configurations_shares_one_kept_vllm_cache(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    roots = {driver.engine_env(tmp_path / config, config == "elastic", core, 1 << 26)["VLLM_CACHE_ROOT"]
             for config in ("static", "elastic") for core in (0, 1)}
    assert roots == {str(tmp_path / "cache" / "kvcached" / "multimodel-vllm")}


def test_vllm_model_inspection_is_cached_once_ahead_of_the_engines(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One process fills vLLM's own inspection cache, which vLLM then takes as valid (no engine inspects)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not driver.model_info_cached()
    proc = driver.warm_model_info()
    assert proc is not None
    driver.wait_warm(proc)
    assert proc.returncode == 0
    assert driver.model_info_cached()
    assert driver.warm_model_info() is None  # a second run starts no process
    monkeypatch.setenv("VLLM_CACHE_ROOT", driver.engine_env(tmp_path, False, 0, 0)["VLLM_CACHE_ROOT"])
    from vllm.model_executor.models import registry

    lazy = registry.ModelRegistry.models[driver.ARCH]
    model_file = Path(registry.__file__).parent / f"{lazy.module_name.split('.')[-1]}.py"
    info = lazy._load_modelinfo_from_cache(lazy._get_modelinfo_module_hash(model_file))
    assert info is not None and info.architecture == driver.ARCH and info.is_text_generation_model


def test_a_failed_warm_up_costs_one_stderr_line(capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit('no vllm here')"], stderr=subprocess.PIPE)
    driver.wait_warm(proc)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no vllm here" in err and "each engine inspects the model itself" in err
