"""Segment names and paths: validated, never a path component."""

from __future__ import annotations

import re
from pathlib import Path

from ..settings import settings

SEGMENT_PREFIX = "kvc."
LEGACY_PREFIX = "kvcached_"
MAX_NAME = 64
_VALID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_INVALID_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


class InvalidName(ValueError):
    """A model or segment name we refuse."""


def sanitize(name: str) -> str:
    """Turn any model name (``meta-llama/Llama-3-8B``) into a segment name (``meta-llama_Llama-3-8B``)."""
    cleaned = _INVALID_CHARS.sub("_", name).strip("_")[:MAX_NAME]
    return cleaned or "model"


def validate(name: str) -> str:
    """Accept exactly ``[A-Za-z0-9_-]{1,64}``; anything else raises :class:`InvalidName`."""
    if not isinstance(name, str) or not _VALID.fullmatch(name):  # match() lets '$' accept a final newline
        raise InvalidName(
            f"invalid segment name {name!r}: use 1-{MAX_NAME} characters from A-Z a-z 0-9 _ -"
        )
    return name


def segment_path(name: str, directory: Path | None = None) -> Path:
    return (directory or settings().shm_dir) / (SEGMENT_PREFIX + validate(name))
