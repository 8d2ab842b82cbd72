"""Reclaim under memory pressure: from a refused growth to the bytes available to the asker.

Two real processes share one budget (``KVCACHED_HOST_CAPACITY`` on the host backend;
``KVCACHED_DEVICE_BUDGET`` with ``backend="cuda"`` when a GPU is present, in both
``KVCACHED_CUDA_LAYOUT`` values). Every model is 64 page bundles of budget wide: 1 MiB a bundle
on the host (256 KiB pages, 2 layers, K and V), 8 MiB on CUDA (2 MiB pages); 4 blocks a page.

* The donor, a fresh process each round, maps all of the budget but 5 bundles and goes idle.
  ``reserved``: its blocks are active and its warm pool holds 8 bundles
  (``KVCACHED_MIN_RESERVED_PAGES=8``), so a reclaim takes reserved pages only. ``cached``: 2
  bundles of active blocks, the rest cached blocks (an engine's prefix cache) and no warm pool
  (``KVCACHED_MIN_RESERVED_PAGES=0``), so a reclaim takes whole cached pages through its engine's
  evict handler.
* The asker, a new allocator each round in a process of its own, maps its warm pool (5 bundles:
  the budget is then full), then asks for 8 pages' worth of blocks at once: the budget refuses.
  Timed from that refused ``alloc`` to the first ``alloc`` of the same size that succeeds, retried
  every millisecond as an engine's scheduler would retry each step. Beside it, the asker's own
  published ``pressure.latency_s`` (its refused growth to the donor's answer).

Growth (``growth``): a model that grows one page per alloc behind an idle donor whose cached blocks fill the
budget (``KVCACHED_HOST_CAPACITY=64MiB``, 2 MiB page bundles, no warm pool on either side, so each refused alloc
lacks one page). Timed from the asker's first alloc to its 18th page, each alloc retried every millisecond;
beside it the asks it wrote and its published latency. Each round runs both pacings, in turns: ``grown`` (an
ask answered in full lets the next go at once and ask twice as much) and ``fixed`` (every ask held the next
back ``REASK_S``: ``PressureControl.fixed_pace``, the pacing before). ``python -m benchmarks.reclaim
--growth`` prints every round and the medians.

The configurations take turns round by round (the order reversed every other round), so a slow
spell of the machine falls on all of them. CUDA rows are skipped, with the reason, without a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

from ._common import child_env, percentile, private_segments, stop

MiB = 1 << 20
BUDGET_PAGES = 64  # the shared budget, in page bundles
ASKER_POOL = 5  # the asker's warm pool (KVCACHED_MIN_RESERVED_PAGES' default): it fills the budget
DONOR_POOL = 8  # the reserved donor's warm pool: more than one reclaim asks of it
ASK_PAGES = 8  # the refused alloc: the asker's pool and 3 pages beyond the budget
CACHED_ACTIVE_PAGES = 2
RETRY_S = 0.001  # how often the asker retries its refused alloc
TARGET_P99_MS = 20.0


@dataclass(frozen=True)
class Config:
    backend: str  # host or cuda
    layout: str  # the CUDA layout ("" on the host)
    kind: str  # reserved or cached

    @property
    def label(self) -> str:
        where = "host" if self.backend == "host" else f"cuda {self.layout} layout"
        return f"{where}, {self.kind}"

    @property
    def page_size(self) -> int:
        return 256 * 1024 if self.backend == "host" else 2 * MiB

    def geometry(self) -> dict:
        return dict(num_blocks=4 * 2 * BUDGET_PAGES, block_bytes=self.page_size // 4, num_layers=2,
                    page_size=self.page_size)

    @property
    def bundle(self) -> int:
        return self.page_size * 4  # 2 layers, K and V

    def env(self, pool: int) -> dict[str, str]:
        budget = f"{BUDGET_PAGES * self.bundle // MiB}MiB"
        env = {"KVCACHED_HOST_CAPACITY": budget, "KVCACHED_DEVICE_BUDGET": budget,
               "KVCACHED_MIN_RESERVED_PAGES": str(pool), "KVCACHED_IDLE_RETURN_S": "-1"}
        if self.layout:
            env["KVCACHED_CUDA_LAYOUT"] = self.layout
        return env


DONOR = """
import sys, time
from kvcached_core import KVCacheManager
m = KVCacheManager("donor", name="donor", backend=BACKEND, **GEOMETRY)
active = m.alloc(ACTIVE)
cached = m.alloc(CACHED) if CACHED else []
assert active is not None and cached is not None, "the donor could not map its blocks"
if cached:
    m.mark_cached(cached)
    assert len(m.cache) == CACHED, "the prefix-cache budget evicted the donor's blocks"
m.set_evict_handler(lambda: m.evict_for_limit())
deadline = time.monotonic() + 30
while len(m.pages.reserved) < m.min_reserved and time.monotonic() < deadline:
    time.sleep(0.002)
print("READY", flush=True)
sys.stdin.readline()
m.close()
"""

ASKER = """
import json, sys, time
from kvcached_core import KVCacheManager

def measure(m):
    deadline = time.monotonic() + 30
    if not m.try_to_reserve(POOL * 4) or len(m.pages.reserved) != POOL:  # its warm pool: the budget is full
        return {"error": "the asker could not map its warm pool"}
    t0 = time.perf_counter()
    ids = m.alloc(ASK)
    refused = time.perf_counter() - t0
    if ids is not None:
        m.free(ids)
        return {"error": "the budget did not refuse the asker's alloc"}
    tries = 1
    while ids is None:
        if time.perf_counter() - t0 > 20:
            return {"error": "no alloc succeeded within 20 s"}
        time.sleep(RETRY_S)
        t1 = time.perf_counter()
        ids = m.alloc(ASK)
        tries += 1
    done = time.perf_counter()
    waited, last = done - t0, done - t1
    m.free(ids)
    while m.pressure.took_count == 0 and time.monotonic() < deadline:
        time.sleep(0.002)  # its refill thread counts what it took once the donor answered
    return {"ms": waited * 1e3, "tries": tries, "refused_ms": refused * 1e3, "last_ms": last * 1e3}

print("READY", flush=True)
for line in sys.stdin:
    m = KVCacheManager("asker", name="asker", backend=BACKEND, **GEOMETRY)
    try:
        print(json.dumps(measure(m)), flush=True)
        sys.stdin.readline()  # the parent read the segments
    finally:
        m.close()
    print("CLOSED", flush=True)
"""


def _spawn(code: str, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=child_env() | env, text=True, bufsize=1)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "READY":
        stop(proc)
        raise RuntimeError(f"benchmark child failed to start: {line!r}")
    return proc


def _code(template: str, config: Config, **values: object) -> str:
    code = template.replace("BACKEND", repr(config.backend)).replace("GEOMETRY", repr(config.geometry()))
    for key, value in values.items():
        code = code.replace(key, repr(value))
    return code


def _donor(config: Config) -> subprocess.Popen:
    if config.kind == "reserved":
        active, cached, pool = (BUDGET_PAGES - ASKER_POOL - DONOR_POOL) * 4, 0, DONOR_POOL
    else:
        active, cached, pool = CACHED_ACTIVE_PAGES * 4, (BUDGET_PAGES - ASKER_POOL - CACHED_ACTIVE_PAGES) * 4, 0
    return _spawn(_code(DONOR, config, ACTIVE=active, CACHED=cached), config.env(pool))


def _round(config: Config, asker: subprocess.Popen) -> dict:
    """One reclaim: a fresh donor, a new allocator in the asker's process; both segments read after."""
    from kvcached_core.segment.reader import snapshot

    donor = _donor(config)
    try:
        held = snapshot("donor", with_pages=False).mapped_bytes
        assert held == (BUDGET_PAGES - ASKER_POOL) * config.bundle, f"{config.label}: the donor maps {held} bytes"
        asker.stdin.write("round\n")  # type: ignore[union-attr]
        out = json.loads(asker.stdout.readline())  # type: ignore[union-attr]
        if "error" not in out:
            mine, gave = snapshot("asker", with_pages=False).pressure, snapshot("donor", with_pages=False).pressure
            assert mine is not None and gave is not None
            out.update(published_ms=mine.latency_s * 1e3, took=mine.took_total, asked=mine.asked_count,
                       reserved=gave.given_reserved, cached=gave.given_cached, gave_ms=gave.given_took_s * 1e3,
                       gave_count=gave.gave_count)
        asker.stdin.write("done\n")  # type: ignore[union-attr]
        assert asker.stdout.readline().strip() == "CLOSED"  # type: ignore[union-attr]
    finally:
        donor.stdin.close()  # type: ignore[union-attr]
        try:
            donor.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stop(donor)
    return out


def cuda_reason() -> str | None:
    """Why the CUDA rows cannot run here; None when they can."""
    from kvcached_core.backends import nvml

    if not nvml.available():
        return "needs an NVIDIA GPU: " + nvml.unavailable_reason()
    from kvcached_core.backends.base import BackendUnavailable
    from kvcached_core.backends.cuda import _load_driver

    try:
        _load_driver()
    except BackendUnavailable as exc:
        return str(exc)
    return None


def _configs(reason: str | None) -> list[Config]:
    found = [Config("host", "", kind) for kind in ("reserved", "cached")]
    if reason is None:
        found += [Config("cuda", layout, kind) for layout in ("layer", "page") for kind in ("reserved", "cached")]
    return found


def _ms(values: list[float], q: float) -> float:
    return percentile(sorted(values), q)


def _row(config: Config, samples: list[dict]) -> dict:
    errors = [s["error"] for s in samples if "error" in s]
    ok = [s for s in samples if "error" not in s]
    name = f"reclaim, {config.label}: refused alloc to the first alloc that succeeds"
    if not ok:
        return {"name": name, "value": "failed", "unit": "", "note": "; ".join(sorted(set(errors)))}
    waits = [s["ms"] for s in ok]
    published = [s["published_ms"] for s in ok if s["took"]]
    p99 = _ms(waits, 99)
    met = "met" if p99 <= TARGET_P99_MS else "not met"
    given = f"{statistics.median(s['reserved'] for s in ok) / MiB:g} MiB reserved + " \
            f"{statistics.median(s['cached'] for s in ok) / MiB:g} MiB cached"
    note = (f"p99 {p99:.2f} ms, range {min(waits):.2f}-{max(waits):.2f} ms over {len(ok)} rounds; the asker's "
            f"published pressure.latency_s (refused growth to bytes given) p50 {_ms(published, 50):.2f} ms, "
            f"p99 {_ms(published, 99):.2f} ms ({len(published)} rounds); donor gave {given} (median), "
            f"its own part p50 {_ms([s['gave_ms'] for s in ok], 50):.2f} ms; the refused alloc itself p50 "
            f"{_ms([s['refused_ms'] for s in ok], 50):.2f} ms, the one that succeeded "
            f"{_ms([s['last_ms'] for s in ok], 50):.2f} ms; alloc retried every "
            f"{RETRY_S * 1e3:g} ms; a fresh donor each round")
    if config.backend == "host":
        note += f"; target p99 <= {TARGET_P99_MS:g} ms: {met}"
    if errors:
        note += f"; {len(errors)} rounds failed: {'; '.join(sorted(set(errors)))}"
    return {"name": name, "value": round(_ms(waits, 50), 2), "unit": "ms p50", "note": note,
            "rounds": ok}


GROWTH_PAGES = 18  # the pages the growing model takes, one per alloc
GROWTH_TARGET_MS = 200.0
GROWTH_BUNDLE = 2 * MiB
GROWTH_GEOMETRY = dict(num_blocks=4 * 32, block_bytes=GROWTH_BUNDLE // 4, num_layers=1, num_kv_buffers=1,
                       page_size=GROWTH_BUNDLE)
GROWTH_ENV = {"KVCACHED_HOST_CAPACITY": "64MiB", "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_IDLE_RETURN_S": "-1"}

GROWTH_DONOR = f"""
import sys
from kvcached_core import KVCacheManager
m = KVCacheManager("donor", name="donor", **{GROWTH_GEOMETRY!r})
active, cached = m.alloc(8), m.alloc(4 * 30)
assert active is not None and cached is not None, "the donor could not map its blocks"
m.mark_cached(cached)
m.set_evict_handler(lambda: m.evict_for_limit())
print("READY", flush=True)
sys.stdin.readline()
m.close()
"""

GROWTH_ASKER = f"""
import json, sys, time
from kvcached_core import KVCacheManager

print("READY", flush=True)
for line in sys.stdin:
    m = KVCacheManager("asker", name="asker", **{GROWTH_GEOMETRY!r})
    m.pressure.fixed_pace = line.strip() == "fixed"
    try:
        t0 = time.perf_counter()
        for _ in range({GROWTH_PAGES}):
            while m.alloc(4) is None:
                if time.perf_counter() - t0 > 30:
                    raise SystemExit("no growth within 30 s")
                time.sleep({RETRY_S!r})
        ms = (time.perf_counter() - t0) * 1e3
        print(json.dumps({{"ms": ms, "asks": m.pressure.asked_count, "published_ms": m.pressure.latency_ns / 1e6}}),
              flush=True)
    finally:
        m.close()
"""


def growth(rounds: int) -> list[dict]:
    """Both pacings, ``rounds`` each, taking turns (the order reversed every other round); a fresh donor each time."""
    samples: list[dict] = []
    with private_segments(**GROWTH_ENV):
        asker = _spawn(GROWTH_ASKER, {})
        try:
            for i in range(rounds):
                for pace in ("grown", "fixed") if i % 2 == 0 else ("fixed", "grown"):
                    donor = _spawn(GROWTH_DONOR, {})
                    try:
                        asker.stdin.write(pace + "\n")  # type: ignore[union-attr]
                        line = asker.stdout.readline()  # type: ignore[union-attr]
                        if not line:
                            raise RuntimeError("the growing model's process ended")
                        samples.append({"round": i + 1, "pace": pace} | json.loads(line))
                    finally:
                        donor.stdin.close()  # type: ignore[union-attr]
                        try:
                            donor.wait(timeout=10)
                        except subprocess.TimeoutExpired:
                            stop(donor)
        finally:
            stop(asker)
    return samples


def growth_rows(samples: list[dict]) -> list[dict]:
    rows = []
    by = {pace: [s for s in samples if s["pace"] == pace] for pace in ("grown", "fixed")}
    ratios = [f["ms"] / g["ms"] for g, f in zip(by["grown"], by["fixed"], strict=True)]
    for pace, runs in by.items():
        ms = [s["ms"] for s in runs]
        note = (f"{GROWTH_PAGES} pages of {GROWTH_BUNDLE // MiB} MiB one per alloc behind an idle donor (64 MiB budget); "
                f"median of {len(ms)} rounds, range {min(ms):.1f}-{max(ms):.1f} ms; asks "
                f"{statistics.median(s['asks'] for s in runs):g} (median); published latency of the last reclaim "
                f"p50 {statistics.median(s['published_ms'] for s in runs):.2f} ms")
        if pace == "grown":
            met = "met" if statistics.median(ms) <= GROWTH_TARGET_MS else "not met"
            note += (f"; fixed pace / grown, per round: median {statistics.median(ratios):.1f}x "
                     f"(range {min(ratios):.1f}-{max(ratios):.1f}x); target <= {GROWTH_TARGET_MS:g} ms: {met}")
        rows.append({"name": f"reclaim growth, {pace} asks: {GROWTH_PAGES} pages behind an idle donor",
                     "value": round(statistics.median(ms), 1), "unit": "ms median", "note": note})
    return rows


def print_growth(samples: list[dict]) -> None:
    """Every round as a table, then the rows."""
    print("| round | pacing | ms to 18 pages | asks | published latency ms |")
    print("|---|---|---|---|---|")
    for s in samples:
        print(f"| {s['round']} | {s['pace']} | {s['ms']:.1f} | {s['asks']} | {s['published_ms']:.2f} |")
    for row in growth_rows(samples):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")


def run(quick: bool) -> list[dict]:
    rounds = 6 if quick else 30
    reason = cuda_reason()
    configs = _configs(reason)
    samples: dict[Config, list[dict]] = {c: [] for c in configs}
    with private_segments():
        askers: dict[tuple[str, str], subprocess.Popen] = {}
        try:
            for config in configs:
                if (config.backend, config.layout) not in askers:
                    askers[(config.backend, config.layout)] = _spawn(
                        _code(ASKER, config, ASK=ASK_PAGES * 4, RETRY_S=RETRY_S, POOL=ASKER_POOL), config.env(ASKER_POOL))
            for i in range(rounds):
                for config in configs if i % 2 == 0 else configs[::-1]:
                    samples[config].append(_round(config, askers[(config.backend, config.layout)]))
        finally:
            for proc in askers.values():
                stop(proc)
    rows = [_row(c, samples[c]) for c in configs] + growth_rows(growth(2 if quick else 5))
    if reason is not None:
        rows += [{"name": f"reclaim, cuda {layout} layout: refused alloc to the first alloc that succeeds",
                  "value": "skipped", "unit": "", "note": reason} for layout in ("layer", "page")]
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if "--growth" in sys.argv:
        print_growth(growth(3 if "--quick" in sys.argv else 5))
        sys.exit(0)
    for row in run(quick="--quick" in sys.argv):
        print(f"{row['name']}: {row['value']} {row['unit']}  ({row['note']})")
