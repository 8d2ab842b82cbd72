"""kvcached_core: an elastic KV-cache allocator that publishes a live page map per model.

The public face. Engines call :class:`KVCacheManager` (plugins: :mod:`kvcached_core.engines`); tools read
segments with :func:`scan` / :func:`snapshot` and steer them through :mod:`kvcached_core.control`; settings
come from :mod:`kvcached_core.settings`. Front ends and plugins import nothing else of this package (an
import-linter contract in pyproject.toml says so). This package never imports textual, rich or click.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The reader's names load at once; the allocator's, the controller's and the GPU probe's on first use, so
# ``kvctl list`` never pays for them.
from .fleet import ModelNotFound, list_models, resolve, scan, snapshot
from .lazy import lazy_exports
from .segment.snapshot import ModelSnapshot, Problem, Scan
from .sizes import SizeError, format_bytes, parse_size, percent

if TYPE_CHECKING:
    from .allocator.manager import KVCacheManager
    from .backends import BackendError, BackendUnavailable, nvml
    from .backends.nvml import GpuInfo
    from .control.requests import Ack, AckTimeout, ControlError, request_limit, request_trim
    from .native import report as native_report
    from .segment import pagemap
    from .segment.frag import Fragmentation, fragmentation
    from .segment.layout import model_id
    from .segment.names import SEGMENT_PREFIX, InvalidName, segment_path
    from .segment.procinfo import start_time as process_start_time
    from .segment.reader import read_segment
    from .segment.writer import SegmentError

__version__ = "0.1.0"

_EXPORTS = {  # public name -> the module (under this package) that defines it
    "BackendError": "backends", "BackendUnavailable": "backends", "GpuInfo": "backends.nvml",
    "Ack": "control.requests", "AckTimeout": "control.requests", "ControlError": "control.requests",
    "request_limit": "control.requests", "request_trim": "control.requests",
    "Fragmentation": "segment.frag", "fragmentation": "segment.frag",
    "KVCacheManager": "allocator.manager", "InvalidName": "segment.names", "SegmentError": "segment.writer",
    "SEGMENT_PREFIX": "segment.names", "segment_path": "segment.names", "model_id": "segment.layout",
    "process_start_time": "segment.procinfo:start_time", "read_segment": "segment.reader",
    "native_report": "native:report",  # which native (C) paths are active, and why not
}
_MODULES = {  # public name -> a module offered whole
    "pagemap": "segment.pagemap",  # the page map's cells and states, as kvctl show and kvtop draw them
    "nvml": "backends.nvml",  # the GPUs as NVML reports them (probe, available, unavailable_reason)
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _MODULES, globals())

__all__ = [
    "SEGMENT_PREFIX", "Ack", "AckTimeout", "BackendError", "BackendUnavailable", "ControlError", "Fragmentation",
    "GpuInfo", "InvalidName", "KVCacheManager", "ModelNotFound", "ModelSnapshot", "Problem", "Scan",
    "SegmentError", "SizeError", "__version__", "format_bytes", "fragmentation", "list_models", "model_id",
    "native_report", "nvml", "pagemap", "parse_size", "percent", "process_start_time", "read_segment", "request_limit",
    "request_trim", "resolve", "scan", "segment_path", "snapshot",
]
