"""The models on this host as one list: our segments and, beside them, public kvcached's.

:mod:`kvcached_core.segment.reader` reads our segments and knows nothing of other formats; this module
hands it the public kvcached's reader (:func:`kvcached_core.interop.legacy.upstream_row`) for the other
files of the directory. Front ends read through here (``kvcached_core.scan``, ``list_models``,
``snapshot``); an allocator looking for its peers reads our segments alone.
"""

from __future__ import annotations

from pathlib import Path

from .interop.legacy import upstream_row
from .segment import reader
from .segment.reader import ModelNotFound, resolve
from .segment.snapshot import ModelSnapshot, Scan


def scan(*, with_pages: bool = False, directory: Path | None = None, ours_only: bool = False) -> Scan:
    """Every model in the directory (ours and upstream rows), plus a Problem for each file we could not use;
    ``ours_only``: our segments alone (the public kvcached's files are not read)."""
    return reader.scan(with_pages=with_pages, directory=directory, foreign=None if ours_only else upstream_row)


def list_models(*, with_pages: bool = False, directory: Path | None = None) -> list[ModelSnapshot]:
    """Snapshots of every model; files that are not usable segments are skipped (see :func:`scan`)."""
    return reader.list_models(with_pages=with_pages, directory=directory, foreign=upstream_row)


def snapshot(name: str, *, with_pages: bool = True, directory: Path | None = None) -> ModelSnapshot:
    """One model by name or unique prefix, with its page map (an upstream row has none)."""
    return reader.snapshot(name, with_pages=with_pages, directory=directory, foreign=upstream_row)


__all__ = ["ModelNotFound", "list_models", "resolve", "scan", "snapshot"]
