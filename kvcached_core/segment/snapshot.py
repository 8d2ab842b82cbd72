"""Frozen views of a model's state, as readers see it."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from pathlib import PurePath
from typing import cast

from .names import SEGMENT_PREFIX, InvalidName, validate


@dataclass(frozen=True)
class RankInfo:
    rank: int
    device: int
    pid: int
    mapped_bytes: int
    alive: bool


@dataclass(frozen=True)
class Traffic:
    """What the engine's scheduler published about its requests (``layout.TRAFFIC``)."""

    running: int
    waiting: int
    finished: int
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    last_request_ns: int  # 0: no request yet
    read_ns: int

    @property
    def idle_s(self) -> float | None:
        """Seconds since the last request arrived; None before the first one."""
        if not self.last_request_ns:
            return None
        return max(0.0, (self.read_ns - self.last_request_ns) / 1e9)

    def to_dict(self) -> dict:
        idle = self.idle_s
        return {"running": self.running, "waiting": self.waiting, "finished": self.finished,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "preemptions": self.preemptions, "idle_s": None if idle is None else round(idle, 3)}


@dataclass(frozen=True)
class KVGroup:
    """One of the engine's KV cache groups (``layout.GROUPS``): layers that share a block table."""

    shape: str  # layout.GROUP_SHAPE_NAMES
    window: int | None  # tokens a sliding-window layer attends to; None: the whole sequence
    layers: int
    blocks_active: int
    blocks_cached: int
    pages: int  # pages that hold any of its blocks

    @property
    def label(self) -> str:
        """Its shape as readers show it: ``sliding window 256``, ``full attention``."""
        return f"{self.shape} {self.window}" if self.window else self.shape

    def to_dict(self) -> dict:
        return {"shape": self.shape, "window": self.window, "layers": self.layers,
                "blocks_active": self.blocks_active, "blocks_cached": self.blocks_cached, "pages": self.pages}


@dataclass(frozen=True)
class SleepInfo:
    """The model's sleep state and policy (``layout.SLEEP``). Words no allocator writes (forged or damaged:
    an impossible value, asleep over mapped memory, an acknowledgement of a request never made) read as
    state ``unknown``, with no policy, no revision and no figures."""

    capable: bool  # its engine registered a sleep handler
    state: str  # awake, draining, asleep; unknown
    acked_revision: int
    after_idle_s: float | None  # None: no after-idle policy (or unknown)
    slept_bytes: int  # released by the last sleep
    took_s: float  # how long the last sleep took, from the request to every page unmapped

    def to_dict(self) -> dict:
        return {"state": self.state, "after_idle_s": self.after_idle_s,
                "slept_bytes": None if self.state == "unknown" else self.slept_bytes, "capable": self.capable}


@dataclass(frozen=True)
class CompactAnswer:
    """One compaction's answer to the controller requests ``first_seq..last_seq`` (folded into it)."""

    first_seq: int
    last_seq: int
    status: str  # compacted, no handler, failed
    bytes_copied: int
    bytes_returned: int


@dataclass(frozen=True)
class CompactInfo:
    """The model's compaction figures (``layout.COMPACT``): totals since start and the last answers.
    Totals that cannot be (forged or damaged words) read as None: unknown."""

    capable: bool  # its engine registered a compact handler
    compactions: int | None  # compactions that moved at least one block
    blocks_moved: int | None
    bytes_copied: int | None  # KV bytes the engine copied (every layer, K and V, every rank)
    bytes_returned: int | None  # bytes unmapped from the pages compaction emptied
    took_s: float | None  # the last compaction, plan to last page unmapped
    acked_seq: int = 0  # the last controller request answered
    status: str = "compacted"  # how it ended: compacted, no handler, failed
    answers: tuple[CompactAnswer, ...] = ()  # the last answers, newest first (layout.COMPACT_ANSWERS)

    def answer_for(self, seq: int) -> CompactAnswer | None:
        """The answer to request ``seq``; None when it is not answered yet or its answer left the record."""
        for answer in self.answers:
            if answer.first_seq <= seq <= answer.last_seq:
                return answer
        return None

    def to_dict(self) -> dict:
        return {"capable": self.capable, "compactions": self.compactions, "blocks_moved": self.blocks_moved,
                "bytes_copied": self.bytes_copied, "bytes_returned": self.bytes_returned,
                "last_took_s": None if self.took_s is None else round(self.took_s, 6)}


@dataclass(frozen=True)
class PressureInfo:
    """The model's memory policy and reclaim figures (``layout.PRESSURE``; allocator/pressure.py).

    As a donor, ``given_*`` describe the last reclaim it answered (``given_to`` is the asker's
    ``layout.model_id``); as an asker, ``wanted_bytes`` is what a refused growth waits for now.
    """

    policy_revision: int
    min_bytes: int  # 0: none
    priority: int  # lower gives first
    can_give_cached: bool  # its engine evicts cached pages on request
    reclaim_acked_seq: int
    given_bytes: int
    given_reserved: int
    given_cached: int
    given_took_s: float
    given_to: int
    gave_total: int
    gave_count: int
    took_total: int
    took_count: int
    asked_count: int
    wanted_bytes: int
    latency_s: float  # the last reclaim it asked for: from its ask (or the refused growth, if later) to the bytes given

    def policy_dict(self) -> dict:
        return {"min_bytes": self.min_bytes, "priority": self.priority}

    def to_dict(self) -> dict:
        return {"gave_bytes": self.gave_total, "gave_count": self.gave_count, "took_bytes": self.took_total,
                "took_count": self.took_count, "asked_count": self.asked_count, "wanted_bytes": self.wanted_bytes,
                "last_latency_s": round(self.latency_s, 6),
                "last_given": {"bytes": self.given_bytes, "reserved_bytes": self.given_reserved,
                               "cached_bytes": self.given_cached, "took_s": round(self.given_took_s, 6)}}


@dataclass(frozen=True)
class ModelSnapshot:
    """One model at one instant. ``status`` is live, stale or legacy."""

    name: str
    path: str
    model: str
    engine: str
    backend: str
    pid: int
    uid: int
    device: int
    status: str
    page_size: int
    block_bytes: int
    num_layers: int
    num_kv_buffers: int
    blocks_per_page: int
    num_blocks: int
    pages_total: int
    pages_inuse: int
    pages_reserved: int
    blocks_used: int
    blocks_cached: int
    mapped_bytes: int
    limit_bytes: int | None
    limit_status: str
    requested_limit: int | None = None
    limit_revision: int = 0
    applied_revision: int = 0
    trim_seq: int = 0
    trim_ack_seq: int = 0
    trim_bytes: int = 0
    trimmed_total: int = 0
    idle_returned: int = 0
    alloc_count: int = 0
    free_count: int = 0
    alloc_blocks: int = 0
    free_blocks: int = 0
    evicted_blocks: int = 0
    updated_ns: int = 0
    heartbeat_ns: int = 0
    read_ns: int = 0
    start_time: int = 0
    tp_world: int = 1
    ranks: tuple[RankInfo, ...] = ()
    device_capacity: int = 0
    legacy_reserved: int = 0  # upstream rows carry their prealloc bytes here
    legacy: bool = False  # an upstream kvcached segment: bytes only, no page map (status legacy or stale)
    late: bool = False  # live, but its heartbeat is late or it stays inside a publish: stopped or overloaded
    # 0: the figures are this read's. Else its writer stays inside a publish (the process runs: stopped, or a
    # debugger), no consistent copy can be had, and the figures shown are the last known: when they were true
    # (segment/stuck.py says which copy gave them).
    figures_ns: int = 0
    pid_ns: int = 0  # the writer's pid namespace (0: not recorded); pid means nothing outside it
    traffic: Traffic | None = None  # None: the engine publishes no traffic figures (never invented zeros)
    sleep: SleepInfo | None = None  # None: unknown (upstream segments)
    compaction: CompactInfo | None = None  # None: unknown (upstream segments)
    pressure: PressureInfo | None = None  # None: unknown (upstream segments, forged or damaged words)
    endpoint: str | None = None  # the URL its engine serves on; None: none published (or words that cannot be one)
    groups: tuple[KVGroup, ...] | None = None  # its engine's KV cache groups; None: none published (or impossible)
    device_headroom: int = 0  # bytes of the device its KV growth leaves free (KVCACHED_DEVICE_HEADROOM); 0: none
    working_peak: int = 0  # its engine's registered working-memory peak (register_working_memory); 0: none
    working_now: int = 0  # of that peak, what the engine's process holds now
    pages: array | None = field(default=None, repr=False, compare=False)

    @property
    def bundle_bytes(self) -> int:
        """Device bytes one page id costs: page size x layers x KV buffers, on every tensor-parallel rank."""
        return self.page_size * self.num_layers * self.num_kv_buffers * max(1, self.tp_world)

    @property
    def block_bundle_bytes(self) -> int:
        return self.block_bytes * self.num_layers * self.num_kv_buffers * max(1, self.tp_world)

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices holding the model's memory: its ranks' devices (tensor parallel), else its own."""
        return tuple(sorted({r.device for r in self.ranks})) or (self.device,)

    def device_share(self, device: int) -> float:
        """Fraction of the model's memory on ``device``: every rank holds the same page bundle."""
        if not self.ranks:
            return 1.0 if device == self.device else 0.0
        return sum(r.device == device for r in self.ranks) / len(self.ranks)

    @property
    def held_bytes(self) -> int:
        """Bytes of blocks in use (active + cached), across layers and KV buffers."""
        if self.legacy:
            return self.mapped_bytes - self.reserved_bytes
        return self.blocks_used * self.block_bundle_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pages that hold at least one used block."""
        if self.legacy:
            return self.held_bytes
        return self.pages_inuse * self.bundle_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.legacy_reserved if self.legacy else self.pages_reserved * self.bundle_bytes

    @property
    def cached_bytes(self) -> int | None:
        """Bytes of cached (prefix) blocks; None for upstream segments, which do not publish them."""
        return None if self.legacy else self.blocks_cached * self.block_bundle_bytes

    @property
    def waste_ratio(self) -> float | None:
        """pinned / held; 1.0 is ideal, None when nothing is held or (upstream segments) unknown."""
        held = self.held_bytes
        return self.pinned_bytes / held if held > 0 and not self.legacy else None

    @property
    def pages_free(self) -> int:
        """Page ids neither in use nor reserved (unmapped); 0 for upstream segments, which have no pages."""
        return max(0, self.pages_total - self.pages_inuse - self.pages_reserved)

    @property
    def virtual_bytes(self) -> int:
        return self.pages_total * self.bundle_bytes

    @property
    def working_outstanding(self) -> int:
        """Working memory its engine registered and does not hold yet: what every CUDA allocator of its device keeps
        free for it beside the headroom."""
        return max(0, self.working_peak - self.working_now)

    @property
    def shrinking(self) -> bool:
        return self.limit_status == "deferred"

    @property
    def display_status(self) -> str:
        """What every front end shows: live/stale/legacy; for a live model, late while its process does
        not beat, draining or asleep while it goes to or is asleep, shrinking while a lowered limit waits."""
        if self.status != "live":
            return self.status
        if self.late:
            return "late"
        if self.sleep is not None and self.sleep.state != "awake":
            return self.sleep.state
        return "shrinking" if self.shrinking else "live"

    @property
    def figures_age_s(self) -> float | None:
        """How old the figures shown are (see ``figures_ns``); None while they are this read's."""
        return None if not self.figures_ns else max(0.0, (self.read_ns - self.figures_ns) / 1e9)

    def page_entries(self) -> array:
        """The raw page map (see :mod:`kvcached_core.segment.layout`); empty when not read."""
        return self.pages if self.pages is not None else array("I")

    def to_record(self) -> dict:
        """Every field but the page map, lossless (``kvctl record``); :meth:`from_record` reads it back."""
        return snapshot_record(self)

    @classmethod
    def from_record(cls, values: dict, pages: array | None = None) -> ModelSnapshot:
        """The snapshot :meth:`to_record` described, with ``pages`` as its page map."""
        return snapshot_from_record(values, pages)

    def to_dict(self) -> dict:
        """The JSON shape that ``kvctl list --json`` documents."""
        return {
            "name": self.name, "model": self.model, "engine": self.engine, "backend": self.backend,
            "pid": self.pid, "device": self.device, "status": self.status, "legacy": self.legacy,
            "late": self.late,
            "figures_age_s": None if self.figures_age_s is None else round(self.figures_age_s, 3),
            "page_size": self.page_size, "bundle_bytes": self.bundle_bytes,
            "pages_total": self.pages_total, "pages_inuse": self.pages_inuse,
            "pages_reserved": self.pages_reserved, "pages_free": self.pages_free,
            "blocks_per_page": self.blocks_per_page,
            "blocks_used": self.blocks_used, "blocks_cached": self.blocks_cached,
            "mapped_bytes": self.mapped_bytes, "held_bytes": self.held_bytes,
            "pinned_bytes": self.pinned_bytes, "reserved_bytes": self.reserved_bytes,
            "cached_bytes": self.cached_bytes,
            "limit_bytes": self.limit_bytes, "limit_status": self.limit_status,
            "requested_limit": self.requested_limit, "limit_revision": self.limit_revision,
            "applied_revision": self.applied_revision,
            "waste_ratio": None if self.waste_ratio is None else round(self.waste_ratio, 4),
            "alloc_count": self.alloc_count, "free_count": self.free_count,
            "trimmed_total": self.trimmed_total, "idle_returned": self.idle_returned,
            "heartbeat_ns": self.heartbeat_ns, "updated_ns": self.updated_ns,
            "tp_world": self.tp_world, "device_capacity": self.device_capacity,
            "device_headroom": self.device_headroom, "working_peak_bytes": self.working_peak,
            "working_now_bytes": self.working_now,
            "ranks": [{"rank": r.rank, "device": r.device, "pid": r.pid,
                       "mapped_bytes": r.mapped_bytes, "alive": r.alive} for r in self.ranks],
            "traffic": None if self.traffic is None else self.traffic.to_dict(),
            "sleep": None if self.sleep is None else self.sleep.to_dict(),
            "compaction": None if self.compaction is None else self.compaction.to_dict(),
            "policy": None if self.pressure is None else self.pressure.policy_dict(),
            "pressure": None if self.pressure is None else self.pressure.to_dict(),
            "endpoint": self.endpoint,
            "groups": None if self.groups is None else [g.to_dict() for g in self.groups],
        }


MODEL_FIELDS = frozenset(f.name for f in fields(ModelSnapshot))

# The record form: every field of a snapshot, nothing derived or rounded (``to_dict`` is the documented JSON,
# which leaves out figures a reader needs to compare two snapshots). ``kvctl record`` stores it; replay reads
# it back with :meth:`ModelSnapshot.from_record`. Nested values are named by their field here, once.
_NESTED: dict[str, type] = {"traffic": Traffic, "sleep": SleepInfo, "compaction": CompactInfo,
                            "pressure": PressureInfo}
_SEQUENCES: dict[str, type] = {"ranks": RankInfo, "groups": KVGroup, "answers": CompactAnswer}


def _as_record(value: object) -> object:
    if isinstance(value, tuple):
        return [_as_record(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _as_record(getattr(value, f.name)) for f in fields(value)}  # type: ignore[arg-type]
    return value


def _from_record(cls: type, values: dict) -> object:
    """``cls`` made of a record's ``values``; keys it has no field for are left out (a newer recorder's)."""
    kwargs = {}
    for f in fields(cls):
        if f.name not in values or f.name == "pages":
            continue
        value = values[f.name]
        if value is not None and f.name in _NESTED:
            value = _from_record(_NESTED[f.name], value)
        elif value is not None and f.name in _SEQUENCES:
            value = tuple(_from_record(_SEQUENCES[f.name], v) for v in value)
        kwargs[f.name] = value
    return cls(**kwargs)


def snapshot_record(snap: ModelSnapshot) -> dict:
    """Every field of ``snap`` but its page map, as plain JSON values (nested dataclasses as objects)."""
    return {f.name: _as_record(getattr(snap, f.name)) for f in fields(ModelSnapshot) if f.name != "pages"}


def snapshot_from_record(values: dict, pages: array | None = None) -> ModelSnapshot:
    """The snapshot :func:`snapshot_record` wrote (equal to the original), with ``pages`` as its page map;
    raises TypeError, ValueError or KeyError where ``values`` is no record (a field missing or misshapen)."""
    if not isinstance(values, dict):
        raise TypeError("a snapshot record is a JSON object")
    snap = cast(ModelSnapshot, _from_record(ModelSnapshot, values))
    if pages is not None:
        object.__setattr__(snap, "pages", pages)
    return snap


def model_from_fields(values: dict) -> ModelSnapshot:
    """A :class:`ModelSnapshot` of ``values``, which names every field (:data:`MODEL_FIELDS`) once.

    The same object the constructor makes, without its one ``object.__setattr__`` per field (a
    frozen dataclass of 50 fields: about 10 µs, 0.6 ms of a 64-model scan). The class has no
    ``__post_init__`` and no slots; tests/test_core_reader_kept.py checks that both ways make equal objects.
    """
    snap = object.__new__(ModelSnapshot)
    snap.__dict__.update(values)
    return snap


@dataclass(frozen=True)
class Problem:
    """A file in the segment directory that is not a usable segment, and why."""

    path: str
    status: str  # corrupt, foreign, unreadable, busy
    reason: str
    writer_alive: bool = False  # a live model's segment that cannot be read (its header was overwritten)

    @property
    def segment_name(self) -> str | None:
        """The model name the file's name carries (``kvc.<name>``); None for a file no segment name fits."""
        stem = PurePath(self.path).name
        if not stem.startswith(SEGMENT_PREFIX):
            return None
        try:
            return validate(stem[len(SEGMENT_PREFIX):])
        except InvalidName:
            return None


@dataclass(frozen=True)
class Scan:
    models: tuple[ModelSnapshot, ...]
    problems: tuple[Problem, ...]
