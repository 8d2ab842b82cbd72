"""Prometheus exporter: every model's segment, plus NVML device memory, as metrics.

A :class:`KVCachedCollector` reads :func:`kvcached_core.scan` and :func:`kvcached_core.backends.nvml.probe`
on each scrape, or, with ``interval``, a background thread refreshes a cached copy every
``interval`` seconds and scrapes serve that copy (cheap scrapes however often Prometheus
comes). Models that vanish simply stop being emitted. Per-model series carry the labels
``model`` (the segment name, unique on a host), ``engine``, ``device``, ``pid`` and ``host``.

Memory pressure between the models of one budget (issue 30) is exported per model: its policy
(``min``, ``priority``), the bytes it gave and took and the reclaims it answered and asked
(counters), the bytes it waits for and its last reclaim's latency; a model whose pressure block
is unknown (upstream segments, words that cannot be true) has none of these samples.

Allocation and free rates are computed from the segment's ``alloc_count``/``free_count``
between two observations of the same process; a model seen once has no rate yet. The raw
counts are exported too, as counters, so ``rate()`` in PromQL works as usual.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

import kvcached_core
from kvcached_core import ModelSnapshot, nvml
from kvtop.serve.http_page import Page, PageServer

PREFIX = "kvcached"
MODEL_LABELS = ("model", "engine", "device", "pid", "host")
LIMIT_STATUSES = ("none", "applied", "deferred", "conflict", "stale", "written", "pending", "unknown")
PAGE_STATES = ("inuse", "reserved", "free")


@dataclass
class _Seen:
    """The last observation of one process's counters, for rates."""

    alloc_count: int
    free_count: int
    at: float


class KVCachedCollector(Collector):
    """Builds the metric families from one scan of the segment directory (and one NVML probe)."""

    def __init__(self, host: str | None = None, *, with_nvml: bool = True) -> None:
        self.host = host or socket.gethostname()
        self.with_nvml = with_nvml
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, int], _Seen] = {}
        self.builds = 0  # full builds made

    def collect(self) -> Iterator[Metric]:
        yield from self.build()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on what is running: never collect at registration

    def build(self) -> list[Metric]:
        """One full set of metric families, read now."""
        self.builds += 1
        started = time.monotonic()
        scan = kvcached_core.scan()
        now = time.monotonic()
        families = self._model_families(scan.models, now)
        families += self._scan_families(scan, time.monotonic() - started)
        families += self._router_families(scan.models)
        if self.with_nvml:
            families += self._nvml_families()
        return families

    # -- per model ---------------------------------------------------------------------------
    def _rates(self, m: ModelSnapshot, now: float) -> tuple[float, float] | None:
        key = (m.path, m.pid, m.start_time)
        with self._lock:
            last = self._seen.get(key)
            self._seen[key] = _Seen(m.alloc_count, m.free_count, now)
        if last is None or now <= last.at:
            return None
        da, df = m.alloc_count - last.alloc_count, m.free_count - last.free_count
        if da < 0 or df < 0:  # counters went back: a different process behind the same key
            return None
        return da / (now - last.at), df / (now - last.at)

    def _forget_vanished(self, models: tuple[ModelSnapshot, ...]) -> None:
        present = {(m.path, m.pid, m.start_time) for m in models}
        with self._lock:
            for key in [k for k in self._seen if k not in present]:
                del self._seen[key]

    def _model_families(self, models: tuple[ModelSnapshot, ...], now: float) -> list[Metric]:
        def gauge(name: str, doc: str, extra: tuple[str, ...] = (), unit: str = "") -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=(*MODEL_LABELS, *extra), unit=unit)

        info = gauge("model_info", "Identity of a model's segment (value 1).",
                     ("served_model", "backend", "status"))
        mapped = gauge("mapped_bytes", "Device bytes mapped for the model's KV cache (in use + reserved pages).")
        held = gauge("held_bytes", "Bytes of KV blocks in use (active + cached).")
        pinned = gauge("pinned_bytes", "Bytes of pages holding at least one used block.")
        reserved = gauge("reserved_bytes", "Bytes of mapped pages without a used block (the warm pool).")
        cached = gauge("cached_bytes", "Bytes of blocks held by the prefix cache (evictable).")
        capacity = gauge("virtual_bytes", "Bytes of the model's whole virtual KV range.")
        limit = gauge("limit_bytes", "Effective limit on mapped bytes; absent when the model has no limit.")
        requested = gauge("requested_limit_bytes", "Limit last requested by a controller; absent when none.")
        status = gauge("limit_status", "1 for the model's current limit status, 0 for the others.", ("status",))
        waste = gauge("waste_ratio", "pinned / held bytes (1.0 is ideal); absent while nothing is held.")
        pages = gauge("pages", "Page ids by state: inuse, reserved (mapped, empty) and free (unmapped).", ("state",))
        alloc_rate = gauge("alloc_rate", "alloc() calls per second since the previous observation.")
        free_rate = gauge("free_rate", "free() calls per second since the previous observation.")
        allocs = CounterMetricFamily(f"{PREFIX}_allocs", "alloc() calls since the allocator started.",
                                     labels=MODEL_LABELS)
        frees = CounterMetricFamily(f"{PREFIX}_frees", "free() calls since the allocator started.",
                                    labels=MODEL_LABELS)
        age = gauge("heartbeat_age_seconds", "Seconds since the allocator's last heartbeat.")
        figures_age = gauge("figures_age_seconds", "How old the model's figures are: 0 while they are read now; "
                            "else its process stays inside a publish (stopped: the model is late) and they are "
                            "its last known.")
        rank_labels = ("model", "rank", "device", "pid", "host")
        rank_mapped = GaugeMetricFamily(f"{PREFIX}_rank_mapped_bytes",
                                        "Bytes one tensor-parallel rank has mapped for its shard of the model.",
                                        labels=rank_labels)
        rank_up = GaugeMetricFamily(f"{PREFIX}_rank_up", "1 while a tensor-parallel rank's process runs, else 0.",
                                    labels=rank_labels)
        stale = gauge("stale", "1 when the allocator's process is gone (a stopped one is late, not stale), else 0.")
        running = gauge("requests_running", "Requests the engine is running now (engines that publish traffic).")
        waiting = gauge("requests_waiting", "Requests waiting in the engine's queue (engines that publish traffic).")
        idle = gauge("idle_seconds", "Seconds since the engine's last request arrived.")
        sleep_state = gauge("sleep_state", "1 for the model's sleep state (awake, draining, asleep), 0 for the others.",
                            ("state",))
        after_idle = gauge("sleep_after_idle_seconds", "The after-idle sleep policy; absent when there is none.")
        slept = gauge("slept_bytes", "Bytes the model's last sleep released.")
        pressure = PressureFamilies(gauge)
        headroom = gauge("device_headroom_bytes", "Device bytes the model's KV growth leaves free "
                         "(KVCACHED_DEVICE_HEADROOM); absent where none (the host backend).")
        working_peak = gauge("working_peak_bytes", "The engine's registered working-memory peak beside weights and "
                             "KV (activations, masks, logits); absent when none is registered.")
        working_now = gauge("working_now_bytes", "Of that peak, what the engine's process holds now; the device's "
                            "allocators keep the rest free for it.")
        group_blocks = gauge("group_blocks", "Blocks of one of the engine's KV cache groups, by state (active, "
                             "cached); absent for engines that publish no groups.", ("group", "shape", "state"))
        group_pages = gauge("group_pages", "Pages holding any block of one of the engine's KV cache groups.",
                            ("group", "shape"))
        traffic_counters = [
            (field, CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=MODEL_LABELS))
            for field, name, doc in (
                ("finished", "requests_finished", "Requests that left the engine (finished or aborted)."),
                ("prompt_tokens", "prompt_tokens", "Prompt tokens of the requests that arrived."),
                ("generated_tokens", "generated_tokens", "Tokens the engine generated."),
                ("preemptions", "preemptions", "Requests preempted (recomputed later), mostly for lack of KV blocks."),
            )
        ]

        for m in models:
            labels = [m.name, m.engine, str(m.device), str(m.pid), self.host]
            legacy = m.legacy
            info.add_metric([*labels, m.model, m.backend, m.display_status], 1)
            mapped.add_metric(labels, m.mapped_bytes)
            held.add_metric(labels, m.held_bytes)
            pinned.add_metric(labels, m.pinned_bytes)
            reserved.add_metric(labels, m.reserved_bytes)
            if m.cached_bytes is not None:
                cached.add_metric(labels, m.cached_bytes)
            if m.limit_bytes is not None:
                limit.add_metric(labels, m.limit_bytes)
            if m.requested_limit is not None:
                requested.add_metric(labels, m.requested_limit)
            current = m.limit_status if m.limit_status in LIMIT_STATUSES else "unknown"
            for name in LIMIT_STATUSES:
                status.add_metric([*labels, name], 1 if name == current else 0)
            if m.waste_ratio is not None:
                waste.add_metric(labels, m.waste_ratio)
            if legacy:  # upstream segments carry bytes only: no pages, counters or heartbeat
                stale.add_metric(labels, 1 if m.status == "stale" else 0)
                continue
            capacity.add_metric(labels, m.virtual_bytes)
            for state, value in zip(PAGE_STATES, (m.pages_inuse, m.pages_reserved, m.pages_free), strict=True):
                pages.add_metric([*labels, state], value)
            allocs.add_metric(labels, m.alloc_count)
            frees.add_metric(labels, m.free_count)
            rates = self._rates(m, now)
            if rates is not None:
                alloc_rate.add_metric(labels, rates[0])
                free_rate.add_metric(labels, rates[1])
            age.add_metric(labels, max(0.0, (m.read_ns - m.heartbeat_ns) / 1e9))
            figures_age.add_metric(labels, m.figures_age_s or 0.0)
            stale.add_metric(labels, 1 if m.status == "stale" else 0)
            if m.traffic is not None:
                running.add_metric(labels, m.traffic.running)
                waiting.add_metric(labels, m.traffic.waiting)
                if m.traffic.idle_s is not None:
                    idle.add_metric(labels, m.traffic.idle_s)
                for field, family in traffic_counters:
                    family.add_metric(labels, getattr(m.traffic, field))
            if m.sleep is not None:
                for name in ("awake", "draining", "asleep"):
                    sleep_state.add_metric([*labels, name], 1 if m.sleep.state == name else 0)
                if m.sleep.after_idle_s is not None:
                    after_idle.add_metric(labels, m.sleep.after_idle_s)
                if m.sleep.state != "unknown":  # words that cannot be true: no figure, no state is 1
                    slept.add_metric(labels, m.sleep.slept_bytes)
            pressure.add(labels, m)
            if m.device_headroom:
                headroom.add_metric(labels, m.device_headroom)
            if m.working_peak or m.working_now:
                working_peak.add_metric(labels, m.working_peak)
                working_now.add_metric(labels, m.working_now)
            for i, g in enumerate(m.groups or ()):
                group_blocks.add_metric([*labels, str(i), g.label, "active"], g.blocks_active)
                group_blocks.add_metric([*labels, str(i), g.label, "cached"], g.blocks_cached)
                group_pages.add_metric([*labels, str(i), g.label], g.pages)
            for r in m.ranks:
                rank_row = [m.name, str(r.rank), str(r.device), str(r.pid), self.host]
                rank_mapped.add_metric(rank_row, r.mapped_bytes)
                rank_up.add_metric(rank_row, 1 if r.alive else 0)
        self._forget_vanished(models)
        return [info, mapped, held, pinned, reserved, cached, capacity, limit, requested, status, waste,
                pages, alloc_rate, free_rate, allocs, frees, age, figures_age, stale, rank_mapped, rank_up, running,
                waiting, idle,
                *(family for _, family in traffic_counters), sleep_state, after_idle, slept, *pressure.families(),
                headroom, working_peak, working_now, group_blocks, group_pages]

    # -- the scan itself and the devices -----------------------------------------------------
    def _scan_families(self, scan: kvcached_core.Scan, seconds: float) -> list[Metric]:
        models = GaugeMetricFamily(f"{PREFIX}_models", "Segments found, by status.", labels=("host", "status"))
        for state in ("live", "stale", "legacy"):
            models.add_metric([self.host, state], sum(1 for m in scan.models if m.status == state))
        problems = GaugeMetricFamily(f"{PREFIX}_segment_problems",
                                     "Files in the segment directory that are not usable segments, by kind.",
                                     labels=("host", "status"))
        for kind in ("corrupt", "foreign", "unreadable", "busy"):
            problems.add_metric([self.host, kind], sum(1 for p in scan.problems if p.status == kind))
        duration = GaugeMetricFamily(f"{PREFIX}_scan_duration_seconds", "Time the last scan took.",
                                     labels=("host",))
        duration.add_metric([self.host], seconds)
        return [models, problems, duration]

    def _router_families(self, models: tuple[ModelSnapshot, ...]) -> list[Metric]:
        """What a running kvctl route counted per model (kvtop.serve.router.published), beside the engines' own figures."""
        from kvcached_core.settings import settings
        from kvtop.serve.router.published import read as read_routers

        found = read_routers(settings().shm_dir)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_router_{name}", doc, labels=MODEL_LABELS)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_router_{name}", doc, labels=(*MODEL_LABELS, *extra))

        requests = counter("requests", "Requests kvctl route passed to the model since the router started.")
        errors = counter("errors", "Of those, the ones answered with a status of 400 or more.")
        wakes = counter("wakes", "Requests kvctl route woke the model for (it was asleep or draining).")
        in_flight = gauge("in_flight", "Requests kvctl route passed to the model and not yet answered in full.")
        ttft = gauge("ttft_seconds", "Time to first token of streamed requests at the router, over the last 1024.",
                     ("quantile",))
        latency = gauge("latency_seconds", "Request to the last byte at the router, over the last 1024.",
                        ("quantile",))
        untrusted = GaugeMetricFamily(f"{PREFIX}_router_untrusted_files",
                                      "Router figure files in the segment directory that are not trusted.",
                                      labels=("host",))
        untrusted.add_metric([self.host], len(found.untrusted))
        for m in models:
            figures = found.models.get(m.name)
            if figures is None:
                continue
            labels = [m.name, m.engine, str(m.device), str(m.pid), self.host]
            requests.add_metric(labels, figures["requests"])
            errors.add_metric(labels, figures["errors"])
            wakes.add_metric(labels, figures["woken"])
            in_flight.add_metric(labels, figures["in_flight"])
            for family, key in ((ttft, "ttft"), (latency, "latency")):
                for quantile in ("50", "99"):
                    value = figures[f"{key}_p{quantile}_s"]
                    if value is not None:
                        family.add_metric([*labels, f"0.{quantile}"], value)
        return [requests, errors, wakes, in_flight, ttft, latency, untrusted]

    def _nvml_families(self) -> list[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_nvml_up", "1 when NVML answered, else 0.", labels=("host",))
        gpus = nvml.probe()
        up.add_metric([self.host], 1 if nvml.available() else 0)
        labels = ("device", "gpu", "uuid", "host")
        total = GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "Device memory (NVML).", labels=labels)
        used = GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "Device memory in use (NVML).", labels=labels)
        free = GaugeMetricFamily(f"{PREFIX}_gpu_memory_free_bytes", "Device memory free (NVML).", labels=labels)
        procs = GaugeMetricFamily(f"{PREFIX}_gpu_process_memory_bytes",
                                  "Device memory used by one process (NVML), when the driver reports it.",
                                  labels=("device", "pid", "host"))
        for gpu in gpus:
            lab = [str(gpu.index), gpu.name or "", gpu.uuid or "", self.host]
            for family, value in ((total, gpu.total_bytes), (used, gpu.used_bytes), (free, gpu.free_bytes)):
                if value is not None:
                    family.add_metric(lab, value)
            for pid, nbytes in gpu.processes.items():
                if nbytes is not None:
                    procs.add_metric([str(gpu.index), str(pid), self.host], nbytes)
        return [up, total, used, free, procs]


class PressureFamilies:
    """The per-model pressure metrics: policy, reclaim counters, bytes wanted, last latency."""

    def __init__(self, gauge: Callable[[str, str], GaugeMetricFamily]) -> None:
        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=MODEL_LABELS)

        self.min = gauge("min_bytes", "Bytes never reclaimed from the model by another one's pressure (0: none).")
        self.priority = gauge("priority", "Who gives first when the device's budget is short: the lowest.")
        self.given = counter("reclaim_given_bytes", "Bytes the model gave to other models' reclaims.")
        self.taken = counter("reclaim_taken_bytes", "Bytes other models gave the model in its reclaims.")
        self.answered = counter("reclaims_answered", "Reclaim requests of other models the model answered.")
        self.asked = counter("reclaims_asked", "Reclaim requests the model wrote to other models.")
        self.wanted = gauge("wanted_bytes", "Bytes a refused growth of the model waits for now (0: none).")
        self.latency = gauge("reclaim_latency_seconds", "The model's last reclaim, from the refused growth to the "
                             "bytes given; absent until one gave it memory.")

    def add(self, labels: list[str], m: ModelSnapshot) -> None:
        p = m.pressure
        if p is None:  # unknown: no sample, never a zero that reads as a figure
            return
        for family, figure in ((self.min, p.min_bytes), (self.priority, p.priority), (self.given, p.gave_total),
                               (self.taken, p.took_total), (self.answered, p.gave_count),
                               (self.asked, p.asked_count), (self.wanted, p.wanted_bytes)):
            family.add_metric(labels, figure)
        if p.took_count:
            self.latency.add_metric(labels, p.latency_s)

    def families(self) -> list[Metric]:
        return [self.min, self.priority, self.given, self.taken, self.answered, self.asked, self.wanted,
                self.latency]


class RefreshingCollector(Collector):
    """Serves the families a background thread rebuilds every ``interval`` seconds."""

    def __init__(self, source: KVCachedCollector, interval: float) -> None:
        if interval <= 0:
            raise ValueError("the refresh interval must be positive")
        self.source = source
        self.interval = interval
        self._families: list[Metric] = source.build()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvcached-exporter-refresh", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._families = self.source.build()  # one reference swap: scrapes never see half a set

    def collect(self) -> Iterator[Metric]:
        yield from self._families

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


INDEX = (b"<!doctype html><title>kvcached exporter</title><h1>kvcached exporter</h1>"
         b'<p>Prometheus metrics of every kvcached model on this host: <a href="/metrics">/metrics</a></p>\n')


def pages(registry: CollectorRegistry) -> dict[str, Page]:
    """``/metrics`` serves the metrics, ``/`` a small index that links there (anything else is 404).
    Scrapes that arrive together share one making of the page (:class:`kvtop.serve.http_page.PageServer`, served by
    aiohttp): 50 scrapers at once cost one or two reads of the segments, not 50."""
    return {
        "/metrics": Page("200 OK", CONTENT_TYPE_LATEST, lambda: generate_latest(registry)),
        "/": Page("200 OK", "text/html; charset=utf-8", lambda: INDEX),
    }


NOT_FOUND = Page("404 Not Found", "text/plain; charset=utf-8", lambda: b"not found: the metrics are at /metrics\n")


class Exporter:
    """A running HTTP endpoint; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 9400, interval: float | None = None,
                 *, with_nvml: bool = True, hostname: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.source = source = KVCachedCollector(hostname, with_nvml=with_nvml)
        self._refresher = RefreshingCollector(source, interval) if interval else None
        self.registry.register(self._refresher or source)
        try:
            self._server = PageServer(host, port, pages(self.registry), NOT_FOUND)
        except BaseException:
            if self._refresher:
                self._refresher.stop()
            raise
        self.host = host
        self.port = self._server.port
        self.backlog = self._server.backlog

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.close()
        if self._refresher:
            self._refresher.stop()

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
