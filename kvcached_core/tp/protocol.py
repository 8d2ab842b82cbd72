"""The wire format between a tensor-parallel scheduler and its rank workers (Unix stream sockets).

Every message is a fixed header followed by ``payload`` bytes. Page lists travel as packed
little-endian u32 arrays; the rare HELLO exchange carries JSON. One request is answered by
exactly one reply with the same ``seq``, so a scheduler can send to every rank first and
collect the replies afterwards (the concurrent strategy).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
from array import array
from collections.abc import Sequence

REQUEST = struct.Struct("<IBxxxIq")  # seq, op, payload bytes, arg
REPLY = struct.Struct("<IBxxxIqq")  # seq, status, payload bytes, mapped bytes on the rank, free bytes

OP_HELLO, OP_MAP, OP_UNMAP, OP_TRIM, OP_PAGES, OP_CLOSE = 1, 2, 3, 4, 5, 6
OP_NAMES = {OP_HELLO: "hello", OP_MAP: "map", OP_UNMAP: "unmap", OP_TRIM: "trim", OP_PAGES: "pages",
            OP_CLOSE: "close"}
ST_OK, ST_ERROR = 0, 1
MAX_PAYLOAD = 64 * 1024 * 1024


class ProtocolError(ConnectionError):
    """The peer sent something that is not a well-formed message."""


def geometry_dict(g) -> dict:  # a backends.Geometry
    return {"page_size": g.page_size, "num_pages": g.num_pages, "num_layers": g.num_layers,
            "num_kv_buffers": g.num_kv_buffers}


def pack_pages(pages: Sequence[int]) -> bytes:
    data = array("I", pages)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def unpack_pages(payload: bytes) -> list[int]:
    data = array("I")
    data.frombytes(payload)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tolist()


def pack_json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(payload: bytes) -> dict:
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"malformed JSON payload: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError("JSON payload is not an object")
    return value


def request_bytes(seq: int, op: int, payload: bytes = b"", arg: int = 0) -> bytes:
    return REQUEST.pack(seq & 0xFFFFFFFF, op, len(payload), arg) + payload


def reply_bytes(seq: int, status: int, payload: bytes, mapped: int, free: int) -> bytes:
    return REPLY.pack(seq, status, len(payload), mapped, free) + payload


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None on a clean end of stream before the first byte."""
    if n == 0:
        return b""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return None
            raise ProtocolError(f"connection closed mid-message ({got} of {n} bytes)")
        got += k
    return bytes(buf)


def recv_request(sock: socket.socket) -> tuple[int, int, int, bytes] | None:
    """(seq, op, arg, payload) of the next request; None when the scheduler hung up."""
    head = recv_exact(sock, REQUEST.size)
    if head is None:
        return None
    seq, op, size, arg = REQUEST.unpack(head)
    if size > MAX_PAYLOAD:
        raise ProtocolError(f"request payload of {size} bytes is too large")
    payload = recv_exact(sock, size) or b""
    return seq, op, arg, payload


class ReplyParser:
    """Accumulates bytes from one rank and yields complete replies (used with poll)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def next(self) -> tuple[int, int, int, int, bytes] | None:
        """(seq, status, mapped, free, payload) once a whole reply has arrived."""
        if len(self.buf) < REPLY.size:
            return None
        seq, status, size, mapped, free = REPLY.unpack_from(self.buf, 0)
        if size > MAX_PAYLOAD:
            raise ProtocolError(f"reply payload of {size} bytes is too large")
        end = REPLY.size + size
        if len(self.buf) < end:
            return None
        payload = bytes(self.buf[REPLY.size:end])
        del self.buf[:end]
        return seq, status, mapped, free, payload
