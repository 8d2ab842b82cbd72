"""The test suite cleans up after itself: a run leaves no folder in the system's temporary directory.

Tests that need a short path (a Unix socket's, at most 107 bytes) make their own folder there instead of
pytest's ``tmp_path``; each must be removed when its test ends. Run in a child pytest with ``TMPDIR`` pointed
at an empty folder, so what a run leaves there is seen and nothing else's files are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT, child_env


def test_the_vllm_worker_side_tests_leave_no_folder_in_tmp(tmp_path: Path) -> None:
    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pytest"),
         "-k", "not cuda", "tests/test_vllm_worker_side.py"],
        cwd=ROOT, env=child_env({"TMPDIR": str(system_tmp)}), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout
    assert sorted(p.name for p in system_tmp.iterdir()) == []
