"""The allocator's side of a segment: create it safely, publish state without a syscall."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from zlib import crc32 as _crc32

from . import layout as L
from .liveness import own_pid_ns, writer_alive
from .names import segment_path, validate
from .procinfo import start_time
from .removal import inode, remove_verified

_pack_counters = L.COUNTERS.pack_into
_pack_u64 = L.U64.pack_into
_unpack_u64 = L.U64.unpack_from
_pack_traffic = L.TRAFFIC.pack_into
_pack_compact = L.COMPACT_PAYLOAD.pack_into
_pack_sleep = L.SLEEP.pack_into
_pack_pressure = L.PRESSURE.pack_into
_pack_endpoint = L.ENDPOINT.pack_into
_pack_groups = L.GROUPS.pack_into
assert sys.byteorder == "little"  # the single 8-byte stores (memoryview "Q") write the layout's byte order


TEMP_PREFIX = ".kvc-new."  # a segment being created: TEMP_PREFIX + name + "." + pid


def temp_owner(filename: str) -> int | None:
    """The pid that was creating ``filename`` (a :data:`TEMP_PREFIX` file), or None if it is not one."""
    if not filename.startswith(TEMP_PREFIX):
        return None
    _name, _, pid = filename[len(TEMP_PREFIX):].rpartition(".")
    return int(pid) if pid.isdigit() and _name else None


class SegmentError(OSError):
    """The segment cannot be created or written; the message says which file and why."""


@dataclass(frozen=True)
class Identity:
    name: str
    model: str
    engine: str
    backend: str
    device: int
    page_size: int
    block_bytes: int
    num_layers: int
    num_kv_buffers: int
    blocks_per_page: int
    num_blocks: int
    pages_total: int
    tp_rank: int = 0
    tp_world: int = 1
    ranks_max: int = 1
    device_capacity: int = 0
    device_headroom: int = 0  # bytes of the device a KV growth leaves free (the CUDA backend's headroom)


@dataclass(frozen=True)
class ControlRequest:
    """What controllers ask of the allocator, read from the CONTROL block."""

    limit_bytes: int | None
    limit_revision: int
    trim_seq: int
    compact_seq: int = 0


def _stale_fd(fd: int) -> bool:
    """True when the open file ``fd`` is one of our own segments whose process is gone."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False
    raw = os.pread(fd, L.PAGE_MAP_OFF, 0)
    if len(raw) < L.PAGE_MAP_OFF or raw[:8] != L.MAGIC:
        return False
    fields = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0), strict=False))
    return not writer_alive(fields, raw)


def stale_inode(path: Path) -> tuple[int, int] | None:
    """The (st_dev, st_ino) of ``path`` when it is one of our own segments whose process is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return inode(os.fstat(fd)) if _stale_fd(fd) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def owned_stale(path: Path) -> bool:
    """True when ``path`` is one of our own segments whose process is gone (safe to replace)."""
    return stale_inode(path) is not None


def _why_taken(path: Path) -> str:
    """Why an existing ``path`` may not be replaced, in words."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link; refusing to follow or replace it"
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        if st.st_uid != os.getuid():
            return f"belongs to uid {st.st_uid}, not you (uid {os.getuid()})"
        with open(path, "rb") as fh:
            raw = fh.read(L.HEADER.size)
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror or exc})"
    if len(raw) < L.HEADER.size or raw[:8] != L.MAGIC:
        return "is not a kvcached_core segment; remove it if it is junk"
    pid = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack(raw), strict=True))["pid"]
    return f"is in use by a live allocator (pid {pid}); pick another name"


def _reserve_blocks(fd: int, size: int, path: Path) -> None:
    """Give the file all its blocks now: a sparse segment on a full tmpfs (Docker's /dev/shm is
    64 MB by default) would kill the allocator with SIGBUS at its first write into a missing page."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            free = _free_bytes(path.parent)
            raise SegmentError(
                f"no room for segment {path}: it needs {size} bytes, {path.parent} has {free} free "
                "(a container's /dev/shm is 64 MB unless raised with --shm-size; or set KVCACHED_SHM_DIR)") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        for off in range(0, size, 1 << 20):  # no fallocate here: writing zeros allocates as well
            os.pwrite(fd, bytes(min(1 << 20, size - off)), off)


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def create_segment_file(name: str, size: int, initial: bytes = b"", directory: Path | None = None) -> tuple[Path, int]:
    """Create ``kvc.<name>`` owner-only, complete from its first appearance; returns (path, fd).

    The file is built under a hidden temporary name (O_EXCL|O_NOFOLLOW, 0600), given its first
    bytes (``initial``: the header), then hard-linked to its real name: ``link`` never replaces
    anything, so the name is claimed exclusively, and no reader ever sees a half-written header.
    An existing segment is replaced only if it is our own and its process is gone.
    """
    path = segment_path(validate(name), directory)
    tmp = path.with_name(f"{TEMP_PREFIX}{name}.{os.getpid()}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a leftover of this pid (a crash mid-creation): ours to replace
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise SegmentError(f"cannot create segment {path}: {exc.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o600)  # umask never widens, but be explicit
            os.ftruncate(fd, size)
            _reserve_blocks(fd, size, path)
            if initial:
                os.pwrite(fd, initial, 0)
        except SegmentError:
            raise
        except OSError as exc:
            raise SegmentError(f"cannot size segment {path}: {exc.strerror}") from None
        for attempt in range(2):
            try:
                os.link(tmp, path, follow_symlinks=False)
                return path, fd
            except FileExistsError:
                stale = stale_inode(path) if attempt == 0 else None
                if stale is not None:
                    with contextlib.suppress(OSError):  # only the dead inode we checked, never a newcomer
                        remove_verified(path, stale, _stale_fd)
                    continue
                raise SegmentError(f"segment name {name!r} is taken: {path} {_why_taken(path)}") from None
            except OSError as exc:
                raise SegmentError(f"cannot create segment {path}: {exc.strerror}") from None
        raise SegmentError(f"segment {path} could not be created")
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class _Sealed:
    """One sealed block of a segment (``layout.SEALED``): where it is, its payload's view, its last sequence."""

    __slots__ = ("check_at", "off", "payload", "seq")

    def __init__(self, off: int, payload: memoryview) -> None:
        self.off, self.payload, self.seq = off, payload, 0
        self.check_at = (off + 8 + len(payload)) >> 3  # the check word's index among the u64 words


class SegmentWriter:
    """Owns one segment: writes the header once, then publishes counters and page entries.

    Not thread-safe on its own: the allocator calls it under its lock.
    """

    def __init__(self, ident: Identity, directory: Path | None = None) -> None:
        if ident.blocks_per_page > L.MAX_BLOCKS_PER_PAGE:
            raise SegmentError(f"{ident.blocks_per_page} blocks per page exceeds the map's {L.MAX_BLOCKS_PER_PAGE}")
        if ident.pages_total > L.MAX_PAGES:
            raise SegmentError(f"{ident.pages_total} pages exceed a segment's {L.MAX_PAGES}")
        self.ident = ident
        size = L.total_size(ident.pages_total, ident.ranks_max)
        self.pid = os.getpid()
        self.wake_token = secrets.randbits(63) | 1  # unguessable: only those who can read the header poke
        header = L.HEADER.pack(
            L.MAGIC, L.LAYOUT_VERSION, L.HEADER_SIZE, size, ident.pages_total,
            ident.name.encode(), ident.model.encode()[:128], ident.engine.encode()[:32],
            ident.backend.encode()[:16], self.pid, start_time(self.pid), os.getuid(), ident.device,
            ident.tp_rank, ident.tp_world, ident.page_size, ident.block_bytes, ident.num_layers,
            ident.num_kv_buffers, ident.blocks_per_page, ident.num_blocks, time.time_ns(), ident.ranks_max,
            ident.device_capacity, own_pid_ns(), self.wake_token, ident.device_headroom,
        )
        initial = bytearray(L.PAGE_MAP_OFF)
        initial[:len(header)] = header
        L.I64.pack_into(initial, L.LIMIT_OFF, -1)
        L.U64.pack_into(initial, L.HEARTBEAT_OFF, time.time_ns())
        self.path, fd = create_segment_file(ident.name, size, bytes(initial), directory)
        try:
            self.inode = inode(os.fstat(fd))
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        self._header = header
        self._counters_view = self._buf[L.COUNTERS_OFF:L.CHECKSUM_OFF]
        self._pages = self._buf[L.PAGE_MAP_OFF:L.PAGE_MAP_OFF + 4 * ident.pages_total].cast("I")
        self._ranks_off = L.ranks_offset(ident.pages_total)
        self._seq = 0
        self.page_sum = 0
        self._words = self._buf[:L.PAGE_MAP_OFF].cast("Q")  # single aligned 8-byte stores, never a torn word
        # The sealed blocks (layout.SEALED): their payloads' views and sequences, one lock for all of them
        # (the engine's thread, the poller and compaction write them).
        self._sealed_lock = threading.Lock()
        self._sealed = {region: _Sealed(off, self._buf[off + 8:off + 8 + size]) for region, (off, size) in L.SEALED.items()}

    # -- publishing --------------------------------------------------------------------------
    def set_page(self, page: int, entry: int) -> None:
        """Write one page entry; call between :meth:`begin` and :meth:`publish`."""
        old = self._pages[page]
        if old != entry:
            self._pages[page] = entry
            self.page_sum += entry - old

    def begin(self) -> None:
        self._seq += 1
        L.U64.pack_into(self._buf, L.SEQ_OFF, self._seq)

    def publish(self, counters: tuple) -> None:
        """Write ``counters`` (COUNTER_FIELDS minus page_sum) and close the seqlock window."""
        buf = self._buf
        _pack_counters(buf, L.COUNTERS_OFF, *counters, self.page_sum & 0xFFFFFFFFFFFFFFFF)
        self._seq = seq = self._seq + 1
        # layout.counters_checksum, inlined: this runs on every state change of the hot path
        _pack_u64(buf, L.CHECKSUM_OFF, _crc32(self._counters_view) ^ (seq & 0xFFFFFFFF))
        _pack_u64(buf, L.SEQ_OFF, seq)

    def current_seq(self) -> int:
        """The seqlock sequence as it is in the file (the C path bumps it too): it changes with every publish."""
        return _unpack_u64(self._buf, L.SEQ_OFF)[0]

    def set_rank(self, index: int, rank: int, device: int, pid: int, started: int, mapped: int, acked: int,
                 flags: int = 0) -> None:
        off = self._ranks_off + index * L.RANK.size
        L.RANK.pack_into(self._buf, off, rank, device, pid, started, mapped, acked, flags, 0, 0)

    def _seal(self, region: str, pack: Callable[..., None], *values: int | bytes) -> None:
        """Write a sealed block (``layout.SEALED``): seq odd, the payload, its check, seq even; a reader takes
        only a copy whose seq is even and whose check matches, so it never sees a half-written payload."""
        block = self._sealed[region]
        payload, words, at = block.payload, self._words, block.off >> 3
        with self._sealed_lock:
            seq = block.seq + 1
            block.seq = seq + 1  # first: an exception below leaves the next write odd, then even again
            words[at] = seq
            pack(payload, 0, *values)
            words[block.check_at] = _crc32(payload) ^ ((seq + 1) & 0xFFFFFFFF)
            words[at] = seq + 1

    def publish_traffic(self, running: int, waiting: int, finished: int, prompt_tokens: int,
                        generated_tokens: int, preemptions: int, last_request_ns: int) -> None:
        """The engine's traffic figures (see ``layout.TRAFFIC``), sealed: safe from any thread."""
        self._seal("traffic", _pack_traffic, 1, running, waiting, finished, prompt_tokens, generated_tokens,
                   preemptions, last_request_ns)

    def publish_sleep(self, capable: int, state: int, acked_revision: int, after_idle_ms: int, slept_bytes: int,
                      took_ns: int) -> None:
        """The SLEEP words (``layout.SLEEP_FIELDS`` order), sealed."""
        self._seal("sleep", _pack_sleep, capable, state, acked_revision, after_idle_ms, slept_bytes, took_ns)

    def publish_pressure(self, *values: int) -> None:
        """The PRESSURE words (``layout.PRESSURE_FIELDS`` order), sealed."""
        self._seal("pressure", _pack_pressure, *values)

    def publish_endpoint(self, url: str) -> None:
        """The URL the engine serves its model on (``layout.ENDPOINT``), sealed; raises ValueError for one it
        cannot be (``layout.endpoint_problem``)."""
        problem = L.endpoint_problem(url)
        if problem is not None:
            raise ValueError(problem)
        raw = url.encode("ascii")
        self._seal("endpoint", _pack_endpoint, len(raw), raw)

    def publish_groups(self, groups: Sequence[tuple[int, int, int, int, int, int]]) -> None:
        """The engine's KV cache groups (``layout.GROUP_FIELDS`` each, at most ``layout.MAX_GROUPS``), sealed."""
        if len(groups) > L.MAX_GROUPS:
            raise ValueError(f"{len(groups)} KV cache groups: a segment holds at most {L.MAX_GROUPS}")
        words: list[int] = [len(groups), 0]
        for group in groups:
            if len(group) != len(L.GROUP_FIELDS) or any(not 0 <= v < 1 << 32 for v in group):
                raise ValueError(f"a KV cache group is {len(L.GROUP_FIELDS)} figures of 0..2**32-1, not {group}")
            words += group
        words += [0] * (len(L.GROUP_FIELDS) * (L.MAX_GROUPS - len(groups)))
        self._seal("groups", _pack_groups, *words)

    def publish_sleep_refused(self, revision: int) -> None:
        """The last sleep request its engine's handler refused (``layout.SLEEP_REFUSED_OFF``): one 8-byte store,
        made before the SLEEP words that acknowledge that request."""
        self._words[L.SLEEP_REFUSED_OFF >> 3] = revision

    # -- liveness and capacity ---------------------------------------------------------------
    def heartbeat(self) -> None:
        self._words[L.HEARTBEAT_OFF >> 3] = time.time_ns()  # one 8-byte store: never read as 0 or half-written
        if self._buf[:8] != L.MAGIC:
            self._restore_header()

    def _restore_header(self) -> None:
        """Someone wrote over the header (the public ``kvctl limit`` writes its total at offset 0): put it back, say so once."""
        found = L.I64.unpack_from(self._buf, 0)[0]
        self._buf[8:len(self._header)] = self._header[8:]
        self._buf[:8] = self._header[:8]  # the magic last: readers take the file back only once all of it is right
        logging.getLogger(__name__).warning(
            "segment %s: its first 8 bytes were overwritten with %d (the public kvctl limit writes its total "
            "there; it does not steer this allocator): header restored; set limits with this project's kvctl limit",
            self.path, found)

    def set_claimed(self, nbytes: int) -> None:
        self._words[L.CLAIMED_OFF >> 3] = max(0, nbytes)

    def set_working(self, peak: int, now: int) -> None:
        """The engine's working memory (``layout.WORKING_*``): two single stores, in the order whose in-between
        state (one word new, one old) keeps back the more of the two a reader could see, never less."""
        words = self._words
        old_peak, old_now = words[L.WORKING_PEAK_OFF >> 3], words[L.WORKING_NOW_OFF >> 3]
        if peak - old_now >= old_peak - now:
            words[L.WORKING_PEAK_OFF >> 3] = peak
            words[L.WORKING_NOW_OFF >> 3] = now
        else:
            words[L.WORKING_NOW_OFF >> 3] = now
            words[L.WORKING_PEAK_OFF >> 3] = peak

    # -- control -----------------------------------------------------------------------------
    def read_control(self) -> ControlRequest:
        """The controllers' latest request. A limit record that is not whole (a write under way, or a
        controller that died between its stores) reads as no new limit; a trim request still counts."""
        limit, revision, check, trim_seq = L.CONTROL.unpack_from(self._buf, L.CONTROL_OFF)
        compact_seq = _unpack_u64(self._buf, L.COMPACT_REQ_OFF)[0]
        if revision and check != L.limit_check(limit, revision):
            return ControlRequest(None, 0, trim_seq, compact_seq)
        return ControlRequest(None if limit < 0 else limit, revision, trim_seq, compact_seq)

    def c_offsets(self, bundle_bytes: int) -> dict[str, int]:
        """Where this segment keeps what the C path (allocator/fastpath.c) writes for an alloc, a free or a publish,
        by name: the counters (layout.COUNTER_FIELDS), the seqlock's word, the checksum, the page map and the rank
        records. The C code has no offset of its own: it writes through these."""
        ident = self.ident
        fmt = L.COUNTERS.format.lstrip("<")
        offsets = {name: L.COUNTERS_OFF + struct.calcsize("<" + fmt[:i]) for i, name in enumerate(L.COUNTER_FIELDS)}
        offsets.update(seq=L.SEQ_OFF, counters=L.COUNTERS_OFF, counters_len=L.CHECKSUM_OFF - L.COUNTERS_OFF,
                       checksum=L.CHECKSUM_OFF, page_map=L.PAGE_MAP_OFF, cached_shift=L.PAGE_CACHED_SHIFT,
                       page_mapped=L.PAGE_MAPPED, limit_deferred=L.LIMIT_DEFERRED, bundle_bytes=bundle_bytes,
                       ranks=L.ranks_offset(ident.pages_total), rank_size=L.RANK.size, ranks_max=ident.ranks_max,
                       tp_world=ident.tp_world)
        rank_fmt = L.RANK.format.lstrip("<")
        offsets.update({f"rank_{name}": struct.calcsize("<" + rank_fmt[:i]) for i, name in enumerate(L.RANK_FIELDS)})
        return offsets

    def read_sleep_request(self) -> tuple[int, int, int] | None:
        """``(revision, action, after_idle_ms)`` of the sleep record, or None when there is none or it is not
        whole (its check does not tie it to its revision: a write under way, or a controller killed half way)."""
        revision, action, after_idle_ms, check = L.SLEEP_CTL.unpack_from(self._buf, L.SLEEP_CTL_OFF)
        if revision == 0 or check != L.sleep_check(action, after_idle_ms, revision):
            return None
        return revision, action, after_idle_ms

    def read_policy_request(self) -> tuple[int, int, int] | None:
        """``(revision, min, priority)`` of the policy record as written (``layout.POLICY_*`` words), or None
        when there is none or it is not whole."""
        revision, min_bytes, priority, check = L.POLICY_CTL.unpack_from(self._buf, L.POLICY_CTL_OFF)
        if revision == 0 or check != L.policy_check(revision, min_bytes, priority):
            return None
        return revision, min_bytes, priority

    def read_reclaim_request(self) -> tuple[int, int, int] | None:
        """``(sequence, bytes wanted, the asker's model id)`` of another model's reclaim record, or None when
        there is none or it is not whole."""
        seq, want, asker, check = L.RECLAIM_CTL.unpack_from(self._buf, L.RECLAIM_CTL_OFF)
        if seq == 0 or check != L.reclaim_check(seq, want, asker):
            return None
        return seq, want, asker

    def request_numbers(self) -> tuple[int, int]:
        """The policy record's revision and the reclaim record's sequence, whole or not: two plain reads for
        the poller's look without the lock (a number past the last taken means a request to read)."""
        return (L.U64.unpack_from(self._buf, L.POLICY_CTL_OFF)[0], L.U64.unpack_from(self._buf, L.RECLAIM_CTL_OFF)[0])

    def publish_compaction(self, values: tuple) -> None:
        """The COMPACT words (``layout.COMPACT_FIELDS`` then ``COMPACT_ANSWERS`` answers), sealed."""
        self._seal("compact", _pack_compact, *values)

    def close(self, unlink: bool = True) -> None:
        if self._mm.closed:
            return
        with self._sealed_lock:  # no sealed write after the buffer goes
            for block in self._sealed.values():
                block.payload.release()
            self._words.release()
        self._pages.release()
        self._counters_view.release()
        self._buf.release()
        self._mm.close()
        if unlink:  # our own inode only: the name may have passed to another allocator since
            with contextlib.suppress(OSError):
                remove_verified(self.path, self.inode)
