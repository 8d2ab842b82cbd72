"""How much KV a vLLM engine plans with under kvcached: its answer to vLLM's available-memory step.

vLLM sizes its cache once, at start, from its own share of the device: ``--gpu-memory-utilization`` of the
device less its weights and the peak of a profiling pass (on CPU, ``VLLM_CPU_KVCACHE_SPACE``). Under kvcached
that figure becomes the engine's span, the block ids vLLM may hand out; memory is mapped page by page, and
what bounds the engines of a device together is the shared budget (``KVCACHED_DEVICE_BUDGET``; on the host
``KVCACHED_HOST_CAPACITY``), checked at every growth beside the headroom and the engines' working memory.
So the span is the most this engine could ever hold beside its peers, not what was free when it started::

    room = total - headroom - weights - working peak - others - the peers' working memory to come
    span = min(budget, room, vLLM's explicit KV size)

``others`` is what the device holds beside this engine and kvcached's KV (the peers' weights and the working
memory they hold, CUDA contexts); the peers' working memory to come is what they registered and do not hold
yet. The peers' KV is not subtracted: it is the budget's, and a reclaim moves it between models. With ``free``
what the device has free now this is ``free + KV held - headroom - (peak - now) - peers' (peak - now)``, the
room the CUDA backend's growth rule leaves this engine, counted as if it held no KV and the peers none either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvcached_core import scan
from kvcached_core.settings import settings


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class Device:
    """One device as an engine sees it after its profiling pass (``backend`` host: the machine's RAM)."""

    backend: str  # kvcached's backend: cuda or host
    index: int
    total: int  # bytes of memory
    free: int  # free now, every process's use counted (cuMemGetInfo; on the host, MemAvailable)


@dataclass(frozen=True)
class Working:
    """An engine's memory beside its KV, measured around its profiling pass."""

    weights: int  # held before the pass: weights and buffers (on the host, the process's RSS)
    peak: int  # the pass's peak beyond ``weights``: activations, logits, workspaces
    now: int  # of ``peak``, what the process still holds after the pass (torch's cache keeps what it reached)

    @property
    def pending(self) -> int:
        """Working memory the engine will take again and does not hold now."""
        return max(0, self.peak - self.now)


@dataclass(frozen=True)
class Peers:
    """What the other kvcached engines of the device publish in their segments."""

    count: int
    kv_bytes: int  # KV pages they hold mapped on the device
    working_outstanding: int  # the working memory they registered and do not hold yet


def peers_on(device: Device, directory: Path | None = None) -> Peers:
    """The live kvcached models of ``device``'s backend (of that device for cuda; every one on the host)."""
    count = kv = outstanding = 0
    for model in scan(directory=directory, ours_only=True).models:
        if model.status != "live" or model.backend != device.backend:
            continue
        share = 1.0 if device.backend == "host" else model.device_share(device.index)
        if not share:
            continue
        count += 1
        kv += int(model.mapped_bytes * share)
        outstanding += model.working_outstanding
    return Peers(count, kv, outstanding)


@dataclass(frozen=True)
class Plan:
    """The span an engine plans with, and every figure it was taken from (see the module's docstring)."""

    span: int  # bytes of KV the engine plans with: what vLLM's available-memory step answers
    device: Device
    own: Working
    peers: Peers
    budget: int | None  # the shared budget; None: none set (the device is the budget)
    headroom: int
    cap: int | None  # vLLM's explicit KV size (--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE); None: not set

    @property
    def room(self) -> int:
        """What the device could give this engine's KV beside every engine's weights and working memory."""
        d = self.device
        peers = self.peers
        return d.free + peers.kv_bytes - self.headroom - self.own.pending - peers.working_outstanding

    @property
    def others(self) -> int:
        """What the device holds beside this engine and kvcached's KV."""
        d, own = self.device, self.own
        return max(0, d.total - d.free - self.peers.kv_bytes - own.weights - own.now)

    @property
    def bound(self) -> str:
        """Which term set the span: budget, device or explicit size."""
        if self.cap is not None and self.span == self.cap:
            return "explicit size"
        return "budget" if self.budget is not None and self.span == self.budget else "device"

    def describe(self) -> str:
        """One line for the engine's log."""
        d, own = self.device, self.own
        budget = _gib(self.budget) if self.budget is not None else "none"
        cap = f", explicit {_gib(self.cap)}" if self.cap is not None else ""
        where = "host" if d.backend == "host" else f"{d.backend} {d.index}"
        return (f"kvcached: KV span {_gib(self.span)} ({self.bound}) = min(budget {budget}, room {_gib(self.room)}"
                f"{cap}); room = {where} total {_gib(d.total)} - headroom {_gib(self.headroom)} - "
                f"weights {_gib(own.weights)} - working peak {_gib(own.peak)} - others {_gib(self.others)} - "
                f"peers' working memory to come {_gib(self.peers.working_outstanding)} ({self.peers.count} peers; "
                f"their KV {_gib(self.peers.kv_bytes)} is the budget's)")


def plan(device: Device, own: Working, peers: Peers, *, budget: int | None, headroom: int,
         cap: int | None = None) -> Plan:
    """The span from figures already measured (see :func:`plan_for`)."""
    draft = Plan(0, device, own, peers, budget, headroom, cap)
    span = min(x for x in (draft.room, budget, cap) if x is not None)
    return Plan(max(0, span), device, own, peers, budget, headroom, cap)


def plan_for(device: Device, own: Working, *, cap: int | None = None, directory: Path | None = None) -> Plan:
    """The span of an engine on ``device``: its peers read from the segments, the budget and the headroom from
    the settings (``KVCACHED_DEVICE_BUDGET`` and ``KVCACHED_DEVICE_HEADROOM`` on a GPU; ``KVCACHED_HOST_CAPACITY``
    and no headroom on the host, whose budget keeps its own margin of RAM)."""
    cfg = settings()
    if device.backend == "host":
        budget: int | None = cfg.host_capacity_bytes
        headroom = 0
    else:
        budget = cfg.device_budget.of(device.total) if cfg.device_budget is not None else None
        headroom = cfg.device_headroom.of(device.total)
    peers = peers_on(device, directory if directory is not None else cfg.shm_dir)
    return plan(device, own, peers, budget=budget, headroom=headroom, cap=cap)
