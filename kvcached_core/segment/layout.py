"""The segment layout: the only contract between an allocator and its readers.

One file per model, ``<KVCACHED_SHM_DIR>/kvc.<name>``, mode 0600, little-endian::

    offset  size  region      written by     contents
    0       512   HEADER      allocator      magic, layout version, sizes, identity (once); ENDPOINT in its spare tail
    384     128   ENDPOINT    engine         sealed: the URL the engine serves its model on (an OpenAI-compatible server)
    512     96    CONTROL     controllers    limit bytes + revision + check, trim request seq, sleep request, compact request seq
    608     32    LIVENESS    allocator      heartbeat (ns), claimed bytes (capacity ledger), working memory peak and now: single 8-byte stores
    640     8     SEQ         allocator      seqlock sequence (odd while a publish is under way)
    648     176   COUNTERS    allocator      counters, acknowledgements, page-map sum, checksum
    832     232   COMPACT     allocator      sealed: compaction capable, status, acknowledged request, totals, the last answers
    1088    80    TRAFFIC     engine         sealed: requests running/waiting, finished, tokens, preemptions
    1216    64    SLEEP       allocator      sealed: sleep state, policy, bytes released, acknowledged revision
    1280    152   PRESSURE    allocator      sealed: memory policy (min, priority), reclaim answers and totals
    1440    64    CONTROL2    controllers    policy request (revision, min, priority, check); other models: reclaim request
    1528    8     REFUSED     allocator      the last sleep request its engine's handler refused (one store)
    1536    120   GROUPS      engine         sealed: the KV cache groups (shape, layers) and the blocks and pages of each
    1664    4*N   PAGE MAP    allocator      one u32 per page (see ``PAGE_*``)
    ...     R*64  RANKS       allocator      tensor-parallel ranks: pid, device, mapped bytes

Readers never lock. A publish bumps SEQ to odd, writes the dirty page entries and the
counters, stores ``checksum = crc32(counters) ^ (seq & 0xffffffff)`` and bumps SEQ to even.
A reader accepts a copy only when SEQ was even and unchanged around the copy, the checksum
matches and the page-map sum matches, so a torn copy is caught on weakly ordered CPUs too.
The ENDPOINT, COMPACT, TRAFFIC, SLEEP, PRESSURE and GROUPS regions are *sealed* blocks, each its own small seqlock:
``seq | payload | check`` with ``check = crc32(payload) ^ (seq & 0xffffffff)`` (:func:`seal_check`);
a writer (one lock per segment writer) stores seq odd, the payload, the check, then seq even,
the two words with single 8-byte stores. A reader takes a block only when its seq is even and
its check matches. Controllers serialise among themselves with flock on the file; the
allocator never takes it.
"""

from __future__ import annotations

import struct
import zlib

# Bounds the settings and the size parser share with the segment (kvcached_core/bounds.py, one floor down).
from ..bounds import ENDPOINT_MAX as ENDPOINT_MAX
from ..bounds import MAX_LIMIT_BYTES as MAX_LIMIT_BYTES
from ..bounds import PRIORITY_MAX as PRIORITY_MAX
from ..bounds import PRIORITY_MIN as PRIORITY_MIN
from ..bounds import endpoint_problem as endpoint_problem
from ..bounds import printable as printable

MAGIC = b"KVCSEG\x00\x01"
LAYOUT_VERSION = 4  # 2: the CONTROL block grew by the compact request (liveness moved), the COMPACT region;
# 3: COMPACT, TRAFFIC and SLEEP sealed (each its own seqlock and check), the last compaction answers, page map at 1536;
# 4: the GROUPS region at 1536, page map at 1664

HEADER = struct.Struct("<8sIIQQ64s128s32s16sqQIiiiQQIIIQQIQQQQ")
HEADER_FIELDS = (
    "magic", "layout_version", "header_bytes", "total_bytes", "pages_total",
    "name", "model", "engine", "backend",
    "pid", "start_time", "uid", "device", "tp_rank", "tp_world",
    "page_size", "block_bytes", "num_layers", "num_kv_buffers", "blocks_per_page",
    "num_blocks", "created_ns", "ranks_max", "device_capacity",
    "pid_ns",  # the writer's pid namespace (inode of /proc/self/ns/pid); 0 in segments written before it
    "wake_token",  # names the allocator's wake socket (kvcached_core.allocator.poller); 0: none, nobody to poke
    "device_headroom",  # bytes of the device a KV growth leaves free (KVCACHED_DEVICE_HEADROOM); 0: none, or written before it
)
HEADER_OFF = 0
HEADER_SIZE = 512

CONTROL = struct.Struct("<qQQQ")  # limit_bytes (-1 none), limit_revision, limit_check, trim_request_seq
CONTROL_OFF = 512
LIMIT_OFF = CONTROL_OFF
LIMIT_REV_OFF = CONTROL_OFF + 8
LIMIT_CHECK_OFF = CONTROL_OFF + 16
TRIM_REQ_OFF = CONTROL_OFF + 24

# The sleep request, in the CONTROL block after the limit: revision, action, after-idle policy, check. A
# controller writes the revision word last; the allocator takes a request whose check matches and whose
# revision is not the one it took last.
SLEEP_CTL = struct.Struct("<QQqQ")
SLEEP_CTL_OFF = CONTROL_OFF + CONTROL.size
SLEEP_POLICY_ONLY, SLEEP_SOON, SLEEP_NOW, SLEEP_WAKE = 0, 1, 2, 3  # actions: SOON lets running requests finish
SLEEP_IDLE_KEEP, SLEEP_IDLE_OFF = -2, -1  # after_idle_ms: leave the policy as it is, remove it
SLEEP_IDLE_MIN_MS = 100  # the shortest after-idle policy: shorter, a busy model would sleep between two requests
MAX_SLEEP_REVISION = 2**63 - 1  # past it (a damaged word), controllers number requests from 1 again
# The compaction request, after the sleep request: a sequence number, acknowledged like trim's
# (``COMPACT.acked_seq``); the CONTROL block's last 24 bytes are spare.
COMPACT_REQ_OFF = SLEEP_CTL_OFF + SLEEP_CTL.size
CONTROL_SIZE = 96

LIVENESS_OFF = CONTROL_OFF + CONTROL_SIZE
assert COMPACT_REQ_OFF + 8 <= LIVENESS_OFF
HEARTBEAT_OFF = LIVENESS_OFF       # u64 ns, CLOCK_REALTIME
CLAIMED_OFF = LIVENESS_OFF + 8     # u64 bytes this process holds against the device capacity
# The engine's working memory beside its KV (activations, masks, logits): its measured peak (0: none registered) and
# of it what the engine's process holds now; the device's headroom keeps max(0, peak - now) free for it. Single stores.
WORKING_PEAK_OFF = LIVENESS_OFF + 16
WORKING_NOW_OFF = LIVENESS_OFF + 24

SEQ_OFF = 640
assert WORKING_NOW_OFF + 8 <= SEQ_OFF
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")

COUNTERS = struct.Struct("<QQQQQQQQQQQiiqQQQqQQQQ")
COUNTER_FIELDS = (
    "pages_inuse", "pages_reserved", "blocks_used", "blocks_cached", "mapped_bytes",
    "alloc_count", "free_count", "alloc_blocks", "free_blocks", "evicted_blocks", "updated_ns",
    "limit_status", "closing", "effective_limit", "applied_revision",
    "trim_ack_seq", "trim_bytes", "requested_limit", "trimmed_total", "idle_returned",
    "ranks_active", "page_sum",
)
COUNTERS_OFF = SEQ_OFF + 8
CHECKSUM_OFF = COUNTERS_OFF + COUNTERS.size
PAGE_MAP_OFF = 1664
assert CHECKSUM_OFF + 8 <= PAGE_MAP_OFF


def seal_check(payload: bytes | memoryview, seq: int) -> int:
    """The check word of a sealed block (COMPACT, TRAFFIC, SLEEP): ties its payload to its sequence."""
    return zlib.crc32(payload) ^ (seq & 0xFFFFFFFF)


# A sealed block: u64 seq, the payload, u64 check (seal_check). Offsets below are the blocks' own;
# ``*_OFF + 8`` is the payload's.
SEAL_BYTES = 16

# COMPACT: the allocator's compaction figures, written after each compaction. ``capable`` is 0 until
# the engine registers a compact handler; ``status`` is how the last controller request ended
# (COMPACT_*); totals count every compaction (a controller's, the engine's own, idle packing);
# ``took_ns`` is the last compaction's time. Then the last COMPACT_ANSWERS answers to controllers,
# newest first: (first_seq, last_seq, status, copied, returned): one compaction answers every request
# from first_seq to last_seq (requests that arrived together are folded into one), with its bytes.
COMPACT = struct.Struct("<IIQQQQQQ")
COMPACT_FIELDS = ("capable", "status", "acked_seq", "compactions", "blocks_moved", "bytes_copied", "bytes_returned",
                  "took_ns")
COMPACT_ANSWER = struct.Struct("<QQQQQ")
COMPACT_ANSWER_FIELDS = ("first_seq", "last_seq", "status", "copied", "returned")
COMPACT_ANSWERS = 4
COMPACT_PAYLOAD = struct.Struct("<" + COMPACT.format.lstrip("<") + COMPACT_ANSWER.format.lstrip("<") * COMPACT_ANSWERS)
COMPACT_OFF = 832
assert COMPACT_OFF >= CHECKSUM_OFF + 8 and COMPACT_OFF % 8 == 0
COMPACT_DONE, COMPACT_NO_HANDLER, COMPACT_FAILED = 0, 1, 2
COMPACT_STATUS_NAMES = {COMPACT_DONE: "compacted", COMPACT_NO_HANDLER: "no handler", COMPACT_FAILED: "failed"}

# TRAFFIC: what the engine's scheduler sees, sealed once per scheduler step. ``published`` is 1 (the
# block's seq 0: no engine ever wrote it, readers say "no traffic figures", never invented zeros).
# Gauges (running, waiting) and monotonic counters; ``last_request_ns`` is CLOCK_REALTIME, 0 before any request.
TRAFFIC = struct.Struct("<QQQQQQQQ")
TRAFFIC_FIELDS = ("published", "running", "waiting", "finished", "prompt_tokens", "generated_tokens",
                  "preemptions", "last_request_ns")
TRAFFIC_OFF = 1088
assert COMPACT_OFF + SEAL_BYTES + COMPACT_PAYLOAD.size <= TRAFFIC_OFF

# SLEEP: the allocator's answer, sealed at each change. ``capable`` is 0 until an engine that can
# sleep registers its handler; after_idle_ms -1: no policy.
SLEEP = struct.Struct("<QQQqQQ")
SLEEP_FIELDS = ("capable", "state", "acked_revision", "after_idle_ms", "slept_bytes", "took_ns")
SLEEP_OFF = 1216
assert TRAFFIC_OFF + SEAL_BYTES + TRAFFIC.size <= SLEEP_OFF and SLEEP_OFF + SEAL_BYTES + SLEEP.size <= PAGE_MAP_OFF
SLEEP_AWAKE, SLEEP_DRAINING, SLEEP_ASLEEP = 0, 1, 2
SLEEP_STATE_NAMES = {SLEEP_AWAKE: "awake", SLEEP_DRAINING: "draining", SLEEP_ASLEEP: "asleep"}

# PRESSURE: the model's memory policy and reclaim figures (allocator/pressure.py), sealed at each change.
# Policy: ``policy_revision`` (the last POLICY_CTL revision taken), ``min_bytes`` (-1: none), ``priority``
# (lower gives first), ``can_give_cached`` (the engine evicts cached pages on request). As a donor: the last
# reclaim request answered (``reclaim_acked_seq``), what it gave (reserved and cached bytes, how long it
# took, to whom: a :func:`model_id`) and totals. As an asker: bytes taken and requests made, the bytes a
# refused growth waits for now (``wanted_bytes``, 0: none) and the last reclaim's latency (refused growth to
# bytes given).
PRESSURE = struct.Struct("<QqqQQQQQQQQQQQQQQ")
PRESSURE_FIELDS = ("policy_revision", "min_bytes", "priority", "can_give_cached",
                   "reclaim_acked_seq", "given_bytes", "given_reserved", "given_cached", "given_took_ns", "given_to",
                   "gave_total", "gave_count", "took_total", "took_count", "asked_count", "wanted_bytes",
                   "latency_ns")
PRESSURE_OFF = SLEEP_OFF + 64
assert SLEEP_OFF + SEAL_BYTES + SLEEP.size <= PRESSURE_OFF
SEALED = {"compact": (COMPACT_OFF, COMPACT_PAYLOAD.size), "traffic": (TRAFFIC_OFF, TRAFFIC.size),
          "sleep": (SLEEP_OFF, SLEEP.size), "pressure": (PRESSURE_OFF, PRESSURE.size)}  # region -> (offset, payload)
WORDS_START, WORDS_END = COMPACT_OFF, PRESSURE_OFF + SEAL_BYTES + PRESSURE.size  # the sealed blocks, in one slice

# ENDPOINT: where the engine serves its model to clients (vLLM's --host/--port, KVCACHED_ENDPOINT), sealed, in the
# header region's last 128 bytes, which the header struct leaves spare: segments written before it read as none
# published (the block's seq 0) and readers before it never look there, so the layout version stays. The payload
# is the URL's length, then the URL (ASCII, ``http(s)://host:port[/path]``, at most ENDPOINT_MAX bytes), zero-padded.
ENDPOINT = struct.Struct(f"<Q{ENDPOINT_MAX}s")
ENDPOINT_OFF = 384
assert HEADER.size <= ENDPOINT_OFF and ENDPOINT_OFF + SEAL_BYTES + ENDPOINT.size == HEADER_SIZE
SEALED["endpoint"] = (ENDPOINT_OFF, ENDPOINT.size)

# CONTROL2: the second controllers' block, written as CONTROL is (under the controllers' flock, one record
# whose check ties it to its revision, the revision word last). POLICY_CTL: a controller's policy request
# (min -1 none, -2 keep; priority POLICY_PRIORITY_KEEP keeps it). RECLAIM_CTL: another model's reclaim request
# (sequence, bytes wanted, the asker's model_id, check); one outstanding at a time (see allocator/pressure.py).
CONTROL2_OFF = 1440
CONTROL2_SIZE = 64
POLICY_CTL = struct.Struct("<QqqQ")
POLICY_CTL_OFF = CONTROL2_OFF
POLICY_MIN_NONE, POLICY_MIN_KEEP = -1, -2
POLICY_PRIORITY_KEEP = -(1 << 63)
RECLAIM_CTL = struct.Struct("<QQQQ")
RECLAIM_CTL_OFF = POLICY_CTL_OFF + POLICY_CTL.size
assert WORDS_END <= CONTROL2_OFF and RECLAIM_CTL_OFF + RECLAIM_CTL.size <= CONTROL2_OFF + CONTROL2_SIZE
# The last sleep request (revision) whose engine's handler raised: one plain word (a single 8-byte store) that
# the allocator stores before the SLEEP words acknowledging that request, so a controller that reads its own
# revision acknowledged then reads here whether it was refused.
SLEEP_REFUSED_OFF = 1528
assert CONTROL2_OFF + CONTROL2_SIZE <= SLEEP_REFUSED_OFF and SLEEP_REFUSED_OFF % 8 == 0

# GROUPS: the engine's KV cache groups, sealed whenever it publishes them (an engine that publishes none: readers
# say none, never invent one). vLLM groups the layers that share a block table (sliding-window layers beside full
# ones: two groups over one pool of block ids). ``count`` GROUP records follow, in the engine's group order, each:
# its layers' shape (a key of GROUP_SHAPE_NAMES), the window in tokens (0: none), its layers, and of its blocks the
# active ones, the cached ones and the pages that hold any of them.
GROUP = struct.Struct("<IIIIII")
GROUP_FIELDS = ("shape", "window", "layers", "blocks_active", "blocks_cached", "pages")
MAX_GROUPS = 4
GROUPS = struct.Struct("<II" + GROUP.format.lstrip("<") * MAX_GROUPS)  # count, spare, MAX_GROUPS records
GROUP_SHAPE_NAMES = {1: "full attention", 2: "sliding window", 3: "MLA"}
GROUP_SHAPE_CODES = {name: code for code, name in GROUP_SHAPE_NAMES.items()}
GROUPS_OFF = 1536
assert SLEEP_REFUSED_OFF + 8 <= GROUPS_OFF and GROUPS_OFF + SEAL_BYTES + GROUPS.size <= PAGE_MAP_OFF
SEALED["groups"] = (GROUPS_OFF, GROUPS.size)
GROUPS_END = GROUPS_OFF + SEAL_BYTES + GROUPS.size

# What the readers take for possible (a word past these is forged or damaged and reads as unknown).
MAX_AFTER_IDLE_MS = 366 * 86_400_000  # an after-idle policy of at most a year (controllers refuse more)
MAX_DURATION_NS = 366 * 86_400 * 10**9  # a sleep or a compaction that took more than a year did not happen
MAX_GAUGE = 1 << 32  # requests running or waiting in one engine
MAX_COUNT = 1 << 53  # a monotonic count (requests, tokens, blocks, bytes) a float still holds exactly
MAX_TIME_NS = (1 << 63) - 1  # a CLOCK_REALTIME time in ns (an int64)


def sleep_check(action: int, after_idle_ms: int, revision: int) -> int:
    """Ties a sleep request to its revision so a half-written one is never acted on."""
    raw = U64.pack(action) + I64.pack(after_idle_ms) + U64.pack(revision)
    return (zlib.crc32(raw) | (revision << 32)) & 0xFFFFFFFFFFFFFFFF


def policy_check(revision: int, min_bytes: int, priority: int) -> int:
    """Ties a policy request to its revision so a half-written one is never acted on."""
    raw = U64.pack(revision) + I64.pack(min_bytes) + I64.pack(priority)
    return (zlib.crc32(raw) | (revision << 32)) & 0xFFFFFFFFFFFFFFFF


def reclaim_check(seq: int, want_bytes: int, asker: int) -> int:
    """Ties a reclaim request to its sequence number."""
    raw = U64.pack(seq) + U64.pack(want_bytes) + U64.pack(asker)
    return (zlib.crc32(raw) | (seq << 32)) & 0xFFFFFFFFFFFFFFFF


def model_id(pid: int, name: str) -> int:
    """A model's id in reclaim records (the asker a donor gave to): its pid and a hash of its name."""
    return ((pid & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode())


RANK = struct.Struct("<iiqQQQQQQ")  # rank, device, pid, start_time, mapped_bytes, acked_seq, flags, 2 spare
RANK_FIELDS = ("rank", "device", "pid", "start_time", "mapped_bytes", "acked_seq", "flags")
RANK_LOST = 1  # flags: the scheduler lost this rank (it hung up, erred or missed its timeout)

MAX_PAGES = 1 << 20  # page ids per segment: a 4 MiB page map (2 TiB per range at 2 MiB pages); allocators
# refuse more and readers take a header claiming more for damaged, so no reader holds more than this


def limit_problem(limit_bytes: object) -> str | None:
    """Why ``limit_bytes`` cannot be a limit (an int in 0..MAX_LIMIT_BYTES, or None); None when it can."""
    if limit_bytes is None:
        return None
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool):
        return f"a limit is a whole number of bytes, not {limit_bytes!r}"
    if limit_bytes < 0:
        return "a limit cannot be negative"
    if limit_bytes > MAX_LIMIT_BYTES:
        return f"a limit of {limit_bytes} bytes is beyond the largest a segment holds (2^63-1, 8 EiB); use none for no limit"
    return None


# limit_status values, as written by the allocator.
LIMIT_NONE, LIMIT_APPLIED, LIMIT_DEFERRED, LIMIT_CONFLICT = 0, 1, 2, 3
LIMIT_STATUS_NAMES = {LIMIT_NONE: "none", LIMIT_APPLIED: "applied", LIMIT_DEFERRED: "deferred",
                      LIMIT_CONFLICT: "conflict"}

# One u32 per page: bit 31 mapped, bits 15..29 cached blocks, bits 0..14 used blocks.
PAGE_MAPPED = 1 << 31
PAGE_FIELD_MASK = 0x7FFF
PAGE_CACHED_SHIFT = 15
MAX_BLOCKS_PER_PAGE = PAGE_FIELD_MASK

# Legacy (upstream kvcached) segments: three little-endian int64: total/limit, used, prealloc.
LEGACY = struct.Struct("<qqq")
LEGACY_SIZE = LEGACY.size


def page_entry(mapped: bool, used: int, cached: int) -> int:
    return (PAGE_MAPPED if mapped else 0) | (cached << PAGE_CACHED_SHIFT) | used


def decode_page(entry: int) -> tuple[bool, int, int]:
    """(mapped, used blocks, cached blocks) of one page-map entry."""
    return bool(entry & PAGE_MAPPED), entry & PAGE_FIELD_MASK, (entry >> PAGE_CACHED_SHIFT) & PAGE_FIELD_MASK


def ranks_offset(pages_total: int) -> int:
    end = PAGE_MAP_OFF + 4 * pages_total
    return (end + 63) // 64 * 64


def total_size(pages_total: int, ranks_max: int) -> int:
    return ranks_offset(pages_total) + RANK.size * ranks_max


def counters_checksum(payload: bytes, seq: int) -> int:
    return zlib.crc32(payload) ^ (seq & 0xFFFFFFFF)


def limit_check(limit_bytes: int, revision: int) -> int:
    """Ties a limit value to its revision so a half-written control request is never applied."""
    return (zlib.crc32(I64.pack(limit_bytes) + U64.pack(revision)) | (revision << 32)) & 0xFFFFFFFFFFFFFFFF


def decode_text(raw: bytes) -> str:
    """A header string, as readers show it (see :func:`printable`)."""
    return printable(raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
