"""Compile a small C source once per machine into a cache directory, for the optional native paths.

Used by :mod:`kvcached_core.fastpath` (the alloc path, a CPython extension) and
:mod:`kvcached_core.backends.cuda_native` (the CUDA map loop, loaded with ctypes, and the CPython
extension that calls it). The output is
named by a hash of the source, the compiler and the flags, so an edited source rebuilds and
concurrent builders agree on one file (written under a temporary name, then renamed).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import stat
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcached"


def _trusted(path: Path, kind: int) -> bool:
    """Ours, of the expected kind, and writable by nobody else: we load code from here."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & 0o022


def compile_c(source: str, stem: str, *, suffix: str = ".so", flags: tuple[str, ...] = ()) -> tuple[Path | None, str]:
    """The shared object built from ``source`` (cached), or None and one line saying why not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    digest = hashlib.sha256("\0".join((source, platform.machine(), cc, *flags)).encode()).hexdigest()[:16]
    for directory in (cache_dir(), Path(tempfile.gettempdir()) / f"kvcached-{os.getuid()}"):
        target = directory / f"{stem}-{digest}{suffix}"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if not _trusted(directory, stat.S_IFDIR):
            continue  # someone else's, or writable by others (a shared /tmp): never load code from it
        if target.exists():
            if _trusted(target, stat.S_IFREG):
                return target, ""
            continue
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}-", suffix=".c")
        except OSError:
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(source)
        out = tmp[:-2] + suffix
        try:
            done = subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags, "-o", out, tmp], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                return None, f"{cc} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
            os.replace(out, target)  # atomic: concurrent builders agree on one file
            return target, ""
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"{cc} failed: {exc}"
        finally:
            for leftover in (tmp, out):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    return None, "no private, writable cache directory for the native helper (~/.cache/kvcached or $TMPDIR)"


def build_extension(source: str, module: str, extra_flags: tuple[str, ...] = ()) -> tuple[ModuleType | None, str]:
    """Build (or find in the cache) the CPython extension ``module`` from ``source`` and import it;
    None and one line saying why not (no headers, no compiler, a failed build)."""
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return None, f"Python's C headers are not installed (no Python.h in {include or '?'})"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path, why = compile_c(source, module, suffix=suffix, flags=(f"-I{include}", *extra_flags))
    if path is None:
        return None, why
    try:
        loader = importlib.machinery.ExtensionFileLoader(module, str(path))
        spec = importlib.util.spec_from_file_location(module, str(path), loader=loader)
        if spec is None:
            return None, f"cannot import {path}"
        loaded = importlib.util.module_from_spec(spec)
        loader.exec_module(loaded)
    except Exception as exc:  # noqa: BLE001 - whatever a broken build raises on import, the caller falls back
        return None, f"cannot import {path}: {exc}"
    return loaded, ""


__all__ = ["build_extension", "cache_dir", "compile_c"]
