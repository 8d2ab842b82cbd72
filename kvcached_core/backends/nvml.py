"""NVML probe: per-GPU memory figures through pynvml (nvidia-ml-py), started lazily.

Every field may be unknown (None, shown as N/A); no call here raises. Without a driver or
without the package, :func:`probe` returns an empty list and :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

_lock = threading.Lock()
_state: dict[str, object] = {"started": False, "ok": False, "reason": "not probed yet"}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str | None
    uuid: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> used bytes


def _start() -> bool:
    with _lock:
        if _state["started"]:
            return bool(_state["ok"])
        _state["started"] = True
        try:
            import pynvml  # lazy: importing costs time and may fail

            pynvml.nvmlInit()
        except ImportError:
            _state["reason"] = "nvidia-ml-py (pynvml) is not installed"
            return False
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            _state["reason"] = f"NVML unavailable: {exc}"
            return False
        _state["ok"] = True
        _state["reason"] = ""
        return True


def available() -> bool:
    return _start()


def unavailable_reason() -> str:
    _start()
    return str(_state["reason"])


def _try(fn, *args):
    try:
        value = fn(*args)
    except Exception:  # noqa: BLE001 - any NVML field may be N/A
        return None
    return value.decode() if isinstance(value, bytes) else value


def probe(indices: list[int] | None = None) -> list[GpuInfo]:
    """One GpuInfo per GPU (or per index asked for); [] without NVML."""
    if not _start():
        return []
    import pynvml

    count = _try(pynvml.nvmlDeviceGetCount) or 0
    result = []
    for index in range(count):
        if indices is not None and index not in indices:
            continue
        handle = _try(pynvml.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            result.append(GpuInfo(index, None, None, None, None, None))
            continue
        mem = _try(pynvml.nvmlDeviceGetMemoryInfo, handle)
        procs: dict[int, int | None] = {}
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            for proc in _try(getattr(pynvml, getter, lambda _h: []), handle) or []:
                used = getattr(proc, "usedGpuMemory", None)
                procs[int(proc.pid)] = used if isinstance(used, int) and used >= 0 else None
        result.append(GpuInfo(
            index=index,
            name=_try(pynvml.nvmlDeviceGetName, handle),
            uuid=_try(pynvml.nvmlDeviceGetUUID, handle),
            total_bytes=getattr(mem, "total", None),
            used_bytes=getattr(mem, "used", None),
            free_bytes=getattr(mem, "free", None),
            processes=procs,
        ))
    return result
