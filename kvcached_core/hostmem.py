"""This host's memory as the kernel reports it: the total the host backend's default budget is a share of,
and what is available now (the ledger's check before it claims)."""

from __future__ import annotations

import os


def _meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes; 0 where the file or the field is missing."""
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
