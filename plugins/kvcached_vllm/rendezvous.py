"""Where the scheduler (EngineCore) finds the worker that holds each rank's KV memory.

Both sides know the engine's ``instance_id`` (it travels inside the vLLM config), so the
socket path is derived from it; no environment variable has to cross process boundaries.
Sockets live in an owner-only directory of this user's.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from kvcached_core.engines import sanitize

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def socket_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvcached`` (or ``<tmp>/kvcached-<uid>``), created 0700; refused if not ours."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvcached" if runtime else Path(tempfile.gettempdir()) / f"kvcached-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{base} is not a private directory of this user's (mode {stat.filemode(st.st_mode)}, "
                           f"uid {st.st_uid}): remove it or set XDG_RUNTIME_DIR")
    return base


def socket_paths(instance_id: str, world: int) -> list[str]:
    """One Unix socket path per rank of the engine ``instance_id``."""
    base = socket_dir()
    tag = sanitize(instance_id)[:32]
    paths = [str(base / f"vllm-{tag}.rank{rank}.sock") for rank in range(world)]
    too_long = [p for p in paths if len(os.fsencode(p)) > MAX_SOCKET_PATH]
    if too_long:
        raise RuntimeError(f"socket path {too_long[0]} is longer than {MAX_SOCKET_PATH} bytes: "
                           "set XDG_RUNTIME_DIR to a shorter directory")
    return paths
