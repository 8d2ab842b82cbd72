"""The native parts are built when the package is installed, loaded as ordinary extensions, and never
compiled or written at run time; an install without a compiler works and says once what it lacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, kvctl

from kvcached_core import native

HAVE_BUILD_TOOLS = bool(shutil.which("cc") or shutil.which("gcc")) and os.path.isfile(
    os.path.join(sysconfig.get_paths()["include"], "Python.h"))

MANAGER = ("from kvcached_core import KVCacheManager\n"
           "for name in ('one', 'two'):\n"
           "    m = KVCacheManager(name, num_blocks=64, block_bytes=16384, num_layers=1, page_size=131072)\n"
           "    print(m._fast is not None, m.fastpath_reason); m.close()\n")


def test_where_a_compiler_is_present_the_install_built_both_parts() -> None:
    """The README's install (gcc and Python's headers present) must not silently end up without them."""
    if not HAVE_BUILD_TOOLS:
        pytest.fail("this check needs gcc and Python's headers, which the README's test command assumes")
    for key, part in native.PARTS.items():
        module, why = native.load(key)
        assert module is not None, f"{part.module}: {why}"
        assert module.__name__ == part.module and module.__file__.endswith(sysconfig.get_config_var("EXT_SUFFIX"))


def test_nothing_is_compiled_or_written_at_run_time(tmp_path: Path) -> None:
    """A fresh process with an empty HOME and TMPDIR and no compiler on PATH runs the C path all the same."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "CC": str(tmp_path / "no-compiler"),
           "PATH": os.path.dirname(sys.executable), "KVCACHED_FASTPATH": "1"}
    env.pop("XDG_CACHE_HOME", None)
    out = subprocess.run([sys.executable, "-c", MANAGER], env=env, capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "True \nTrue \n" and out.stderr == ""
    assert list(home.iterdir()) == [] and list(tmp.iterdir()) == []


def test_a_build_older_than_its_source_is_reported_not_used(tmp_path: Path) -> None:
    """An edited checkout that was not reinstalled: the extension's recorded digest no longer matches."""
    part = native.PARTS["fastpath"]
    edited = tmp_path / "fastpath.c"
    edited.write_bytes((Path(native.__file__).parent / part.source).read_bytes() + b"/* edited */\n")
    module, why = native._import(native.Part(part.key, part.module, str(edited), part.env, part.what, part.fallback))
    assert module is None and why.startswith("built from an older fastpath.c (rebuild: pip install -e .")
    module, why = native._import(part)
    assert module is not None, why


def test_an_edited_header_of_the_c_path_makes_the_build_older_too(tmp_path: Path) -> None:
    """fastpath.c includes its parts from fastpath_c/: a build whose headers were edited since is not used (the
    digest of fastpath.c alone would not change)."""
    part = native.PARTS["fastpath"]
    source = Path(native.__file__).parent / part.source
    copy = tmp_path / source.name
    copy.write_bytes(source.read_bytes())
    shutil.copytree(source.parent / "fastpath_c", tmp_path / "fastpath_c")
    module, why = native._import(native.Part(part.key, part.module, str(copy), part.env, part.what, part.fallback))
    assert module is not None, why  # the same files: the build is current
    placement = tmp_path / "fastpath_c" / "placement.h"
    placement.write_bytes(placement.read_bytes() + b"/* edited */\n")
    module, why = native._import(native.Part(part.key, part.module, str(copy), part.env, part.what, part.fallback))
    assert module is None and why.startswith("built from an older fastpath.c (rebuild: pip install -e .")


def _wheel(tmp_path: Path, env: dict[str, str], umask: int = 0o022) -> tuple[Path, list[str]]:
    """Build the wheel from a copy of the sources under ``env`` and ``umask``; unpack it: (site, its .so files)."""
    src = tmp_path / "src"
    keep = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in ("kvcached_core", "kvtop", "plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=keep)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], env={**os.environ, "PIP_NO_INDEX": "1", **env},
                          capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("kvtop-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        return site, sorted(n for n in zf.namelist() if n.endswith(".so"))


def _wheel_without_compiler(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the sources with no C compiler anywhere, and unpack it."""
    site, built = _wheel(tmp_path, {"CC": str(tmp_path / "no-compiler"), "LDSHARED": str(tmp_path / "no-compiler")})
    assert not built, "a compiled part without a compiler?"
    return site


# Only the unpacked wheel: an editable install of this checkout resolves the package's modules itself.
ONLY_WHEEL = ("import sys\n"
              "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
              "import kvcached_core; assert kvcached_core.__file__.startswith(sys.path[1]), kvcached_core.__file__\n")


@pytest.mark.slow
def test_an_install_without_a_compiler_works_and_says_so_once(tmp_path: Path) -> None:
    site = _wheel_without_compiler(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site), "KVCACHED_FASTPATH": "auto"}
    code = ONLY_WHEEL + MANAGER
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    reason = "not built when the package was installed (no C compiler or Python headers then; rebuild: "
    assert out.stdout.splitlines() == [f"False {reason}{native.REBUILD})"] * 2
    assert out.stderr.splitlines() == [f"kvcached: the C alloc path is unavailable: {reason}{native.REBUILD}); "
                                       "alloc and free run in Python"], "one line, once per process"
    env["KVCACHED_FASTPATH"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 1 and "KVCACHED_FASTPATH=1 but the C alloc path is unavailable: not built" in out.stderr
    env["KVCACHED_FASTPATH"] = "auto"
    code = ONLY_WHEEL + "from kvtop.cli import main\nsys.argv = ['kvctl', '--version', '--verbose']\nmain()\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == [f"the C alloc path: off ({reason}{native.REBUILD}))",
                                           f"the CUDA map loop: off ({reason}{native.REBUILD}))"]


def test_kvctl_version_verbose_shows_which_paths_are_active(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = kvctl("--version")
    assert plain.exit_code == 0 and plain.stdout.splitlines() == [plain.stdout.split("\n")[0]]
    for args in (("--version", "--verbose"), ("--verbose", "-V")):
        result = kvctl(*args)
        assert result.exit_code == 0, result.stderr
        assert result.stdout.splitlines()[1:] == ["the C alloc path: active", "the CUDA map loop: active"]
    monkeypatch.setenv("KVCACHED_FASTPATH", "0")
    result = kvctl("--version", "--verbose")
    assert result.stdout.splitlines()[1] == "the C alloc path: off (KVCACHED_FASTPATH=0)"


def test_under_umask_002_the_c_path_serves_every_run(tmp_path: Path) -> None:
    """Ubuntu's default umask for users: a run-time build used to come out group-writable and be refused
    from the third run on; an installed extension is imported the same way every time."""
    env = {**os.environ, "KVCACHED_FASTPATH": "1", "HOME": str(tmp_path)}
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", MANAGER], env=env, capture_output=True, text=True, timeout=60,
                             cwd=ROOT, preexec_fn=lambda: os.umask(0o002))
        assert out.returncode == 0, out.stderr
        assert out.stdout == "True \nTrue \n" and out.stderr == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cc_with_a_launcher_builds_both_parts_under_umask_002(tmp_path: Path) -> None:
    """``CC="ccache gcc"``: a compiler command with a launcher in front is split, not taken as one name.
    A launcher script stands for ccache (it logs and runs the rest of its command line)."""
    if not HAVE_BUILD_TOOLS:
        pytest.fail("this check needs gcc and Python's headers, which the README's test command assumes")
    log = tmp_path / "launched"
    launcher = tmp_path / "launcher"
    launcher.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec "$@"\n')
    launcher.chmod(0o755)
    site, built = _wheel(tmp_path, {"CC": f"{launcher} gcc"}, umask=0o002)
    assert sorted(Path(n).name.split(".")[0] for n in built) == ["_cuda_native", "_fastpath"]
    launched = log.read_text()
    assert "fastpath.c" in launched and "cuda_native.c" in launched, launched
    code = ONLY_WHEEL + "from kvtop.cli import main\nsys.argv = ['kvctl', '--version', '--verbose']\nmain()\n"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == ["the C alloc path: active", "the CUDA map loop: active"]
