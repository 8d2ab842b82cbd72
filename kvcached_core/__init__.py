"""kvcached_core: an elastic KV-cache allocator that publishes a live page map per model.

Engines call :class:`KVCacheManager`; tools read segments with :func:`list_models` /
:func:`snapshot` and steer them with :func:`request_limit` / :func:`request_trim`.
This package never imports textual, rich or click.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The reader's names load at once; the allocator's and controller's on first use, so ``kvctl list``
# never pays for them.
from .fleet import ModelNotFound, list_models, resolve, scan, snapshot
from .segment.snapshot import ModelSnapshot, Problem, Scan
from .sizes import SizeError, format_bytes, parse_size

if TYPE_CHECKING:
    from .allocator.manager import KVCacheManager
    from .backends import BackendError, BackendUnavailable
    from .control.requests import Ack, AckTimeout, ControlError, request_limit, request_trim
    from .segment.frag import Fragmentation, fragmentation
    from .segment.names import InvalidName
    from .segment.writer import SegmentError

__version__ = "0.1.0"

_EXPORTS = {  # public name -> the module (under this package) that defines it
    "BackendError": "backends", "BackendUnavailable": "backends",
    "Ack": "control.requests", "AckTimeout": "control.requests", "ControlError": "control.requests",
    "request_limit": "control.requests", "request_trim": "control.requests",
    "Fragmentation": "segment.frag", "fragmentation": "segment.frag",
    "KVCacheManager": "allocator.manager", "InvalidName": "segment.names", "SegmentError": "segment.writer",
}


def __getattr__(name: str):  # PEP 562 lazy attributes
    module = _EXPORTS.get(name)
    if module is None:
        try:  # kvcached_core.<submodule> without importing it first, as the eager package allowed
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

__all__ = [
    "Ack", "AckTimeout", "BackendError", "BackendUnavailable", "ControlError", "Fragmentation",
    "InvalidName", "KVCacheManager", "ModelNotFound", "ModelSnapshot", "Problem", "Scan",
    "SegmentError", "SizeError", "format_bytes", "fragmentation", "list_models", "parse_size",
    "request_limit", "request_trim", "resolve", "scan", "snapshot", "__version__",
]
