"""Byte sizes: parse operator input (``512MiB``, ``4G``, ``30%``, ``none``) and format for people."""

from __future__ import annotations

import re
from decimal import Decimal

from .bounds import MAX_LIMIT_BYTES

_UNITS = {
    "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
NONE_WORDS = frozenset({"none", "unlimited", "off"})


class SizeError(ValueError):
    """A size string that cannot be understood; the message says why."""


def parse_size(text: str, *, percent_of: int | None = None, allow_none: bool = False) -> int | None:
    """Parse ``text`` into bytes.

    Binary units for bare letters (``4G`` = 4 GiB), SI for ``GB``; a number needs a unit (``4B``
    for bytes: a bare ``4`` is refused); ``30%`` needs ``percent_of`` and must lie in (0, 100];
    ``none`` (with ``allow_none``) returns None. A refusal suggests only forms this call accepts.
    """
    if not isinstance(text, str) or not text.strip():
        raise SizeError("empty size")
    raw = text.strip()
    if raw.lower() in NONE_WORDS:
        if allow_none:
            return None
        raise SizeError(f"{raw!r} is not a size here")
    match = _PERCENT_RE.match(raw)
    if match:
        if percent_of is None:
            raise SizeError(f"{raw!r}: a percentage needs a known total")
        pct = float(match.group(1))
        if not 0 < pct <= 100:
            raise SizeError(f"{raw!r}: a percentage must be above 0 and at most 100")
        return int(percent_of * pct / 100)
    if raw.startswith("-"):
        raise SizeError(f"{raw!r}: a size cannot be negative")
    match = _SIZE_RE.match(raw)
    if not match:
        raise SizeError(f"{raw!r} is not a size (try {_accepted(percent_of is not None, allow_none)})")
    number, unit = match.groups()
    if not unit:  # a bare number is a forgotten unit far more often than a byte count
        in_bytes = f"; {raw}B for bytes" if number.isdigit() else ""
        raise SizeError(f"{raw} what? {raw}GiB, {raw}MiB{in_bytes}")
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise SizeError(f"{raw!r}: unknown unit {unit!r} (use B, K, M, G, T, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    value = int(Decimal(number) * factor)  # exact: a float would turn 2^63-1 bytes into 2^63
    if value > MAX_LIMIT_BYTES:
        raise SizeError(f"{raw!r} is beyond the largest size a segment holds (2^63-1 bytes, 8 EiB)")
    return value


def _accepted(percent: bool, none: bool) -> str:
    """Examples of the forms a call of :func:`parse_size` accepts: a percentage and ``none`` only where it takes them."""
    forms = ["512MiB", "4G", "1.5GiB", *(["30%"] if percent else []), *(["none"] if none else [])]
    return f"{', '.join(forms[:-1])} or {forms[-1]}"


def percent(part: float, base: float | None) -> float | None:
    """``part`` as a percentage of ``base``; None when the base is unknown (None or 0).

    The one place a share becomes a percentage: every percent a front end shows (a device bar, how
    close a model is to its limit) is this of a base the core names (``ModelSnapshot.device_capacity``,
    ``control.limit_percent_base``, a device's memory total), never a ratio worked out in the UI.
    """
    if not base or base <= 0:
        return None
    return part * 100 / base


def format_bytes(n: int | float | None, *, precision: int = 1) -> str:
    """``1536 -> '1.5 KiB'``; None -> ``'-'``."""
    if n is None:
        return "-"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        shown = value if unit == "B" else round(value, precision)  # 1048575 B is 1.0 MiB, not 1024.0 KiB
        if shown < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    return f"{sign}{value:.{precision}f} TiB"
