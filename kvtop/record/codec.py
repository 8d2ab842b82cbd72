"""How a sample's figures and page maps are encoded: the recorder writes with it, the reader reads with it.

A model's counters are its snapshot record (``ModelSnapshot.to_record``) flattened one level
(``traffic.read_ns``) plus ``~pages``: ``[words, crc32]`` of its page map, or None when the sample has none.
Between two samples only the changes are kept: ``{"s": {key: value}, "a": {key: int delta}, "r": [key]}``.
A page map is its u32 words little-endian; a delta is the XOR with the map before (zeros where nothing
changed, which zlib folds away).
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from array import array
from typing import Any

from kvcached_core import ModelSnapshot

PAGES_KEY = "~pages"  # [words, crc32 of the map's bytes] or None; not a snapshot field
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


def snapshot_of(flat: Flat, pages: array | None = None) -> ModelSnapshot:
    """The snapshot a flat record describes; raises Damaged where it describes none."""
    try:
        record = unflatten({k: v for k, v in flat.items() if not k.startswith("~")})
        return ModelSnapshot.from_record(record, pages)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise Damaged(f"a model record that is no snapshot: {exc}") from None


def pack(value: object) -> bytes:
    return zlib.compress(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(), 6)


def unpack(data: bytes) -> Any:
    try:
        return json.loads(zlib.decompress(data))
    except (zlib.error, ValueError, UnicodeDecodeError) as exc:
        raise Damaged(f"not a recorded payload: {exc}") from None


# -- page maps --------------------------------------------------------------------------------

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


def xor(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise Damaged("a page-map delta of another length than the map")
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


_NONZERO = re.compile(rb"[^\x00]")


def _planes(words: array) -> bytes:
    raw = map_bytes(words)
    return b"".join(raw[i::4] for i in range(4))


def _unplanes(data: bytes, n: int) -> list[int]:
    planes = [data[i * n:(i + 1) * n] for i in range(4)]
    return [int.from_bytes(bytes((planes[0][k], planes[1][k], planes[2][k], planes[3][k])), "little")
            for k in range(n)]


def sparse_delta(before: bytes, after: bytes) -> bytes:
    """The words that changed: their index gaps, then their new words, each as u32 split into four byte planes
    (zlib folds the planes' repeats: high bytes of gaps, the mapped bit, small counts); compressed."""
    gaps, words = array("I"), array("I")
    last = -1
    for index in sorted({m.start() >> 2 for m in _NONZERO.finditer(xor(before, after))}):
        gaps.append(index - last)
        words.append(int.from_bytes(after[4 * index:4 * index + 4], "little"))
        last = index
    return zlib.compress(len(gaps).to_bytes(4, "little") + _planes(gaps) + _planes(words), 9)


def apply_sparse(before: bytes, data: bytes) -> bytes:
    """``before`` with a :func:`sparse_delta`'s words written in; raises Damaged where it cannot be one."""
    raw = decompress_map(data)
    n = int.from_bytes(raw[:4], "little")
    if len(raw) < 4 or len(raw) != 4 + 8 * n:
        raise Damaged("a sparse delta of the wrong length")
    gaps, words = _unplanes(raw[4:4 + 4 * n], n), _unplanes(raw[4 + 4 * n:], n)
    out = bytearray(before)
    index = -1
    for gap, word in zip(gaps, words, strict=True):
        index += gap
        if gap < 1 or index >= len(out) // 4:
            raise Damaged("a sparse delta past the map's end")
        out[4 * index:4 * index + 4] = word.to_bytes(4, "little")
    return bytes(out)


def compress_map(data: bytes) -> bytes:
    return zlib.compress(data, 6)


def decompress_map(data: bytes) -> bytes:
    try:
        return zlib.decompress(data)
    except zlib.error as exc:
        raise Damaged(f"not a recorded page map: {exc}") from None
