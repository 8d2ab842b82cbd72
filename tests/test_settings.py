"""The one Settings object: declared once, parsed once, every bad value refused on its own."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached_core import settings as S
from kvcached_core.settings import ConfigError, Settings, settings

ROOT = Path(__file__).resolve().parent.parent
PROJECT_VAR = re.compile(r"^(?:KVCACHED_|KVCTL_|ENABLE_KVCACHED$)")

# variable, a value it refuses, the field that refuses it, words the error says
BAD = [
    ("KVCACHED_PAGE_SIZE_MB", "3", "page_size_bytes", "positive multiple of 2"),
    ("KVCACHED_PAGE_SIZE_MB", "big", "page_size_bytes", "is not an integer"),
    ("KVCACHED_MIN_RESERVED_PAGES", "-1", "reserve", "reserve bounds"),
    ("KVCACHED_MAX_RESERVED_PAGES", "x", "reserve", "is not an integer"),
    ("KVCACHED_MAX_CACHED_TOKENS", "lots", "max_cached_tokens", "is not an integer"),
    ("KVCACHED_MAX_CACHED_BLOCKS", "1.5", "max_cached_blocks", "is not an integer"),
    ("KVCACHED_HOST_CAPACITY", "plenty", "host_capacity_bytes", "KVCACHED_HOST_CAPACITY:"),
    ("KVCACHED_POLICY", "random", "policy", "unknown placement policy"),
    ("KVCACHED_IDLE_RETURN_S", "soon", "idle_return_s", "is not a number"),
    ("KVCACHED_CUDA_LAYOUT", "diagonal", "cuda_layout", "is not a layout"),
    ("KVCACHED_CUDA_POOL_PAGES", "-2", "cuda_pool_pages", "cannot be negative"),
    ("KVCACHED_CUDA_ASYNC_UNMAP", "maybe", "cuda_async_unmap", "is not a boolean"),
    ("KVCACHED_CUDA_UNMAP_DELAY_MS", "99999", "cuda_unmap_delay_s", "between 0 and 60000"),
    ("KVCACHED_CUDA_NATIVE", "2", "cuda_native", "must be auto, 1 or 0"),
    ("KVCACHED_FASTPATH", "fast", "fastpath", "must be auto, 1 or 0"),
    ("KVCACHED_TP_STRATEGY", "random", "tp_strategy", "choose one of sequential, concurrent"),
    ("KVCACHED_TP_TIMEOUT_S", "0", "tp_timeout_s", "must be positive"),
    ("ENABLE_KVCACHED", "perhaps", "enable_kvcached", "use true or false"),
]


@pytest.mark.parametrize(("name", "bad", "field", "words"), BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_a_bad_value_is_one_config_error_on_its_own_field(name, bad, field, words):
    parsed = Settings.from_env({name: bad})
    with pytest.raises(ConfigError) as caught:
        getattr(parsed, field)
    message = str(caught.value)
    assert name in message and words in message and "\n" not in message
    assert isinstance(caught.value, ValueError)
    assert "refused" in repr(parsed)  # the object still shows itself
    others = [f for _, _, f, _ in BAD if f != field and not (field == "reserve" and f == "cuda_pool_pages")]
    for other in others:
        getattr(parsed, other)  # every other setting still reads


def test_every_declared_variable_has_a_parsed_setting_and_defaults_parse():
    parsed = Settings.from_env({})
    assert parsed.page_size_bytes == 2 * S.MiB and parsed.reserve == S.ReserveBounds(5, 10)
    assert parsed.cuda_pool_pages == parsed.reserve.max_pages and parsed.ipc_name is None
    assert parsed.given == frozenset()
    read = set()
    source = Path(S.__file__).read_text()
    for var in S.VARIABLES:
        assert source.count(f'"{var.name}"') >= 2, f"{var.name} is declared but no parser reads it"
        read.add(var.name)
    assert len(read) == len(S.VARIABLES)


def test_settings_are_parsed_once_until_a_variable_changes(monkeypatch):
    monkeypatch.delenv("KVCACHED_PAGE_SIZE_MB", raising=False)
    first = settings()
    assert settings() is first
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "4")
    changed = settings()
    assert changed is not first and changed.page_size_bytes == 4 * S.MiB
    assert "KVCACHED_PAGE_SIZE_MB" in changed.given
    monkeypatch.setenv("UNRELATED_VARIABLE_FOR_THIS_TEST", "1")
    assert settings() is changed
    monkeypatch.delenv("KVCACHED_PAGE_SIZE_MB")
    assert settings().page_size_bytes == 2 * S.MiB


def test_the_environment_reference_is_the_generated_table():
    docs = (ROOT / "docs" / "environment.md").read_text()
    table = S.markdown_table()
    assert table in docs, ("docs/environment.md differs from the declared settings: "
                           "regenerate its table with `python -m kvcached_core.settings`")
    out = subprocess.run([sys.executable, "-m", "kvcached_core.settings"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out == table
    for var in S.VARIABLES:
        assert f"| `{var.name}` | {var.default_text} |" in docs


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of every os.environ / os.getenv read by key; key '?' when it is not a literal."""
    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    def key(node: ast.AST | None) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if (func.attr in ("get", "pop", "setdefault") and is_environ(func.value)) or (
                    func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os"):
                found.append((node.lineno, key(node.args[0] if node.args else None)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv":
            found.append((node.lineno, key(node.args[0] if node.args else None)))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            found.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.append((node.lineno, key(node.left)))
    return found


def test_no_module_but_settings_reads_the_projects_variables():
    offenders = []
    for top in ("kvcached_core", "kvtop", "plugins"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == Path(S.__file__).resolve() or "build" in path.relative_to(ROOT).parts:
                continue
            for line, name in _environment_reads(ast.parse(path.read_text(), str(path))):
                if name == "?" or PROJECT_VAR.match(name):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    assert not offenders, "read these through kvcached_core.settings: " + "; ".join(offenders)


def test_the_environment_check_sees_each_way_of_reading():
    source = "\n".join([
        'import os', 'from os import environ, getenv',
        'os.environ.get("KVCACHED_A")', 'os.getenv("KVCACHED_B")', 'os.environ["KVCACHED_C"]',
        'environ.get(name)', '"KVCACHED_D" in os.environ', 'getenv("ENABLE_KVCACHED")',
        'os.environ.get("TERM")',
    ])
    found = _environment_reads(ast.parse(source))
    assert sorted(k for _, k in found) == sorted(
        ["KVCACHED_A", "KVCACHED_B", "KVCACHED_C", "?", "KVCACHED_D", "ENABLE_KVCACHED", "TERM"])


def test_kvctl_refuses_a_bad_value_it_uses_in_one_line_and_runs_without_one_it_does_not(tmp_path):
    env = {**os.environ, "KVCACHED_SHM_DIR": str(tmp_path), "KVCACHED_PAGE_SIZE_MB": "3"}
    listed = subprocess.run([sys.executable, "-m", "kvtop.cli", "list", "--json"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr == ""


@pytest.mark.parametrize(("name", "bad"), [("KVCACHED_PAGE_SIZE_MB", "3"), ("KVCACHED_POLICY", "random"),
                                           ("KVCACHED_MAX_RESERVED_PAGES", "-1")])
def test_an_allocator_refuses_a_bad_value_before_it_creates_anything(tmp_path, monkeypatch, name, bad):
    from kvcached_core import KVCacheManager

    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    monkeypatch.setenv(name, bad)
    with pytest.raises(ConfigError, match=name):
        KVCacheManager("settings-bad", num_blocks=64, block_bytes=4096, num_layers=2)
    assert list(tmp_path.iterdir()) == []
