"""The optional native parts: extension modules built when the package is installed (``setup.py``).

Nothing is compiled or written at run time: a part is an ordinary import. Without it (no C compiler
or Python headers at install time, or a build older than its source in an edited checkout) the
Python path serves, and :func:`say_unavailable` says so once per process, in one log line with the
reason. :func:`report` tells which paths are active (``kvctl --version --verbose``).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .settings import ConfigError, settings

log = logging.getLogger("kvcached_core")

REBUILD = "pip install -e . with gcc and Python's headers present"


@dataclass(frozen=True)
class Part:
    key: str
    module: str  # the extension's import name
    source: str  # its C source, relative to this package
    env: str  # auto (default), 1 (required) or 0 (never)
    what: str  # what it speeds up, for messages
    fallback: str  # what serves without it


PARTS = {
    "fastpath": Part("fastpath", "kvcached_core.allocator._fastpath", "allocator/fastpath.c", "KVCACHED_FASTPATH", "the C alloc path",
                     "alloc and free run in Python"),
    "cuda": Part("cuda", "kvcached_core.backends._cuda_native", "backends/cuda_native.c", "KVCACHED_CUDA_NATIVE",
                 "the CUDA map loop", "the CUDA backend calls the driver through cuda-python"),
}

_loaded: dict[str, tuple[ModuleType | None, str]] = {}
_said: set[str] = set()
_lock = threading.Lock()


def load(key: str) -> tuple[ModuleType | None, str]:
    """The part's extension module, or None and one phrase saying why not (imported once per process)."""
    with _lock:
        if key not in _loaded:
            _loaded[key] = _import(PARTS[key])
        return _loaded[key]


def _import(part: Part) -> tuple[ModuleType | None, str]:
    try:
        module = importlib.import_module(part.module)
    except ModuleNotFoundError as exc:
        if exc.name != part.module:
            return None, f"cannot import {part.module}: {exc}"
        return None, f"not built when the package was installed (no C compiler or Python headers then; rebuild: {REBUILD})"
    except ImportError as exc:  # a build for another interpreter, a missing symbol
        return None, f"cannot load {part.module}: {exc}"
    source = Path(__file__).parent / part.source
    # a checkout (installed packages carry no sources): the build must match it
    if source.is_file() and getattr(module, "SOURCE_DIGEST", None) != source_digest(source):
        return None, f"built from an older {source.name} (rebuild: {REBUILD})"
    return module, ""


def source_digest(source: Path) -> str:
    """What setup.py records in a build: the digest of ``source`` and of the headers it includes from
    ``<stem>_c/`` beside it (sorted), so an edit to any of them shows the build is older."""
    digest = hashlib.sha256()
    for path in [source, *sorted(source.parent.joinpath(source.stem + "_c").glob("*.h"))]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def say_unavailable(key: str, why: str) -> None:
    """One log line per process and part: it is unavailable, why, and what serves instead."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    part = PARTS[key]
    log.warning("kvcached: %s is unavailable: %s; %s", part.what, why, part.fallback)


def report() -> list[tuple[str, bool, str]]:
    """(what, active, why not) for every part under this environment, as ``kvctl --version --verbose``
    shows them (the fast path serves some policies only: :mod:`kvcached_core.allocator.fastpath`)."""
    rows = []
    for part in PARTS.values():
        try:
            mode = settings().mode(part.env)
        except ConfigError as exc:
            rows.append((part.what, False, str(exc)))
            continue
        module, why = (None, f"{part.env}=0") if mode == "off" else load(part.key)
        rows.append((part.what, module is not None, why))
    return rows


__all__ = ["PARTS", "load", "report", "say_unavailable"]
