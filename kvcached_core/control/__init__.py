"""The controller's side, the one face front ends steer models through: ask a model for a limit, a trim, a
sleep, a compaction or a policy and wait for its answer; check a request before sending it; clean up what dead
processes left.

The names load on first use (:mod:`kvcached_core.lazy`); the modules below this package are its internals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from ..bounds import PRIORITY_MAX, PRIORITY_MIN
    from ..interop.legacy import NoDeviceTotal, limit_refusal
    from ..segment.removal import inode, remove_verified
    from .applied import NotApplied, wait_applied
    from .clean import Leftover, leftovers
    from .compact import compact_problem, request_compact
    from .policy import KEEP, policy_problem, request_policy
    from .requests import Ack, AckTimeout, ControlError, limit_percent_base, request_limit, request_trim
    from .sleep import after_idle_ms, request_sleep, sleep_problem

_EXPORTS = {
    "Ack": "requests", "AckTimeout": "requests", "ControlError": "requests",
    "request_limit": "requests", "request_trim": "requests",
    "limit_percent_base": "requests",
    "NotApplied": "applied", "wait_applied": "applied",
    "compact_problem": "compact", "request_compact": "compact",
    "KEEP": "policy", "policy_problem": "policy", "request_policy": "policy",
    "after_idle_ms": "sleep", "request_sleep": "sleep", "sleep_problem": "sleep",
    "Leftover": "clean", "leftovers": "clean",
    "PRIORITY_MAX": ".bounds", "PRIORITY_MIN": ".bounds",
    "NoDeviceTotal": ".interop.legacy", "limit_refusal": ".interop.legacy",
    # the verified delete (the inode checked, never a path) for front ends that remove files of their own
    "inode": ".segment.removal", "remove_verified": ".segment.removal",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, None, globals())

__all__ = [
    "KEEP", "PRIORITY_MAX", "PRIORITY_MIN", "Ack", "AckTimeout", "ControlError", "Leftover", "NoDeviceTotal",
    "NotApplied", "after_idle_ms", "compact_problem", "inode", "leftovers", "limit_percent_base", "limit_refusal",
    "policy_problem", "remove_verified", "request_compact", "request_limit", "request_policy", "request_sleep",
    "request_trim", "sleep_problem", "wait_applied",
]
