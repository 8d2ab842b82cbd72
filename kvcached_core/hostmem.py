"""This host's memory as the kernel reports it: the total the host backend's default budget is a share of,
what is available now (the ledger's check before it claims), and this process's own figures (an engine's
working memory measured on the host)."""

from __future__ import annotations

import os


def _kib_field(path: str, field: str) -> int:
    """A ``Field:  N kB`` line of a /proc file in bytes; 0 where the file or the field is missing."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def total_ram_bytes() -> int:
    return _kib_field("/proc/meminfo", "MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    return _kib_field("/proc/meminfo", "MemAvailable")


def process_bytes(field: str) -> int:
    """A memory field of this process's /proc/self/status in bytes (``VmRSS``, ``VmHWM``); 0 where missing."""
    return _kib_field("/proc/self/status", field)
