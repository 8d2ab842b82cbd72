"""Settings by topic, from :func:`kvcached_core.settings.settings` (declared and parsed there)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .settings import ConfigError as ConfigError
from .settings import MiB as MiB
from .settings import ReserveBounds as ReserveBounds
from .settings import settings


def shm_dir() -> Path:
    """Where segments live: ``KVCACHED_SHM_DIR`` or /dev/shm."""
    return settings().shm_dir


def shm_dir_problem(directory: Path | None = None, *, writable: bool = False) -> str | None:
    """Why the segment directory cannot be used, as one line (None when it can).

    A missing directory would otherwise read as an empty fleet; ``writable`` also asks that
    allocators could create segments there.
    """
    path = directory or shm_dir()
    named = f"KVCACHED_SHM_DIR={path}" if directory is None and "KVCACHED_SHM_DIR" in settings().given else str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"segment directory {named} does not exist"
    except OSError as exc:
        return f"segment directory {named}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"segment directory {named} is not a directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"segment directory {named} cannot be read (permission denied)"
    if writable and not os.access(path, os.W_OK | os.X_OK):
        return f"segment directory {named} is not writable: allocators cannot create segments there"
    return None


def page_size_bytes() -> int:
    return settings().page_size_bytes


def reserve_bounds() -> ReserveBounds:
    return settings().reserve


def max_cached_blocks(block_tokens: int) -> int | None:
    """Prefix-cache budget in blocks; None means unlimited, 0 means the cache is off."""
    blocks = settings().max_cached_blocks
    if blocks is not None:
        return None if blocks < 0 else blocks
    tokens = settings().max_cached_tokens
    if tokens < 0:
        return None
    if tokens == 0:
        return 0
    return max(1, tokens // max(1, block_tokens))


def host_capacity_bytes() -> int:
    """Host backend capacity shared by every model: ``KVCACHED_HOST_CAPACITY`` or half of RAM."""
    return settings().host_capacity_bytes


def tristate_env(name: str) -> str:
    """``auto``, ``on`` or ``off`` for a native part's variable (``KVCACHED_FASTPATH``, ``KVCACHED_CUDA_NATIVE``)."""
    return settings().mode(name)


def idle_return_s() -> float | None:
    """Seconds without traffic after which a model unmaps its warm pool (``KVCACHED_IDLE_RETURN_S``, default 10; < 0 never)."""
    return settings().idle_return_s


def ipc_name_override() -> str | None:
    return settings().ipc_name
