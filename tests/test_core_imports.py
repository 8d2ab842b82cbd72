"""kvcached_core is what engines import: it must never pull in the UI stack."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import child_env

UI = ("textual", "rich", "click")
LOADED_UI = f"sorted(m for m in sys.modules if m.split('.')[0] in {UI!r})"

PROBE = f"""
import importlib, json, pkgutil, sys
import kvcached_core
names = ["kvcached_core"]
for info in pkgutil.walk_packages(kvcached_core.__path__, "kvcached_core."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
    names.append(info.name)
print(json.dumps({{"imported": names, "ui": {LOADED_UI}}}))
"""


def run_probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    return json.loads(out.stdout)


def test_importing_kvcached_core_pulls_in_no_ui_library():
    result = run_probe(f"import json, sys, kvcached_core\nprint(json.dumps({{'ui': {LOADED_UI}}}))")
    assert result["ui"] == []


def test_no_module_of_kvcached_core_pulls_in_a_ui_library():
    result = run_probe(PROBE)
    assert {"kvcached_core.allocator.manager", "kvcached_core.segment.reader", "kvcached_core.control.requests",
            "kvcached_core.backends.host"} <= set(result["imported"])
    assert result["ui"] == []


def test_the_probe_would_notice_a_ui_import():
    result = run_probe(f"import json, sys, kvcached_core, click\nprint(json.dumps({{'ui': {LOADED_UI}}}))")
    assert "click" in result["ui"]


def test_tests_take_no_logic_from_benchmarks() -> None:
    """A benchmark may be edited to measure something else; what a test checks lives in tests/
    (seqlock_stress.py, fragmentation_workload.py), and benchmarks import it from there. Only the
    test of BENCHMARKS.md itself (its headline is computed there) and the tests of a benchmark's own arithmetic
    (test_bench_*.py: what they check is the benchmark) read benchmarks/."""
    import re
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    importing = sorted(p.name for p in tests.glob("*.py")
                       if re.search(r"^\s*(from|import) benchmarks\b", p.read_text(), re.M))
    assert [name for name in importing if not name.startswith("test_bench_")] == ["test_docs_benchmarks.py"], importing


def test_the_core_holds_no_demo_and_imports_no_front_end() -> None:
    """The demo workload is a client of the allocator (kvtop/demo/fleet.py), not part of it; the core never
    reaches into kvtop (kvtop, kvctl, the exporter, the demo) or an engine plugin."""
    import ast
    from pathlib import Path

    core = Path(__file__).resolve().parents[1] / "kvcached_core"
    assert not (core / "demo.py").exists() and not (core / "__main__.py").exists()
    reaching = []
    for path in sorted(core.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            reaching += [f"{path.name}:{node.lineno} {n}" for n in names
                         if n.split(".")[0] == "kvtop" or (n.startswith("kvcached_") and n.split(".")[0] != "kvcached_core")]
    assert reaching == []
    assert "Demo" not in " ".join(dir(__import__("kvcached_core")))


FACES = ("kvcached_core", "kvcached_core.control", "kvcached_core.engines")
FACE_PROBE = """
import importlib, json, sys
face = importlib.import_module(sys.argv[1])
before = sorted(m for m in sys.modules if m.startswith("kvcached_core."))
missing = [n for n in face.__all__ if not hasattr(face, n)]
print(json.dumps({"before": before, "missing": missing, "listed": sorted(set(face.__all__) - set(dir(face)))}))
"""


def test_every_name_of_the_public_face_resolves_and_loads_on_first_use() -> None:
    """The faces front ends and plugins import (pyproject.toml's contract allows nothing else) name each
    export once in a table loaded on use: a wrong module in that table, or a name in ``__all__`` the table
    lacks, fails here; importing a face loads neither the allocator nor the controller."""
    for face in FACES:
        out = subprocess.run([sys.executable, "-c", FACE_PROBE, face], capture_output=True, text=True,
                             env=child_env(), check=True)
        result = json.loads(out.stdout)
        assert result["missing"] == [] and result["listed"] == [], (face, result)
        assert not {"kvcached_core.allocator.manager", "kvcached_core.control.requests"} & set(result["before"]), (
            face, result["before"])
