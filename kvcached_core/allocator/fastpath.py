"""The optional C hot path: ``alloc`` and ``free`` in ``fastpath.c``, built when the package is installed.

``alloc`` in Python runs placement and segment publishing bytecode by bytecode, slow right after an
engine's GPU wait (``benchmarks/hotpath.py`` and, on a GPU host, ``benchmarks/vmm.py``'s Python path
rows measure both paths; BENCHMARKS.md has the figures). The C version walks the same page-table
objects and writes the same segment bytes, so the Python code stays the reference and the two
may interleave freely (tests/test_fastpath.py compares them block for block, byte for byte).
``free`` likewise; what it triggers beyond the page table (a prefix-cache removal, an unmap, a
limit's status) it asks of the manager's own Python methods. ``publish`` is all of the manager's
publish (``KVCacheManager._publish`` calls it once attached): every counter, the same bytes as
``_publish_python``, without the interpreter inside the seqlock window.

The C code names no Python attribute and no segment offset: :data:`BINDING` says which attribute of
which object plays each role it needs, :meth:`SegmentWriter.c_offsets` where the segment keeps what it writes; both are
passed in when an allocator binds it.

``KVCACHED_FASTPATH``: ``auto`` (default: use it when it was built, else say once why not and stay
in Python), ``0`` (never), ``1`` (always: the allocator fails to start without it). It serves every
placement: the three policies, and the fullest-first placement while a lowered limit waits
(``placement.place_draining``), on one rank or several (tensor parallelism: the ranks' records are
published as in Python). A closed allocator, ids that are not plain ints and a policy subclass of one's own
take the Python path.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import native
from ..segment import layout as L
from ..settings import ConfigError, settings
from .placement import Affinity, FirstFit, Policy

FASTPATH_ENV = native.PARTS["fastpath"].env
# The counters fastpath.c's full publish writes (read_full, publish). A counter added to layout.COUNTER_FIELDS
# but not written there keeps allocators on the Python path (and fails tests/test_fastpath.py) until it is.
C_COUNTERS = frozenset((
    "pages_inuse", "pages_reserved", "blocks_used", "blocks_cached", "mapped_bytes", "alloc_count", "free_count",
    "alloc_blocks", "free_blocks", "evicted_blocks", "updated_ns", "limit_status", "closing", "effective_limit",
    "applied_revision", "trim_ack_seq", "trim_bytes", "requested_limit", "trimmed_total", "idle_returned",
    "ranks_active", "page_sum",
))


# fastpath.c's whole reach into the allocator's Python objects: role (C's word) -> (owner, attribute, how).
# Owners: the manager, its page table (``pages``), prefix cache (``cache``) and segment writer (``segment``).
# "field": read (and maybe written) at each call, through the owner's ``__dict__`` (fastpath.c's FIELD_ROLES);
# "object": fetched once when the fast path is bound: a container C works in place, a method it calls
# (OBJECT_ROLES).
# C names no Python attribute itself: an attribute renamed in Python is renamed here, and
# tests/test_fastpath.py checks every entry against a live allocator.
BINDING: dict[str, tuple[str, str, str]] = {
    # the page table (pages.py): the containers placement works in, and its counts
    **{role: ("pages", role, "object") for role in (
        "used", "cap", "slots", "partial", "reserved", "block_used", "touched", "mapped", "bpp")},
    **{role: ("pages", role, "field") for role in ("nonempty", "pages_inuse", "blocks_used", "inflight")},
    # the segment writer: the mapping, the seqlock's count and the page map's sum
    "buf": ("segment", "_buf", "object"),
    "seq": ("segment", "_seq", "field"),
    "page_sum": ("segment", "page_sum", "field"),
    # the prefix cache
    "blocks": ("cache", "blocks", "field"),
    "by_page": ("cache", "by_page", "field"),
    "remove": ("cache", "remove", "object"),
    # the manager: its parts, its counters and state, and the Python steps C hands work back to
    **{role: ("manager", role, "object") for role in ("pages", "cache", "segment")},
    **{role: ("manager", role, "field") for role in (
        "alloc_count", "alloc_blocks", "free_count", "free_blocks", "evicted_blocks", "limit_pages", "limit_status",
        "max_reserved", "min_reserved", "applied_revision", "trim_ack_seq", "trim_bytes", "requested_limit",
        "trimmed_total", "idle_returned")},
    **{role: ("manager", "_" + role, "field") for role in ("closed", "map_error", "refill_requested",
                                                           "refill_polling")},
    **{role: ("manager", "_" + role, "object") for role in (
        "empty_page", "release_blocks", "pool_overflow", "update_limit_status", "publish", "alloc_missed", "lock",
        "refill_wanted", "rank_records")},
}


# fastpath.c's placement codes (its POLICY_* enum); a policy class not named in attach() stays in Python.
POLICY_BEST_FIT, POLICY_AFFINITY, POLICY_FIRST_FIT = 0, 1, 2


def load() -> tuple[ModuleType | None, str]:
    """The extension module ``kvcached_core.allocator._fastpath``, or None and why not."""
    return native.load("fastpath")


def binding_names() -> dict[str, str]:
    """:data:`BINDING` as FastPath() takes it: role -> attribute name."""
    return {role: attr for role, (_owner, attr, _how) in BINDING.items()}


def require(mode: str) -> None:
    """With ``KVCACHED_FASTPATH=1``, fail now (before the allocator creates anything) if it cannot be built."""
    if mode == "on":
        module, why = load()
        if module is None:
            raise ConfigError(f"{FASTPATH_ENV}=1 but the C alloc path is unavailable: {why}")


def attach(manager: Any, policy: Any, mode: str | None = None) -> tuple[Any | None, str]:
    """A FastPath bound to ``manager`` when its policy and mode allow one, else None and why."""
    mode = settings().mode(FASTPATH_ENV) if mode is None else mode
    if mode == "off":
        return None, f"{FASTPATH_ENV}=0"
    code = {Policy: POLICY_BEST_FIT, Affinity: POLICY_AFFINITY, FirstFit: POLICY_FIRST_FIT}.get(type(policy))
    if code is None:
        return None, f"policy {policy.name!r} runs in Python"
    unknown = [name for name in L.COUNTER_FIELDS if name not in C_COUNTERS]
    if unknown:
        return None, f"the C publish does not write counter(s) {', '.join(unknown)} (fastpath.c): Python path"
    require(mode)
    module, why = load()
    if module is None:
        native.say_unavailable("fastpath", why)
        return None, why
    fast = module.FastPath(manager, code, float(getattr(policy, "slack", 0.0)),
                           manager.segment.c_offsets(manager.bundle_bytes),
                           binding_names())
    return fast, ""


__all__ = ["BINDING", "FASTPATH_ENV", "attach", "load", "require"]
