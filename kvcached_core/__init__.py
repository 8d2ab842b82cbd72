"""kvcached_core: an elastic KV-cache allocator that publishes a live page map per model.

Engines call :class:`KVCacheManager`; tools read segments with :func:`list_models` /
:func:`snapshot` and steer them with :func:`request_limit` / :func:`request_trim`.
This package never imports textual, rich or click.
"""

from __future__ import annotations

from .backends import BackendError, BackendUnavailable
from .control import Ack, AckTimeout, ControlError, request_limit, request_trim
from .frag import Fragmentation, fragmentation
from .manager import KVCacheManager
from .names import InvalidName
from .reader import ModelNotFound, list_models, resolve, scan, snapshot
from .segment import SegmentError
from .sizes import SizeError, format_bytes, parse_size
from .snapshot import ModelSnapshot, Problem, Scan

__version__ = "0.1.0"

__all__ = [
    "Ack", "AckTimeout", "BackendError", "BackendUnavailable", "ControlError", "Fragmentation",
    "InvalidName", "KVCacheManager", "ModelNotFound", "ModelSnapshot", "Problem", "Scan",
    "SegmentError", "SizeError", "format_bytes", "fragmentation", "list_models", "parse_size",
    "request_limit", "request_trim", "resolve", "scan", "snapshot", "__version__",
]
