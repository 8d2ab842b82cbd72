"""A rank worker: holds one rank's KV shard and applies the scheduler's map/unmap decisions.

An engine's per-GPU worker process embeds :class:`TPWorker` (``worker.start()`` serves in a
thread; ``worker.buffer(layer, kv)`` is the rank's memory), or runs it on its own::

    python -m kvcached_core.tp.worker --socket /run/kvc/m.rank0.sock --rank 0 --device 0 --backend cuda

A worker serves exactly one scheduler connection. When the scheduler closes it or goes away,
the worker unmaps everything it holds and stops, so a rank never keeps memory the scheduler
no longer accounts for.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import stat
import struct
import sys
import threading
from pathlib import Path

from ..backends import Backend, BackendError, Geometry
from ..segment.procinfo import start_time
from ..sizes import SizeError, parse_size
from . import protocol as P
from .rank_backends import RANK_BACKENDS, make_rank_backend

PEERCRED = struct.Struct("3i")  # pid, uid, gid


class WorkerError(RuntimeError):
    """The worker cannot start (socket path in use, bad arguments)."""


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _listen(path: Path) -> socket.socket:
    """Bind an owner-only Unix socket; replace a leftover socket file nobody listens on."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise WorkerError(f"{path} exists and is not a socket of ours")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            os.unlink(path)  # stale: its worker is gone
        else:
            raise WorkerError(f"another worker already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise WorkerError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    sock.listen(1)
    return sock


class TPWorker:
    """One rank's memory, steered by the scheduler over ``socket_path``.

    ``geometry`` may be None: the worker then takes the geometry the scheduler announces; when
    given it must match, so a mis-sharded worker is refused at attach time, not at first use.

    ``pinned``: pages mapped as soon as the geometry is known and kept mapped until the worker closes,
    whatever the scheduler maps and unmaps (a scheduler's map of one is a no-op, its unmap leaves it). An
    engine whose kernels read a page before any scheduler exists (vLLM's warm-up and CUDA-graph capture read
    block 0, the padding of every block table) pins that page: on a GPU an unmapped page is a fault.
    """

    def __init__(self, socket_path: str | os.PathLike, rank: int, device: int = 0, backend_name: str = "host",
                 geometry: Geometry | None = None, *, capacity: int | None = None,
                 pinned: tuple[int, ...] = ()) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise WorkerError(f"rank must be a non-negative integer, got {rank!r}")
        if backend_name not in RANK_BACKENDS:
            raise WorkerError(f"unknown backend {backend_name!r}: choose one of {', '.join(RANK_BACKENDS)}")
        self.path = Path(socket_path)
        self.rank = rank
        self.device = device
        self.backend_name = backend_name
        self.capacity = capacity
        self.geometry = geometry
        self.backend: Backend | None = None
        self.mapped: set[int] = set()
        self.pinned = frozenset(pinned)
        self._closing = False  # close() was called (a serving thread that starts after it just returns)
        self.world = 0
        self.attached = threading.Event()
        self.finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: socket.socket | None = None
        try:
            if geometry is not None:
                self.backend = make_rank_backend(backend_name, geometry, device, capacity)
                self._map_pinned()
            self._listener: socket.socket | None = _listen(self.path)
        except BaseException:
            if self.backend is not None:
                self.backend.close()
            raise

    # -- what an engine's worker uses --------------------------------------------------------
    def buffer(self, layer: int, kv: int):  # backend-specific view
        """This rank's view of one layer's one KV buffer (host: memoryview; cuda: the backend's)."""
        if self.backend is None:
            raise RuntimeError("the scheduler has not attached yet: wait for worker.attached")
        return self.backend.buffer(layer, kv)  # type: ignore[attr-defined]

    @property
    def mapped_bytes(self) -> int:
        return len(self.mapped) * self.geometry.bundle_bytes if self.geometry else 0

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (for an engine process that embeds the worker)."""
        self._thread = threading.Thread(target=self.serve, name=f"kvc-tp-rank{self.rank}", daemon=True)
        self._thread.start()
        return self._thread

    def serve(self) -> None:
        """Accept the scheduler, apply its requests until it closes or hangs up, then release everything."""
        listener = self._listener
        if listener is None:
            if self._closing:
                return  # closed before it began to serve: close() releases everything
            raise WorkerError("this worker has already served its scheduler")
        try:
            conn, _ = listener.accept()
        except OSError:
            self._shutdown(None)
            return
        finally:
            self._listener = None
            listener.close()
            _unlink(self.path)
        try:
            pid, uid, _gid = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            if uid != os.getuid():
                return
            self._conn = conn
            self._loop(conn)
        except (OSError, P.ProtocolError):
            pass  # the scheduler went away: release below
        finally:
            self._shutdown(conn)

    def close(self) -> None:
        """Stop serving (hang up on the scheduler, or stop listening) and release all memory."""
        self._closing = True
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)  # the serving thread sees the end and releases
        listener, self._listener = self._listener, None  # the serving thread may drop it too, once woken
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            _unlink(self.path)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._shutdown(None)

    # -- internals ---------------------------------------------------------------------------
    def _loop(self, conn: socket.socket) -> None:
        while True:
            msg = P.recv_request(conn)
            if msg is None:
                return
            seq, op, arg, payload = msg
            try:
                status, out = P.ST_OK, self._handle(op, arg, payload)
            except (BackendError, ValueError, RuntimeError, P.ProtocolError) as exc:
                status, out = P.ST_ERROR, str(exc).encode()
            free = self.backend.free_bytes() if self.backend is not None else 0
            conn.sendall(P.reply_bytes(seq, status, out, self.mapped_bytes, free))
            if op == P.OP_CLOSE:
                return

    def _handle(self, op: int, arg: int, payload: bytes) -> bytes:
        if op == P.OP_HELLO:
            return self._hello(P.unpack_json(payload))
        backend = self.backend
        if backend is None:
            raise P.ProtocolError("no HELLO yet")
        if op == P.OP_MAP:
            pages = self._check_pages(P.unpack_pages(payload))
            todo = [p for p in pages if p not in self.mapped]
            if todo:
                self.mapped.update(backend.map_pages(todo))
            return P.pack_pages([p for p in pages if p in self.mapped])
        if op == P.OP_UNMAP:
            todo = [p for p in self._check_pages(P.unpack_pages(payload)) if p in self.mapped and p not in self.pinned]
            if todo:
                backend.unmap_pages(todo)
                self.mapped.difference_update(todo)
            return b""
        if op == P.OP_TRIM:
            backend.trim_pool(max(0, arg))
            return b""
        if op == P.OP_PAGES:
            return P.pack_pages(sorted(self.mapped))
        if op == P.OP_CLOSE:
            self._release()
            return b""
        raise P.ProtocolError(f"unknown operation {op}")

    def _hello(self, msg: dict) -> bytes:
        want = msg.get("geometry") or {}
        try:
            geometry = Geometry(int(want["page_size"]), int(want["num_pages"]), int(want["num_layers"]),
                                int(want["num_kv_buffers"]))
        except (KeyError, TypeError, ValueError):
            raise P.ProtocolError("HELLO without a valid geometry") from None
        if msg.get("rank") != self.rank:
            raise ValueError(f"this worker is rank {self.rank}, the scheduler expected rank {msg.get('rank')}")
        if self.geometry is None:
            self.backend = make_rank_backend(self.backend_name, geometry, self.device, self.capacity)
            self.geometry = geometry
            self._map_pinned()
        elif geometry != self.geometry:
            raise ValueError(f"rank {self.rank} holds {P.geometry_dict(self.geometry)}, the scheduler expects "
                             f"{P.geometry_dict(geometry)}")
        self.world = int(msg.get("world", 0))
        assert self.backend is not None
        pid = os.getpid()
        self.attached.set()
        return P.pack_json({"rank": self.rank, "device": self.device, "pid": pid, "start_time": start_time(pid),
                            "backend": self.backend.name, "capacity": self.backend.capacity_bytes()})

    def _map_pinned(self) -> None:
        assert self.backend is not None
        pages = sorted(self._check_pages(list(self.pinned)))
        if pages:
            self.mapped.update(self.backend.map_pages(pages))
            if not self.pinned <= self.mapped:
                raise WorkerError(f"rank {self.rank}: cannot map its pinned pages {pages}")

    def _check_pages(self, pages: list[int]) -> list[int]:
        limit = self.geometry.num_pages if self.geometry else 0
        bad = [p for p in pages if p >= limit]
        if bad:
            raise ValueError(f"page ids out of range 0..{limit - 1}: {bad[:8]}")
        return pages

    def _release(self) -> None:
        if self.backend is not None and self.mapped:
            self.backend.unmap_pages(sorted(self.mapped))
            self.mapped.clear()
        if self.backend is not None:
            self.backend.trim_pool(0)

    def _shutdown(self, conn: socket.socket | None) -> None:
        if conn is not None:
            conn.close()
        if self.finished.is_set():
            return
        self._release()
        if self.backend is not None:
            self.backend.close()
        self.finished.set()


def serve(socket_path: str | os.PathLike, rank: int, device: int = 0, backend_name: str = "host",
          geometry: Geometry | None = None, *, capacity: int | None = None) -> None:
    """Run one rank worker in this thread until its scheduler closes or goes away."""
    TPWorker(socket_path, rank, device, backend_name, geometry, capacity=capacity).serve()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcached_core.tp.worker",
                                description="Hold one tensor-parallel rank's KV shard for a kvcached scheduler.")
    p.add_argument("--socket", required=True, help="Unix socket path the scheduler connects to")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--backend", default="host", choices=RANK_BACKENDS)
    p.add_argument("--capacity", help="cap this rank's memory (host and null backends), e.g. 512MiB")
    g = p.add_argument_group("geometry (optional: by default the scheduler announces it)")
    g.add_argument("--page-size", type=int)
    g.add_argument("--pages", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-buffers", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    geometry = None
    given = [args.page_size, args.pages, args.layers]
    if any(v is not None for v in given):
        if any(v is None or v <= 0 for v in given) or args.kv_buffers <= 0:
            print("error: --page-size, --pages and --layers go together and must be positive", file=sys.stderr)
            return 2
        geometry = Geometry(args.page_size, args.pages, args.layers, args.kv_buffers)
    capacity = None
    if args.capacity:
        try:
            capacity = parse_size(args.capacity)
        except SizeError as exc:
            print(f"error: --capacity: {exc}", file=sys.stderr)
            return 2
    try:
        worker = TPWorker(args.socket, args.rank, args.device, args.backend, geometry, capacity=capacity)
    except (WorkerError, BackendError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"READY {worker.path}", flush=True)
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
