"""How a sample's figures and page maps are encoded: the recorder writes with it, the reader reads with it.

A model's counters are its snapshot record (``ModelSnapshot.to_record``) flattened one level
(``traffic.read_ns``) plus ``~pages``: the words of its page map, or None when the sample has none; its
clock fields (:data:`TIME_KEYS`) are stored as nanoseconds relative to the sample's time. Between two samples
only the changes are kept: ``{"s": {key: value}, "a": {key: int delta}, "r": [key]}`` per model, and the
integer deltas of every model as columns (``"c": {key: [delta of each model in order, 0: none]}``).

A sample's payload is one compressed blob: the JSON of every model's changes, a newline, then the page-map
changes of every model whose map changed, one after another (``"p"`` in the JSON says whose, which kind
and how many bytes). A page map is written whole (its u32 words as four byte planes) or as the words that
changed (their index gaps and their arithmetic changes, zigzag-coded, as u32 byte planes): zlib folds the
planes' zeros away. Key samples are compressed with LZMA, the others with zlib and the file's preset
dictionary (``meta.zdict``), the page maps in a deflate block after the JSON's.
"""

from __future__ import annotations

import json
import lzma
import re
import sys
import zlib
from array import array
from typing import Any

from kvcached_core import ModelSnapshot

PAGES_KEY = "~pages"  # the page map's words, or None: not a snapshot field
TIME_KEYS = ("updated_ns", "heartbeat_ns", "read_ns")  # stored relative to the sample's time
MAX_PAYLOAD = 1 << 28  # a sample decompressing past this is forged (16 models of 1M-page maps fit in it)
Flat = dict[str, Any]


class Damaged(ValueError):
    """A payload that does not decode as the recorder wrote it (damaged or forged)."""


def flatten(record: dict) -> Flat:
    out: Flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            for inner, v in value.items():
                out[f"{key}.{inner}"] = v
        else:
            out[key] = value
    return out


def unflatten(flat: Flat) -> dict:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        outer, dot, inner = key.partition(".")
        if dot:
            out.setdefault(outer, {})[inner] = value
        else:
            out[key] = value
    return out


def _is_int(v: object) -> bool:
    return type(v) is int


def changes(before: Flat, after: Flat) -> dict:
    """What turns ``before`` into ``after`` (empty when nothing changed)."""
    out: dict[str, Any] = {}
    put, add = {}, {}
    for key, value in after.items():
        old = before.get(key, ...)
        if old is ... or type(old) is not type(value) or old != value:
            if _is_int(old) and _is_int(value):
                add[key] = value - old
            else:
                put[key] = value
    gone = [key for key in before if key not in after]
    if put:
        out["s"] = put
    if add:
        out["a"] = add
    if gone:
        out["r"] = gone
    return out


def apply(before: Flat, change: dict) -> Flat:
    """``before`` with ``change`` applied; raises Damaged where it cannot be one of ours."""
    if not isinstance(change, dict):
        raise Damaged("a change is no object")
    after = dict(before)
    try:
        for key in change.get("r", ()):
            after.pop(key, None)
        after.update(change.get("s", {}))
        for key, delta in change.get("a", {}).items():
            old = after[key]
            if not (_is_int(old) and _is_int(delta)):
                raise Damaged(f"{key}: an integer delta on a non-integer")
            after[key] = old + delta
    except (KeyError, TypeError, AttributeError) as exc:
        raise Damaged(f"a change that does not apply: {exc}") from None
    return after


def columns(order: list[str], changed: dict[str, dict]) -> dict:
    """A delta sample's model changes: ``"m"`` what is no integer delta, ``"c"`` the integer deltas as columns
    over ``order`` (one number a model: no name or key repeated)."""
    cols: dict[str, list[int]] = {}
    rest: dict[str, dict] = {}
    where = {name: i for i, name in enumerate(order)}
    for name, change in changed.items():
        i = where.get(name)
        if i is None:
            rest[name] = change
            continue
        left = {k: v for k, v in change.items() if k != "a"}
        for key, delta in change.get("a", {}).items():
            cols.setdefault(key, [0] * len(order))[i] = delta
        if left:
            rest[name] = left
    out: dict[str, Any] = {}
    if rest:
        out["m"] = rest
    if cols:
        out["c"] = cols
    return out


def column_changes(order: list[str], cols: Any) -> dict[str, dict]:
    """Each model's ``{"a": {key: delta}}`` from a sample's ``"c"``; raises Damaged where it cannot be one."""
    if not isinstance(cols, dict):
        raise Damaged("change columns that are no object")
    out: dict[str, dict] = {}
    for key, col in cols.items():
        if not (isinstance(col, list) and len(col) == len(order)):
            raise Damaged("a change column of the wrong length")
        for name, delta in zip(order, col, strict=True):
            if delta != 0:
                out.setdefault(name, {})[key] = delta
    return {name: {"a": adds} for name, adds in out.items()}


def time_base(t: float) -> int:
    """The nanoseconds a sample taken at ``t`` stores its clock fields relative to (the same on every host)."""
    return int(t * 1e9)


def relative(flat: Flat, base: int) -> Flat:
    """``flat`` with its clock fields made relative to ``base`` (small numbers that change little)."""
    for key in TIME_KEYS:
        value = flat.get(key)
        if type(value) is int:
            flat[key] = value - base
    return flat


def snapshot_of(flat: Flat, base: int, pages: array | None = None) -> ModelSnapshot:
    """The snapshot a flat record with clock fields relative to ``base`` describes; raises Damaged where it
    describes none."""
    try:
        absolute = {k: v for k, v in flat.items() if not k.startswith("~")}
        for key in TIME_KEYS:
            value = absolute.get(key)
            if type(value) is int:
                absolute[key] = value + base
        record = unflatten(absolute)
        return ModelSnapshot.from_record(record, pages)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise Damaged(f"a model record that is no snapshot: {exc}") from None


# -- a sample's payload -------------------------------------------------------------------------

ZLIB, LZMA = b"z", b"x"  # a payload's first byte: how the rest is compressed
_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]
# The preset dictionary a new file's delta samples are compressed with (stored in its meta.zdict; a reader
# takes it from there): the keys and shapes a delta sample repeats, most frequent last (zlib reaches the end
# of a dictionary at the least cost).
ZDICT = ('{"s":{"status":"live","limit_status":"deferred","limit_bytes":null,"requested_limit":null,'
         '"sleep.state":"asleep","compaction.status":"compacted","traffic":null},"r":[],"f":{"s":{"gpus":[],'
         '"router":{}},"a":{}},"o":[],"p":[],"a":{"pressure.given_bytes":0,"pressure.gave_total":0,'
         '"pressure.gave_count":0,"pressure.took_total":0,"pressure.took_count":0,"pressure.asked_count":0,'
         '"pressure.wanted_bytes":0,"pressure.latency_s":0,"traffic.waiting":0,"traffic.running":0,'
         '"traffic.read_ns":0,"trimmed_total":0,"idle_returned":0,"evicted_blocks":0,"pages_reserved":0,'
         '"blocks_cached":0,"pages_inuse":0,"mapped_bytes":0,"alloc_blocks":0,"free_blocks":0,"alloc_count":0,'
         '"free_count":0,"blocks_used":0,"updated_ns":0,"heartbeat_ns":0,"read_ns":0}},"m":{"')


def pack_sample(value: dict, pages: bytes, key: bool, zdict: bytes) -> bytes:
    """A sample's payload: its JSON and its page-map changes, compressed as one (LZMA for a key sample)."""
    raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" + pages
    if key:
        return LZMA + lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zdict=zdict)
    head = packer.compress(raw[:len(raw) - len(pages)])
    if pages:  # a deflate block of its own: the maps' bytes get their own codes (~8 % smaller than one block)
        head += packer.flush(zlib.Z_BLOCK) + packer.compress(pages)
    return ZLIB + head + packer.flush()


def unpack_sample(data: bytes, zdict: bytes) -> tuple[Any, bytes]:
    """A payload's JSON value and its page-map changes; raises Damaged where it is not one of ours."""
    try:
        if data[:1] == ZLIB:
            unpacker = zlib.decompressobj(-15, zdict=zdict)
            raw = unpacker.decompress(data[1:], MAX_PAYLOAD)
            complete = unpacker.eof and not unpacker.unconsumed_tail
        elif data[:1] == LZMA:
            lz = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
            raw = lz.decompress(data[1:], MAX_PAYLOAD)
            complete = lz.eof
        else:
            raise Damaged("not a recorded payload: an unknown compression")
        if not complete:
            raise Damaged("not a recorded payload: it ends early or decompresses too far")
        head, newline, pages = raw.partition(b"\n")
        if not newline:
            raise Damaged("not a recorded payload: no end to its figures")
        return json.loads(head), pages
    except (zlib.error, lzma.LZMAError, ValueError, UnicodeDecodeError) as exc:
        raise Damaged(f"not a recorded payload: {exc}") from None


# -- page maps --------------------------------------------------------------------------------

MAP_WHOLE, MAP_CHANGES = 0, 1  # how a sample holds a model's page map ("p" in its JSON)


def map_bytes(pages: array) -> bytes:
    """A page map's words, little-endian."""
    if sys.byteorder == "little":
        return pages.tobytes()
    swapped = array("I", pages)
    swapped.byteswap()
    return swapped.tobytes()


def map_of(data: bytes) -> array:
    out = array("I")
    if len(data) % out.itemsize:
        raise Damaged("a page map of a partial word")
    out.frombytes(data)
    if sys.byteorder != "little":
        out.byteswap()
    return out


def _planes(raw: bytes) -> bytes:
    """u32 little-endian words as four byte planes (every word's low byte, then the next ...)."""
    return b"".join(raw[i::4] for i in range(4))


def _unplanes(data: bytes) -> bytes:
    n = len(data) // 4
    out = bytearray(len(data))
    for i in range(4):
        out[i::4] = data[i * n:(i + 1) * n]
    return bytes(out)


def _words(values: list[int]) -> bytes:
    return map_bytes(array("I", values))


_NONZERO = re.compile(rb"[^\x00]")


def changed_words(before: bytes, after: bytes) -> list[int]:
    """The indices of the u32 words that differ (the maps are of one length)."""
    diff = (int.from_bytes(before, "little") ^ int.from_bytes(after, "little")).to_bytes(len(after), "little")
    out: list[int] = []
    last = -1
    for m in _NONZERO.finditer(diff):
        index = m.start() >> 2
        if index != last:
            out.append(index)
            last = index
    return out


def whole_map(data: bytes) -> bytes:
    """A map written whole: its words as byte planes."""
    return _planes(data)


def _zigzag(d: int) -> int:
    return (d << 1) ^ (d >> 31) if d < 0 else d << 1


def map_changes(before: bytes, after: bytes, indices: list[int]) -> bytes:
    """The words at ``indices`` (ascending) that turn ``before`` into ``after``: a u32 count, then columns of
    u32 byte planes: the index gaps, the used blocks' change and the cached blocks' change (zigzag-coded: a
    page's counts move by a few), and a byte column of each word's two top bits (mapped, unused) as after."""
    gaps, used, cached, top = [], [], [], bytearray()
    last = -1
    for index in indices:
        gaps.append(index - last)
        last = index
        old = int.from_bytes(before[4 * index:4 * index + 4], "little")
        new = int.from_bytes(after[4 * index:4 * index + 4], "little")
        used.append(_zigzag((new & 0x7FFF) - (old & 0x7FFF)))
        cached.append(_zigzag(((new >> 15) & 0x7FFF) - ((old >> 15) & 0x7FFF)))
        top.append(new >> 30)
    return (len(indices).to_bytes(4, "little") + _planes(_words(gaps)) + _planes(_words(used))
            + _planes(_words(cached)) + bytes(top))


def apply_map(before: bytes | None, kind: object, data: bytes) -> bytes:
    """The map a sample's page entry makes of ``before``; raises Damaged where it cannot be one of ours."""
    if kind == MAP_WHOLE:
        if len(data) % 4:
            raise Damaged("a page map of a partial word")
        return _unplanes(data)
    if kind != MAP_CHANGES:
        raise Damaged(f"a page map of an unknown kind {kind!r}")
    if before is None:
        raise Damaged("page-map changes without the map before them")
    n = int.from_bytes(data[:4], "little")
    if len(data) < 4 or len(data) != 4 + 13 * n:
        raise Damaged("page-map changes of the wrong length")
    cols = [map_of(_unplanes(data[4 + 4 * n * c:4 + 4 * n * (c + 1)])) for c in range(3)]
    tops = data[4 + 12 * n:]
    words = map_of(before)
    index, size = -1, len(words)
    for gap, zu, zc, top in zip(*cols, tops, strict=True):
        index += gap
        if gap < 1 or index >= size:
            raise Damaged("page-map changes past the map's end")
        old = words[index]
        u = ((old & 0x7FFF) + ((zu >> 1) ^ -(zu & 1))) & 0x7FFF
        c = (((old >> 15) & 0x7FFF) + ((zc >> 1) ^ -(zc & 1))) & 0x7FFF
        words[index] = (top & 3) << 30 | c << 15 | u
    return map_bytes(words)
