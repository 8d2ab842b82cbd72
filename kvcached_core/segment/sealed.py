"""Decode the sealed blocks of a segment copy: traffic, sleep, compaction, pressure, endpoint, groups.

Each sealed block is ``seq | payload | check`` (``layout.SEALED``); :func:`read_words` unseals every one
of a copy the reader made and checks what it says against the header, the counters and the
control records, so a forged or damaged word reads as unknown, never as fact.
"""

from __future__ import annotations

from typing import Protocol
from zlib import crc32

from . import layout as L
from .snapshot import CompactAnswer, CompactInfo, KVGroup, PressureInfo, SleepInfo


class KeepsWords(Protocol):
    """A file kept open between reads (the reader's ``_Open``): the last sealed blocks decoded from it."""

    words: tuple[bytes, dict, Words] | None


class Words:
    """What a copy's sealed blocks say: traffic (its fields, or None), sleep, compaction; ``whole``: every block
    was readable and possible (else, ``writing``: one was mid-write)."""

    __slots__ = ("compaction", "endpoint", "groups", "pressure", "rest_possible", "sleep", "sleep_key", "traffic",
                 "whole", "writing")

    def __init__(self, traffic: TrafficFields | None, sleep: SleepInfo, compaction: CompactInfo, whole: bool,
                 writing: bool, sleep_key: tuple = (), rest_possible: bool = True,
                 pressure: PressureInfo | None = None, endpoint: str | None = None,
                 groups: tuple[KVGroup, ...] | None = None) -> None:
        self.traffic, self.sleep, self.compaction, self.whole, self.writing = traffic, sleep, compaction, whole, writing
        self.pressure, self.endpoint, self.groups = pressure, endpoint, groups
        self.sleep_key, self.rest_possible = sleep_key, rest_possible  # what sleep and compaction were decoded from

    def again(self, traffic: TrafficFields | None, payload: bytes | None, whole: bool, writing: bool) -> Words:
        """These sleep, compaction and pressure words with other traffic words."""
        return Words(traffic, self.sleep, self.compaction,
                     whole and self.rest_possible and _traffic_possible(payload, traffic), writing, self.sleep_key,
                     self.rest_possible, self.pressure, self.endpoint, self.groups)


TrafficFields = tuple[int, int, int, int, int, int, int]  # layout.TRAFFIC_FIELDS but published
_WRITING = object()  # a sealed block whose sequence is odd: its writer is in the middle of it


def _unseal(raw: bytes, region: str) -> bytes | object | None:
    """The payload of a sealed block of the copy ``raw``: b"" never written, None failing its check, _WRITING."""
    off, size = L.SEALED[region]
    seq = _u64(raw, off)[0]
    if not seq:
        return b""
    if seq & 1:
        return _WRITING
    payload = raw[off + 8:off + 8 + size]
    return payload if _u64(raw, off + 8 + size)[0] == crc32(payload) ^ (seq & 0xFFFFFFFF) else None


_u64 = L.U64.unpack_from
UNKNOWN_SLEEP = SleepInfo(False, "unknown", 0, None, 0, 0.0)
UNKNOWN_CAPABLE = SleepInfo(True, "unknown", 0, None, 0, 0.0)


def read_words(raw: bytes, header: dict, counters: dict, kept: KeepsWords | None) -> Words:
    """The sealed blocks of the copy ``raw``, checked and cross-checked (a forged or damaged word reads as
    unknown, never as fact); the same object again while the blocks, control block and counters are."""
    control = raw[L.CONTROL_OFF:L.LIVENESS_OFF] + raw[L.CONTROL2_OFF:L.CONTROL2_OFF + L.CONTROL2_SIZE]
    sealed = raw[L.WORDS_START:L.WORDS_END] + raw[L.ENDPOINT_OFF:L.HEADER_SIZE] + raw[L.GROUPS_OFF:L.GROUPS_END]
    if kept is not None and kept.words is not None and kept.words[1] is counters and kept.words[0] == control + sealed:
        return kept.words[2]
    whole, writing = True, False
    parts = []
    for region in ("traffic", "sleep", "compact", "pressure", "endpoint", "groups"):
        payload = _unseal(raw, region)
        if payload is None or payload is _WRITING:
            whole, writing = False, writing or payload is _WRITING
        parts.append(payload if isinstance(payload, bytes) else None)
    traffic = _traffic(parts[0])
    # The sleep and compact words change seldom (traffic every engine step): decoded again only when they,
    # or what they are checked against, changed.
    asleep_ok = not (counters["mapped_bytes"] or counters["pages_inuse"])
    key = (parts[1], parts[2], parts[3], parts[4], parts[5], control, asleep_ok)
    if kept is not None and kept.words is not None and kept.words[2].sleep_key == key:
        words = kept.words[2].again(traffic, parts[0], whole, writing)
    else:
        bundle = header["page_size"] * header["num_layers"] * header["num_kv_buffers"] * max(1, header["tp_world"])
        sleep = _sleep(parts[1], counters, _u64(raw, L.SLEEP_CTL_OFF)[0], header["pages_total"] * bundle)
        compaction = _compaction(parts[2], _u64(raw, L.COMPACT_REQ_OFF)[0], bundle,
                                 bundle // max(1, header["blocks_per_page"]))
        pressure = _pressure(parts[3], raw, header["pages_total"] * bundle)
        endpoint = _endpoint(parts[4])
        groups = _groups(parts[5], header)
        rest_possible = sleep.state != "unknown" and compaction.compactions is not None \
            and len(compaction.answers) == _answers_given(parts[2]) and (pressure is not None or parts[3] is None) \
            and (endpoint is not None or not parts[4]) and (groups is not None or not parts[5])
        words = Words(traffic, sleep, compaction, whole, writing, key, rest_possible, pressure, endpoint, groups)
        words.whole = whole and rest_possible and _traffic_possible(parts[0], traffic)
    if kept is not None:
        kept.words = (control + sealed, counters, words)
    return words


def _endpoint(payload: bytes | None) -> str | None:
    """The URL the engine serves on (``layout.ENDPOINT``), or None: none published, or words that cannot be one."""
    if not payload:
        return None
    length, raw = L.ENDPOINT.unpack(payload)
    if not 0 < length <= L.ENDPOINT_MAX or raw[length:].strip(b"\0"):
        return None
    try:
        url = raw[:length].decode("ascii")
    except UnicodeDecodeError:
        return None
    return url if L.endpoint_problem(url) is None else None


def _groups(payload: bytes | None, header: dict) -> tuple[KVGroup, ...] | None:
    """The engine's KV cache groups (``layout.GROUPS``), or None: none published, or words that cannot be (a shape
    no engine writes, more layers than the model's ranges, more blocks or pages than it has, a record past the
    count that is not zero)."""
    if not payload:
        return None
    words = L.GROUPS.unpack(payload)
    count, spare, rest = words[0], words[1], words[2:]
    width = len(L.GROUP_FIELDS)
    if not 0 < count <= L.MAX_GROUPS or spare or any(rest[count * width:]):
        return None
    found = []
    for i in range(count):
        shape, window, layers, active, cached, pages = rest[i * width:(i + 1) * width]
        if (shape not in L.GROUP_SHAPE_NAMES or not 0 < layers <= header["num_layers"]
                or active + cached > header["num_blocks"] or pages > header["pages_total"] or window >= 1 << 31):
            return None
        found.append(KVGroup(L.GROUP_SHAPE_NAMES[shape], window or None, layers, active, cached, pages))
    return tuple(found)


def _traffic_possible(payload: bytes | None, traffic: TrafficFields | None) -> bool:
    """The traffic words are none, or figures that can be."""
    return payload is None or payload == b"" or traffic is not None


def _traffic(payload: bytes | None) -> TrafficFields | None:
    """The engine's traffic fields (``layout.TRAFFIC_FIELDS`` but ``published``), or None: none published, or
    unknown (a word no engine writes)."""
    if not payload:
        return None
    published, running, waiting, finished, prompt, generated, preempted, last_ns = L.TRAFFIC.unpack(payload)
    if (published != 1 or max(running, waiting) > L.MAX_GAUGE or max(finished, prompt, generated, preempted) > L.MAX_COUNT
            or last_ns > L.MAX_TIME_NS):
        return None
    return running, waiting, finished, prompt, generated, preempted, last_ns


def _sleep(payload: bytes | None, counters: dict, asked: int, virtual: int) -> SleepInfo:
    """The allocator's sleep words, checked: ``asked`` is the latest sleep request's revision, ``virtual`` the
    model's whole span of bytes (more can never be released). UNKNOWN_SLEEP when they cannot be."""
    if payload is None:
        return UNKNOWN_SLEEP
    if not payload:  # written at the allocator's start: none yet only while it starts
        return SleepInfo(False, "awake", 0, None, 0, 0.0)
    capable, state, acked, after_idle_ms, slept, took_ns = L.SLEEP.unpack(payload)
    if (capable > 1 or state not in L.SLEEP_STATE_NAMES or acked > asked or slept > virtual
            or not -1 <= after_idle_ms <= L.MAX_AFTER_IDLE_MS or took_ns > L.MAX_DURATION_NS
            or (state == L.SLEEP_ASLEEP and (counters["mapped_bytes"] or counters["pages_inuse"]))):
        # Nothing in these words is taken for fact but the capability (a request still reaches the allocator,
        # which then writes its own words over them).
        return UNKNOWN_CAPABLE if capable == 1 else UNKNOWN_SLEEP
    return SleepInfo(bool(capable), L.SLEEP_STATE_NAMES[state], acked,
                     None if after_idle_ms < 0 else after_idle_ms / 1000, slept, took_ns / 1e9)


def _pressure(payload: bytes | None, raw: bytes, virtual: int) -> PressureInfo | None:
    """The allocator's pressure words, checked against the requests written (``raw``'s CONTROL2) and the model's
    whole span ``virtual``: None when they cannot be (or failed their check), never taken for fact."""
    if payload is None:
        return None
    if not payload:  # written at the allocator's start: none yet only while it starts
        return PressureInfo(0, 0, 0, False, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0)
    (revision, min_bytes, priority, cached, acked, given, given_reserved, given_cached, given_ns, given_to,
     gave, gave_count, took, took_count, asked, wanted, latency_ns) = L.PRESSURE.unpack(payload)
    if (revision > _u64(raw, L.POLICY_CTL_OFF)[0] or acked > _u64(raw, L.RECLAIM_CTL_OFF)[0]
            or not -1 <= min_bytes <= virtual or min_bytes == 0 or not L.PRIORITY_MIN <= priority <= L.PRIORITY_MAX
            or cached > 1 or given != given_reserved + given_cached or given > virtual or wanted > virtual
            or max(gave, took, gave_count, took_count, asked) > L.MAX_COUNT
            or max(given_ns, latency_ns) > L.MAX_DURATION_NS):
        return None
    return PressureInfo(revision, max(0, min_bytes), priority, bool(cached), acked, given, given_reserved,
                        given_cached, given_ns / 1e9, given_to, gave, gave_count, took, took_count, asked, wanted,
                        latency_ns / 1e9)


def _answers_given(payload: bytes | None) -> int:
    """How many answers the COMPACT words hold (non-zero records)."""
    if not payload:
        return 0
    values = L.COMPACT_PAYLOAD.unpack(payload)[len(L.COMPACT_FIELDS):]
    return sum(1 for i in range(0, len(values), 5) if any(values[i:i + 5]))


def _compaction(payload: bytes | None, asked: int, bundle: int, block_bundle: int) -> CompactInfo:
    """The allocator's compaction words, checked: ``asked`` is the latest compact request. Totals that cannot
    be (bytes copied are blocks moved x block bundle; bytes returned whole page bundles) read as None,
    an answer that cannot be is left out, an acknowledgement of a request never made reads as 0."""
    if payload is None:
        return CompactInfo(False, None, None, None, None, None, 0, "unknown")
    if not payload:
        return CompactInfo(False, 0, 0, 0, 0, 0.0)
    values = L.COMPACT_PAYLOAD.unpack(payload)
    capable, status, acked, compactions, moved, copied, returned, took_ns = values[:len(L.COMPACT_FIELDS)]
    acked = acked if acked <= asked else 0
    answers = []
    for i in range(len(L.COMPACT_FIELDS), len(values), 5):
        first, last, code, a_copied, a_returned = values[i:i + 5]
        if (1 <= first <= last <= acked and code in L.COMPACT_STATUS_NAMES and a_copied <= L.MAX_COUNT
                and a_returned <= L.MAX_COUNT and not a_copied % max(1, block_bundle) and not a_returned % bundle):
            answers.append(CompactAnswer(first, last, L.COMPACT_STATUS_NAMES[code], a_copied, a_returned))
    shown = L.COMPACT_STATUS_NAMES.get(status, "unknown")
    if (compactions > moved or moved > L.MAX_COUNT or copied != moved * block_bundle or returned > L.MAX_COUNT
            or returned % bundle or took_ns > L.MAX_DURATION_NS):
        return CompactInfo(capable == 1, None, None, None, None, None, acked, shown, tuple(answers))
    return CompactInfo(capable == 1, compactions, moved, copied, returned, took_ns / 1e9, acked, shown, tuple(answers))
