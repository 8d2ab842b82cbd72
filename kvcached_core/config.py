"""Environment settings, read once per call so tests can change them."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .sizes import SizeError, parse_size

MiB = 1024 * 1024
DEFAULT_PAGE_SIZE_MB = 2
DEFAULT_MIN_RESERVED = 5
DEFAULT_MAX_RESERVED = 10
DEFAULT_MAX_CACHED_TOKENS = 16000
HOST_CAPACITY_FRACTION = 0.5
DEFAULT_IDLE_RETURN_S = 10.0


class ConfigError(ValueError):
    """An environment variable holds a value we cannot use."""


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def shm_dir() -> Path:
    """Where segments live: ``KVCACHED_SHM_DIR`` or /dev/shm."""
    return Path(os.environ.get("KVCACHED_SHM_DIR") or "/dev/shm")


def shm_dir_problem(directory: Path | None = None, *, writable: bool = False) -> str | None:
    """Why the segment directory cannot be used, as one line (None when it can).

    A missing directory would otherwise read as an empty fleet; ``writable`` also asks that
    allocators could create segments there.
    """
    path = directory or shm_dir()
    named = f"KVCACHED_SHM_DIR={path}" if directory is None and os.environ.get("KVCACHED_SHM_DIR") else str(path)
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
    mb = _int_env("KVCACHED_PAGE_SIZE_MB", DEFAULT_PAGE_SIZE_MB)
    if mb <= 0 or mb % 2:
        raise ConfigError(f"KVCACHED_PAGE_SIZE_MB={mb} must be a positive multiple of 2")
    return mb * MiB


@dataclass(frozen=True)
class ReserveBounds:
    min_pages: int
    max_pages: int


def reserve_bounds() -> ReserveBounds:
    lo = _int_env("KVCACHED_MIN_RESERVED_PAGES", DEFAULT_MIN_RESERVED)
    hi = _int_env("KVCACHED_MAX_RESERVED_PAGES", DEFAULT_MAX_RESERVED)
    if lo < 0 or hi < lo:
        raise ConfigError(
            f"reserve bounds need 0 <= KVCACHED_MIN_RESERVED_PAGES ({lo}) <= KVCACHED_MAX_RESERVED_PAGES ({hi})"
        )
    return ReserveBounds(lo, hi)


def max_cached_blocks(block_tokens: int) -> int | None:
    """Prefix-cache budget in blocks; None means unlimited, 0 means the cache is off."""
    if os.environ.get("KVCACHED_MAX_CACHED_BLOCKS", "").strip():
        blocks = _int_env("KVCACHED_MAX_CACHED_BLOCKS", 0)
        return None if blocks < 0 else blocks
    tokens = _int_env("KVCACHED_MAX_CACHED_TOKENS", DEFAULT_MAX_CACHED_TOKENS)
    if tokens < 0:
        return None
    if tokens == 0:
        return 0
    return max(1, tokens // max(1, block_tokens))


def host_capacity_bytes() -> int:
    """Host backend capacity shared by every model: ``KVCACHED_HOST_CAPACITY`` or half of RAM."""
    raw = os.environ.get("KVCACHED_HOST_CAPACITY")
    if raw:
        try:
            value = parse_size(raw, percent_of=total_ram_bytes())
        except SizeError as exc:
            raise ConfigError(f"KVCACHED_HOST_CAPACITY: {exc}") from None
        assert value is not None
        return value
    return int(total_ram_bytes() * HOST_CAPACITY_FRACTION)


def _meminfo(field: str) -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def total_ram_bytes() -> int:
    return _meminfo("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    return _meminfo("MemAvailable")


def float_env(name: str, default: float) -> float:
    """A number of seconds (or any float) from the environment; a clear ConfigError otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def tristate_env(name: str) -> str:
    """``auto`` (unset too), ``on`` (1/on/true/yes) or ``off`` (0/off/false/no); a ConfigError otherwise."""
    raw = os.environ.get(name, "").strip().lower() or "auto"
    table = {"auto": "auto", "1": "on", "on": "on", "true": "on", "yes": "on",
             "0": "off", "off": "off", "false": "off", "no": "off"}
    if raw not in table:
        raise ConfigError(f"{name}={raw!r} must be auto, 1 or 0")
    return table[raw]


def idle_return_s() -> float | None:
    """Seconds without traffic after which a model unmaps its warm pool (``KVCACHED_IDLE_RETURN_S``, default 10; < 0 never)."""
    value = float_env("KVCACHED_IDLE_RETURN_S", DEFAULT_IDLE_RETURN_S)
    return None if value < 0 else value


def ipc_name_override() -> str | None:
    return os.environ.get("KVCACHED_IPC_NAME") or None
