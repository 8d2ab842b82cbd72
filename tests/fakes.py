"""kvtop's deterministic fake source, for the snapshot and pilot tests: scripted scans replayed one per refresh.

A :class:`FakeSource` draws the same screen from the same script every time; :func:`sample_fleet` is a fleet
that shows every state kvtop draws (live, stale, shrinking, legacy, a model of 100k pages, a reclaim).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import kvcached_core as kc
from kvcached_core.backends.nvml import GpuInfo
from kvcached_core.interop.legacy import limit_status as legacy_limit_status
from kvcached_core.segment.layout import model_id
from kvcached_core.segment.pagemap import count_pages, page_entry
from kvcached_core.segment.snapshot import ModelSnapshot, PressureInfo, Problem
from kvtop.frames.source import Frame

FAKE_T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
KiB, MiB, GiB = 1024, 1024**2, 1024**3


def fake_pages(total: int, *, inuse: int, reserved: int, bpp: int, cached_pages: int = 0,
               seed: int = 0, fill: float = 0.6) -> array:
    """A deterministic page map: ``inuse`` scattered in-use pages (some cached-only), then reserved ones."""
    rng = random.Random(seed)
    pages = array("I", bytes(4 * total))
    spread = min(total, max(inuse + reserved, int((inuse + reserved) * 1.6)))
    slots = rng.sample(range(spread), inuse + reserved)
    for i, page in enumerate(slots):
        if i < inuse:
            used = max(1, min(bpp, round(rng.gauss(fill, 0.3) * bpp)))
            cached = used if i < cached_pages else 0
            pages[page] = page_entry(True, used, cached)
        else:
            pages[page] = page_entry(True, 0, 0)
    return pages


def fake_model(name: str, *, pages: array | None = None, pages_total: int = 512, engine: str = "vllm",
               backend: str = "host", pid: int = 4242, device: int = 0, status: str = "live",
               page_size: int = 2 * MiB, block_bytes: int = 256 * KiB, num_layers: int = 32,
               limit_bytes: int | None = None, limit_status: str | None = None,
               requested_limit: int | None = None, revision: int = 0, alloc_blocks: int = 0,
               device_capacity: int = 0, read_ns: int = 0, legacy: tuple[int, int, int] | None = None,
               trim_ack_seq: int = 0, trim_bytes: int = 0, pressure: PressureInfo | None = None) -> ModelSnapshot:
    """A ModelSnapshot whose counters agree with its page map (``legacy``: total, used, prealloc)."""
    if legacy is not None:
        total, used, prealloc = legacy
        return ModelSnapshot(
            name=name, path=f"/dev/shm/{name}", model=name, engine=engine, backend="kvcached", pid=pid,
            uid=1000, device=device, status="legacy", page_size=0, block_bytes=0, num_layers=0,
            num_kv_buffers=0, blocks_per_page=0, num_blocks=0, pages_total=0, pages_inuse=0,
            pages_reserved=0, blocks_used=0, blocks_cached=0, mapped_bytes=used + prealloc,
            limit_bytes=total, limit_status=legacy_limit_status(total, used),
            legacy_reserved=prealloc, read_ns=read_ns, legacy=True)
    bpp = page_size // block_bytes
    if pages is None:
        pages = array("I", bytes(4 * pages_total))
    counts = count_pages(pages)
    inuse, reserved, used, cached = counts.inuse, counts.reserved, counts.blocks_used, counts.blocks_cached
    bundle = page_size * num_layers * 2
    status_name = limit_status or ("none" if limit_bytes is None else "applied")
    return ModelSnapshot(
        name=name, path=f"/dev/shm/kvc.{name}", model=name, engine=engine, backend=backend, pid=pid,
        uid=1000, device=device, status=status, page_size=page_size, block_bytes=block_bytes,
        num_layers=num_layers, num_kv_buffers=2, blocks_per_page=bpp, num_blocks=len(pages) * bpp,
        pages_total=len(pages), pages_inuse=inuse, pages_reserved=reserved, blocks_used=used,
        blocks_cached=cached, mapped_bytes=(inuse + reserved) * bundle, limit_bytes=limit_bytes,
        limit_status=status_name, requested_limit=requested_limit if requested_limit is not None else limit_bytes,
        limit_revision=revision, applied_revision=revision, alloc_count=alloc_blocks // 4,
        alloc_blocks=alloc_blocks, read_ns=read_ns, heartbeat_ns=read_ns, updated_ns=read_ns,
        device_capacity=device_capacity, pages=pages, trim_seq=trim_ack_seq, trim_ack_seq=trim_ack_seq,
        trim_bytes=trim_bytes, pressure=pressure if pressure is not None else fake_pressure())


def fake_pressure(**figures: int | float) -> PressureInfo:
    """A model's policy and reclaim figures: none given, none taken, priority 0, unless ``figures`` say so."""
    values: dict = dict.fromkeys(PressureInfo.__dataclass_fields__, 0)
    values.update(can_give_cached=True, given_took_s=0.0, latency_s=0.0)
    values.update(figures)
    return PressureInfo(**values)


@dataclass
class FakeSource:
    """Replays scripted scans, then holds the last one: the same input always draws the same screen.

    ``script`` holds one tuple of models per refresh (each model carries its page map); after the
    last one every read returns that last scan again, so history and events stop changing.
    Control requests are recorded in ``requests`` and acknowledged at once.
    """

    script: Sequence[tuple[ModelSnapshot, ...]]
    gpus: tuple[GpuInfo, ...] = ()
    gpu_note: str = "NVML unavailable: NVML Shared Library Not Found"
    host_capacity: int = 64 * GiB
    host: str = "fakehost"
    start: float = FAKE_T0
    step: float = 1.0
    problems: tuple[Problem, ...] = ()
    requests: list[tuple[str, str, int | None]] = field(default_factory=list)
    reads: int = 0

    def __post_init__(self) -> None:
        if not self.script:
            self.script = [()]

    @property
    def done(self) -> bool:
        """True once the whole script has been read."""
        return self.reads >= len(self.script)

    @property
    def final_at(self) -> float:
        """The ``taken_at`` of the last scripted scan (and of every read after it): a frame taken then is
        the one the screen holds from now on."""
        return self.start + (len(self.script) - 1) * self.step

    def read(self, selected: str | None) -> Frame:
        index = min(self.reads, len(self.script) - 1)
        self.reads += 1
        at = self.start + index * self.step
        models = tuple(replace(m, read_ns=int(at * 1e9), heartbeat_ns=int(at * 1e9), pages=None)
                       for m in self.script[index])
        detail = None
        for full in self.script[index]:
            if full.name == selected:
                detail = replace(full, read_ns=int(at * 1e9), heartbeat_ns=int(at * 1e9))
        return Frame(models, self.problems, self.gpus, "" if self.gpus else self.gpu_note,
                     self.host_capacity, detail, at, self.host)

    def reread(self, model: ModelSnapshot) -> ModelSnapshot:
        """The model as the last scan read holds it (reading again does not advance the script)."""
        index = min(max(self.reads - 1, 0), len(self.script) - 1)
        return next((m for m in self.script[index] if m.name == model.name), model)

    def trim(self, model: ModelSnapshot, wait: float) -> kc.Ack:
        self.requests.append(("trim", model.name, None))
        return kc.Ack(model.name, "trim", "trimmed", len(self.requests), model.limit_bytes,
                      bytes_returned=model.reserved_bytes)

    def compact(self, model: ModelSnapshot, wait: float) -> kc.Ack:
        self.requests.append(("compact", model.name, None))
        return kc.Ack(model.name, "compact", "compacted", len(self.requests), model.limit_bytes)

    def sleep(self, model: ModelSnapshot, action: str, wait: float) -> kc.Ack:
        self.requests.append((action, model.name, None))
        return kc.Ack(model.name, action, "asleep" if action == "sleep" else "awake", len(self.requests),
                      model.limit_bytes, bytes_returned=model.mapped_bytes if action == "sleep" else 0)

    def policy(self, model: ModelSnapshot, min_bytes: int | None | object, priority: int | object,
               wait: float) -> kc.Ack:
        self.requests.append(("policy", model.name, None))
        return kc.Ack(model.name, "policy", "applied", len(self.requests), model.limit_bytes)

    def limit(self, model: ModelSnapshot, limit_bytes: int | None, wait: float) -> kc.Ack:
        self.requests.append(("limit", model.name, limit_bytes))
        status = "none" if limit_bytes is None else "deferred" if limit_bytes < model.pinned_bytes else "applied"
        return kc.Ack(model.name, "limit", status, len(self.requests), limit_bytes)

    def close(self) -> None:
        """Nothing to release: the fake holds no segment and no NVML handle (the Source protocol asks for it)."""


def sample_fleet(*, gpus: bool = False, big_pages: int = 100_000, steps: int = 6) -> FakeSource:
    """A fleet that shows every state: live, stale, shrinking, legacy and a model with 100k pages.

    ``steps`` refreshes, one second apart: llama grows, qwen sheds pages under a deferred limit,
    mistral goes stale at step 3, qwen's second limit revision is acknowledged at step 4 and
    deepseek is trimmed at step 5, so the sparklines and the event log have something to say.
    Under the shared budget llama (min 8 GiB, priority 10) waits for memory from step 3; at step 4
    deepseek (priority -5) gives it 48 MiB of cached and reserved pages, and llama still waits.
    """
    bpp = 8
    mistral_pages = fake_pages(384, inuse=90, reserved=0, bpp=bpp, seed=3)
    big = fake_pages(big_pages, inuse=big_pages * 6 // 25, reserved=10, bpp=bpp, cached_pages=big_pages * 3 // 100,
                     seed=4, fill=0.8)
    llama = [fake_pages(768, inuse=150 + 30 * i, reserved=10, bpp=bpp, cached_pages=40, seed=1) for i in range(steps)]
    qwen = [fake_pages(512, inuse=130 - 2 * i, reserved=6, bpp=bpp, seed=2, fill=0.3) for i in range(steps)]
    backend, capacity = ("cuda", 140 * GiB) if gpus else ("host", 128 * GiB)
    bundle = 2 * MiB * 32 * 2  # page bundle of a 32-layer K/V model
    qwen_limit = 100 * bundle

    reclaim = step_pressure(steps)

    def fleet(step: int) -> tuple[ModelSnapshot, ...]:
        return (
            fake_model("llama-3-8b", pages=llama[step], engine="vllm", pid=1201, backend=backend,
                       device_capacity=capacity, alloc_blocks=9000 + 1500 * step, pressure=reclaim[step][0]),
            fake_model("qwen2-7b", pages=qwen[step], engine="sglang", pid=1202, backend=backend,
                       device=1 if gpus else 0, device_capacity=capacity,
                       limit_bytes=qwen_limit, limit_status="deferred", revision=1 + (step >= 4),
                       alloc_blocks=4000 + 200 * step),
            fake_model("mistral-7b", pages=mistral_pages, engine="vllm", pid=1203, backend=backend,
                       status="live" if step < 3 else "stale", device_capacity=capacity,
                       alloc_blocks=3000 + 100 * min(step, 2)),
            fake_model("deepseek-v3-100k", pages=big, engine="custom", pid=1204, backend=backend,
                       page_size=256 * KiB, block_bytes=32 * KiB, num_layers=2, device_capacity=capacity,
                       alloc_blocks=150_000 + 8000 * step, trim_ack_seq=int(step >= 5),
                       trim_bytes=12 * MiB if step >= 5 else 0, pressure=reclaim[step][1]),
            fake_model("kvcached_vllm_3311", legacy=(24 * GiB, 10 * GiB, 2 * GiB), engine="vllm", pid=3311),
        )

    def on_gpus(step: int) -> tuple[ModelSnapshot, ...]:
        """Each allocator keeps 5% of its H200 free; llama's engine registered a working peak it holds half of."""
        working = {"llama-3-8b": {"working_peak": 8 * GiB, "working_now": 4 * GiB}}
        return tuple(m if m.legacy else replace(m, device_headroom=7 * GiB, **working.get(m.name, {}))
                     for m in fleet(step))

    gpu_infos: tuple[GpuInfo, ...] = ()
    if gpus:
        gpu_infos = (
            GpuInfo(0, "NVIDIA H200", "GPU-0", 140 * GiB, 100 * GiB, 40 * GiB, {1201: 40 * GiB, 3311: 12 * GiB}),
            GpuInfo(1, "NVIDIA H200", "GPU-1", 140 * GiB, 30 * GiB, 110 * GiB, {1202: 16 * GiB}),
        )
    return FakeSource([(on_gpus if gpus else fleet)(i) for i in range(steps)], gpus=gpu_infos, host_capacity=capacity)


def step_pressure(steps: int) -> list[tuple[PressureInfo, PressureInfo]]:
    """The sample fleet's reclaim story, per step: (llama, the asker; deepseek, the donor)."""
    out = []
    for step in range(steps):
        wanted = 0 if step < 3 else 112 * MiB if step < 4 else 64 * MiB
        took = step >= 4
        asker = fake_pressure(min_bytes=8 * GiB, priority=10, policy_revision=1, wanted_bytes=wanted,
                              asked_count=int(step >= 3), took_total=48 * MiB if took else 0, took_count=int(took),
                              latency_s=0.012 if took else 0.0)
        donor = fake_pressure(priority=-5, policy_revision=1, reclaim_acked_seq=int(took), gave_count=int(took),
                              gave_total=48 * MiB if took else 0, given_bytes=48 * MiB if took else 0,
                              given_cached=40 * MiB if took else 0, given_reserved=8 * MiB if took else 0,
                              given_took_s=0.012 if took else 0.0, given_to=model_id(1201, "llama-3-8b") if took else 0)
        out.append((asker, donor))
    return out
