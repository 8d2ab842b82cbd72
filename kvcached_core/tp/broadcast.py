"""The scheduler's side of tensor parallelism: a Backend that broadcasts every map and unmap.

A model served with tensor parallelism has one scheduler (a :class:`KVCacheManager` with
``tp_world=N``) that decides pages, and one worker per rank that holds the rank's KV shard.
:class:`BroadcastBackend` sends each decision to every rank over Unix sockets and returns only
when every rank has answered, so an unmap, a trim or a limit is done on all ranks before the
manager acknowledges it.

Consistency rule: a page is mapped for the model only if every rank mapped it. When a rank maps
fewer pages (its device is full), the scheduler unmaps the surplus on the ranks that did, so
the ranks never disagree. A rank that fails (hangs up, errs, or misses the timeout) is
disconnected, which makes its worker release all its memory; from then on every map raises
:class:`RankLost` at once instead of hanging, and unmaps still reach the surviving ranks.

Strategies: ``sequential`` sends to rank 0, waits for its answer, then rank 1, ...;
``concurrent`` sends to every rank first and then collects the answers, so the ranks map in
parallel. ``KVCACHED_TP_STRATEGY`` and ``KVCACHED_TP_TIMEOUT_S`` set the defaults.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..backends import Backend, BackendError, Geometry
from ..backends.ledger import BUDGET_MAX_AGE_S, CapacityLedger
from ..segment import layout as L
from ..settings import TP_STRATEGIES, Settings, default_of
from ..settings import settings as process_settings
from . import protocol as P

STRATEGIES = TP_STRATEGIES
DEFAULT_STRATEGY = default_of("KVCACHED_TP_STRATEGY")
DEFAULT_CONNECT_TIMEOUT_S = 60.0  # a cuda worker initialises its device on HELLO
CLOSE_TIMEOUT_S = 5.0
MAX_CAPACITY = 1 << 62

log = logging.getLogger(__name__)


class RankLost(BackendError):
    """A rank stopped answering; the model cannot map until it is restarted."""


@dataclass
class RankState:
    """What the scheduler knows of one rank, updated from every reply."""

    rank: int
    path: str
    device: int = -1
    pid: int = 0
    start_time: int = 0
    capacity: int = 0
    mapped_bytes: int = 0
    free_bytes: int = 0
    acked_seq: int = 0
    error: str | None = None

    @property
    def lost(self) -> bool:
        return self.error is not None


def default_strategy() -> str:
    return process_settings().tp_strategy


def default_timeout() -> float:
    return process_settings().tp_timeout_s


class BroadcastBackend(Backend):
    """Maps and unmaps a page id on every rank's worker; ``geometry`` is one rank's shard.

    Byte figures it reports (``capacity_bytes``, ``free_bytes``) are for the whole model, all
    ranks together, matching the manager's page bundle of ``geometry.bundle_bytes x world``.
    """

    def __init__(self, geometry: Geometry, backend_name: str, workers: Sequence[str | os.PathLike], *,
                 strategy: str | None = None, timeout: float | None = None,
                 connect_timeout: float | None = None, settings: Settings | None = None) -> None:
        super().__init__(geometry, 0)
        cfg = settings or process_settings()
        if not workers:
            raise ValueError("tensor parallelism needs at least one worker socket")
        self.name = backend_name
        self.strategy = strategy or cfg.tp_strategy
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown broadcast strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        self.timeout = timeout if timeout is not None else cfg.tp_timeout_s
        self.world = len(workers)
        self.ranks = [RankState(i, str(path)) for i, path in enumerate(workers)]
        self.errors: list[str] = []
        self.owned: list[Callable[[], None]] = []  # cleanups of workers this backend started
        self.workers: object | None = None  # their WorkerGroup, when started by kvcached_core.tp
        self._socks: list[socket.socket | None] = [None] * self.world
        self._parsers = [P.ReplyParser() for _ in workers]
        self._io = threading.Lock()
        self._seq = 0
        self._closed = False
        # On the host all ranks share one machine: claim the whole model's bytes once, here.
        self.ledger = CapacityLedger(cfg.host_capacity_bytes, cfg.shm_dir) if backend_name == "host" else None
        try:
            self._attach(connect_timeout if connect_timeout is not None else DEFAULT_CONNECT_TIMEOUT_S)
        except BaseException:
            self._disconnect_all()
            raise
        self.device = self.ranks[0].device

    # -- attach ------------------------------------------------------------------------------
    def _attach(self, connect_timeout: float) -> None:
        deadline = time.monotonic() + connect_timeout
        for state in self.ranks:
            self._socks[state.rank] = self._connect(state, deadline)
        hello = [P.pack_json({"world": self.world, "rank": s.rank, "geometry": P.geometry_dict(self.geometry)})
                 for s in self.ranks]
        with self._io:
            results = self._exchange(P.OP_HELLO, hello, 0, max(0.0, deadline - time.monotonic()) + self.timeout)
        for state, result in zip(self.ranks, results, strict=True):
            if result is None:
                raise BackendError(f"tensor-parallel rank {state.rank} at {state.path}: {state.error}")
            status, payload = result
            if status != P.ST_OK:
                raise BackendError(f"tensor-parallel rank {state.rank} at {state.path} refused: {payload.decode()}")
            info = P.unpack_json(payload)
            if info.get("backend") != self.name:
                raise BackendError(f"tensor-parallel rank {state.rank} runs the {info.get('backend')!r} backend, "
                                   f"the scheduler expects {self.name!r}")
            state.device, state.pid = int(info["device"]), int(info["pid"])
            state.start_time, state.capacity = int(info["start_time"]), int(info["capacity"])

    @staticmethod
    def _connect(state: RankState, deadline: float) -> socket.socket:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(state.path)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise BackendError(f"no tensor-parallel worker for rank {state.rank} listens on "
                                       f"{state.path}: {exc.strerror}") from None
                time.sleep(0.01)
                continue
            except OSError as exc:
                sock.close()
                raise BackendError(f"cannot reach rank {state.rank} at {state.path}: {exc.strerror or exc}") from None
            sock.settimeout(None)
            return sock

    # -- one request to every rank -------------------------------------------------------------
    def _exchange(self, op: int, payload: bytes | list[bytes], arg: int = 0,
                  timeout: float | None = None) -> list[tuple[int, bytes] | None]:
        """Send one request to every live rank; (status, payload) per rank, None where the rank was lost.

        Call with ``self._io`` held. ``payload`` may be one per rank.
        """
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        timeout = self.timeout if timeout is None else timeout
        results: list[tuple[int, bytes] | None] = [None] * self.world
        live = [s.rank for s in self.ranks if not s.lost]
        msgs = ([P.request_bytes(seq, op, p, arg) for p in payload] if isinstance(payload, list)
                else [P.request_bytes(seq, op, payload, arg)] * self.world)
        if self.strategy == "sequential":
            for i in live:
                if self._send(i, msgs[i], op):
                    self._collect([i], seq, op, results, time.monotonic() + timeout, timeout)
        else:
            sent = [i for i in live if self._send(i, msgs[i], op)]
            self._collect(sent, seq, op, results, time.monotonic() + timeout, timeout)
        return results

    def _send(self, i: int, msg: bytes, op: int) -> bool:
        sock = self._socks[i]
        if sock is None:
            return False
        try:
            sock.sendall(msg)
        except OSError as exc:
            self._lose(i, f"could not send {P.OP_NAMES.get(op, op)}: {exc.strerror or exc}")
            return False
        return True

    def _collect(self, idx: list[int], seq: int, op: int, results: list, deadline: float, timeout: float) -> None:
        pending: dict[int, int] = {}
        poller = select.poll()
        for i in idx:
            sock = self._socks[i]
            if sock is not None:
                pending[sock.fileno()] = i
                poller.register(sock.fileno(), select.POLLIN)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for i in list(pending.values()):
                    self._lose(i, f"did not answer {P.OP_NAMES.get(op, op)} within {timeout:g} s")
                return
            for fd, _events in poller.poll(remaining * 1000):
                rank = pending.get(fd)
                if rank is None:
                    continue
                done = self._read_reply(rank, seq, op, results)
                if done:
                    poller.unregister(fd)
                    del pending[fd]

    def _read_reply(self, i: int, seq: int, op: int, results: list) -> bool:
        sock = self._socks[i]
        assert sock is not None
        try:
            data = sock.recv(65536)
        except OSError as exc:
            self._lose(i, f"connection failed during {P.OP_NAMES.get(op, op)}: {exc.strerror or exc}")
            return True
        if not data:
            self._lose(i, f"hung up during {P.OP_NAMES.get(op, op)} (worker exited?)")
            return True
        parser = self._parsers[i]
        parser.feed(data)
        try:
            reply = parser.next()
        except P.ProtocolError as exc:
            self._lose(i, str(exc))
            return True
        if reply is None:
            return False
        rseq, status, mapped, free, payload = reply
        if rseq != seq:
            self._lose(i, f"answered request {rseq}, expected {seq}")
            return True
        state = self.ranks[i]
        state.mapped_bytes, state.free_bytes, state.acked_seq = mapped, free, rseq
        results[i] = (status, payload)
        return True

    def _lose(self, i: int, reason: str) -> None:
        """Disconnect rank ``i``: its worker sees the hang-up and releases everything it holds."""
        state = self.ranks[i]
        if state.lost:
            return
        state.error = reason
        state.mapped_bytes = 0
        message = f"tensor-parallel rank {i} (pid {state.pid}, {state.path}) lost: {reason}"
        self.errors.append(message)
        log.error(message)
        sock, self._socks[i] = self._socks[i], None
        if sock is not None:
            sock.close()

    def _check_errors(self, op: str, results: list) -> None:
        for i, result in enumerate(results):
            if result is not None and result[0] != P.ST_OK:
                self._lose(i, f"{op} failed: {result[1].decode(errors='replace')}")

    def _require_all(self) -> None:
        if self._closed:
            raise BackendError("the tensor-parallel backend is closed")
        lost = [s for s in self.ranks if s.lost]
        if lost:
            raise RankLost("; ".join(f"rank {s.rank} (pid {s.pid}) lost: {s.error}" for s in lost))

    # -- Backend -----------------------------------------------------------------------------
    def map_pages(self, pages: Sequence[int]) -> list[int]:
        model_bundle = self.geometry.bundle_bytes * self.world
        with self._io:
            self._require_all()
            asked = list(pages)
            if self.ledger is not None:  # the machine-wide host share, for every rank at once
                claimed = 0
                while claimed < len(asked) and self.ledger.claim(model_bundle):
                    claimed += 1
                asked = asked[:claimed]
            if not asked:
                return []
            results = self._exchange(P.OP_MAP, P.pack_pages(asked))
            self._check_errors("map", results)
            held = [set(P.unpack_pages(r[1])) if r is not None and r[0] == P.ST_OK else None for r in results]
            everywhere: list[int] = []
            if all(h is not None for h in held):
                for page in asked:  # the common prefix: mapped on every rank
                    if not all(page in h for h in held):  # type: ignore[operator]
                        break
                    everywhere.append(page)
            kept = set(everywhere)
            surplus = sorted({p for h in held if h is not None for p in h} - kept)
            if surplus:  # a rank said no: take the page back from the ranks that said yes
                self._check_errors("unmap", self._exchange(P.OP_UNMAP, P.pack_pages(surplus)))
            if everywhere and any(s.lost for s in self.ranks):  # nothing maps on a model missing a rank
                self._check_errors("unmap", self._exchange(P.OP_UNMAP, P.pack_pages(everywhere)))
                everywhere = []
            if self.ledger is not None and len(asked) > len(everywhere):
                self.ledger.release((len(asked) - len(everywhere)) * model_bundle)
            self._require_all()
            return everywhere

    def unmap_pages(self, pages: Sequence[int]) -> None:
        pages = list(pages)
        if not pages:
            return
        with self._io:
            if not self._closed:
                self._check_errors("unmap", self._exchange(P.OP_UNMAP, P.pack_pages(pages)))
            if self.ledger is not None:
                self.ledger.release(len(pages) * self.geometry.bundle_bytes * self.world)

    def trim_pool(self, keep_pages: int) -> None:
        with self._io:
            if not self._closed:
                self._check_errors("trim", self._exchange(P.OP_TRIM, b"", keep_pages))

    def capacity_bytes(self) -> int:
        if self.ledger is not None:
            return self.ledger.capacity
        return min(MAX_CAPACITY, sum(s.capacity for s in self.ranks))

    def free_bytes(self) -> int:
        if any(s.lost for s in self.ranks):
            return 0
        free = min(MAX_CAPACITY, min(s.free_bytes for s in self.ranks) * self.world)
        if self.ledger is not None:
            free = min(free, self.ledger.free_bytes())
        return free

    def budget_free_bytes(self) -> int | None:
        return None if self.ledger is None else self.ledger.free_bytes(BUDGET_MAX_AGE_S)

    def bind_claims(self, set_claimed: Callable[[int], None], own_segment: tuple[int, int] | None = None) -> None:
        if self.ledger is not None:
            self.ledger.bind(set_claimed, own_segment)

    def buffer(self, layer: int, kv: int) -> None:
        raise RuntimeError("a tensor-parallel model's buffers live in its rank workers: use TPWorker.buffer()")

    # -- observability -------------------------------------------------------------------------
    def rank_records(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """(rank, device, pid, start_time, mapped_bytes, acked_seq, flags) per rank, for the segment."""
        return [(s.rank, s.device, s.pid, s.start_time, s.mapped_bytes, s.acked_seq,
                 L.RANK_LOST if s.lost else 0) for s in self.ranks]

    def rank_pages(self) -> list[list[int] | None]:
        """Each rank's own list of mapped page ids (None for a lost rank): ranks must agree."""
        with self._io:
            results = self._exchange(P.OP_PAGES, b"")
        return [P.unpack_pages(r[1]) if r is not None and r[0] == P.ST_OK else None for r in results]

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Tell every rank to release its memory and stop; then stop workers this backend started."""
        with self._io:
            if not self._closed:
                self._closed = True
                if any(not s.lost for s in self.ranks):
                    self._exchange(P.OP_CLOSE, b"", 0, min(self.timeout, CLOSE_TIMEOUT_S))
                self._disconnect_all()
                if self.ledger is not None:
                    self.ledger.release(self.ledger.claimed)
        for cleanup in self.owned:
            cleanup()
        self.owned.clear()

    def _disconnect_all(self) -> None:
        for i, sock in enumerate(self._socks):
            if sock is not None:
                sock.close()
                self._socks[i] = None


def reap(proc: subprocess.Popen, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Wait for a worker process that was told to stop; kill it if it does not."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
