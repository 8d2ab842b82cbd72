"""``kvctl report`` against a known script: real allocators, a real recorder, the figures checked against the truth.

The script (one recording for the module): a budget of 26 MiB shared by two models of 1 MiB page bundles
(256 KiB pages, 2 layers, K and V; 4 blocks a page). ``idle``, in a child process, fills it (cached blocks
and its warm pool); ``busy``, in this process, takes 10 pages, which only a reclaim from ``idle`` can give;
then a 4 MiB limit below what ``busy`` uses (deferred, held for several samples, applied when its blocks
are freed); then a sleep and a wake request; a second sleep, woken by the engine itself (as a request reaching
it wakes it); then a trim of the pages ``busy`` freed into its warm pool, and the limit lifted. A :class:`~kvtop.record.recorder.Recorder` samples every 0.1 s in a
thread meanwhile, and a watcher reads the segments every few milliseconds for the largest mapped figure
seen live. Each state is held until the recorder has sampled it, so the truth is known to within one
sample interval.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
from conftest import child_env, kvctl, wait_for
from test_docs_reference import assert_documented, flatten, key_table

import kvcached_core as kc
from kvcached_core import KVCacheManager, request_limit
from kvcached_core.control import request_sleep
from kvtop.frames.events import CONTROLLER_WAKE, REQUEST_WAKE
from kvtop.record.recorder import Recorder
from kvtop.record.report import CANNOT_SLEEP, NO_TRAFFIC, model_report, moment, percentile

MiB = 1 << 20
INTERVAL = 0.1
GEOMETRY = dict(num_blocks=256, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
DONOR = """
import sys
from kvcached_core import KVCacheManager
m = KVCacheManager("idle", name="idle", **{geometry!r})
active = m.alloc(8)
cached = m.alloc(80)
m.mark_cached(cached)
m.set_evict_handler(lambda: m.evict_for_limit())
print("READY", flush=True)
sys.stdin.read()
m.close()
"""


@dataclass
class Script:
    """What the script did, as seen live, and the recording it left."""

    recording: Path
    interval: float = INTERVAL
    peak_live: dict[str, int] = field(default_factory=dict)
    deferred: tuple[float, float] = (0.0, 0.0)  # busy's limit: acknowledged deferred, seen applied
    in_use_at_limit: int = 0  # busy's pinned bytes when the limit was asked
    asleep: tuple[float, float] = (0.0, 0.0)  # busy: seen asleep, seen awake (a wake request)
    asleep_again: tuple[float, float] = (0.0, 0.0)  # busy's second sleep: seen asleep, seen awake (woken by its engine)
    slept_bytes: int = 0  # what busy's sleep released, as its answer said
    trimmed: tuple[float, int] = (0.0, 0)  # busy's trim: when it was answered, the bytes it returned
    lifted_at: float = 0.0  # busy's limit lifted (acknowledged)
    reclaimed_by: float = 0.0  # every reclaim was counted by then
    final: dict[str, kc.ModelSnapshot] = field(default_factory=dict)
    sample_times: list[float] = field(default_factory=list)

    def largest_gap(self, t0: float, t1: float) -> float:
        """The longest time between two samples around [t0, t1]: how far a duration may be off at each end."""
        times = [t for t in self.sample_times if t0 - 2 <= t <= t1 + 2]
        return max(b - a for a, b in zip(times, times[1:], strict=False))


class Sampler:
    """The recorder's loop, as ``kvctl record`` runs it, in a thread: one sample every ``interval`` seconds."""

    def __init__(self, recorder: Recorder, interval: float) -> None:
        self.recorder, self.interval = recorder, interval
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.times.append(self.recorder.write(self.recorder.read()))
            if self.stop.wait(self.interval):
                return

    def samples_after(self, t: float, n: int = 1) -> None:
        """Wait until ``n`` samples were written after ``t``."""
        wait_for(lambda: sum(s > t for s in self.times) >= n, timeout=30, what=f"{n} samples after {t}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.recorder.close()


class Watcher:
    """The largest mapped bytes each model showed, read live every few milliseconds."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.003):
            for m in kc.list_models(directory=self.directory):
                self.peak[m.name] = max(self.peak.get(m.name, 0), m.mapped_bytes)

    def close(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join()
        return self.peak


def live(name: str, directory: Path) -> kc.ModelSnapshot:
    return next(m for m in kc.list_models(directory=directory) if m.name == name)


def take(m: KVCacheManager, blocks: int, timeout: float = 30.0) -> list[int]:
    """``blocks`` blocks four at a time, retrying misses as an engine's scheduler would."""
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < blocks:
        ids = m.alloc(4)
        if ids is None:
            assert time.monotonic() < deadline, f"{m.name} got {len(got)} of {blocks} blocks in {timeout} s"
            time.sleep(0.01)
            continue
        got += ids
    return got


def run_script(shm: Path, out: Path) -> Script:
    script = Script(out)
    donor = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DONOR.format(geometry=GEOMETRY))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
    sampler = watcher = None
    try:
        assert donor.stdout is not None and donor.stdout.readline().strip() == "READY"
        sampler = Sampler(Recorder(out, interval=INTERVAL, segments=shm, gpus=False), INTERVAL)
        watcher = Watcher(shm)
        wait_for(lambda: live("idle", shm).mapped_bytes == 26 * MiB, what="the donor to fill the budget")
        with KVCacheManager("busy", name="busy", **GEOMETRY) as m:  # type: ignore[arg-type]
            kept: list[int] = []

            def handler(action: str) -> None:
                if action.startswith("sleep"):
                    def drain() -> None:
                        m.free(kept)
                        kept.clear()
                        m.sleep.ready()
                    threading.Thread(target=drain).start()

            m.set_sleep_handler(handler)
            sampler.samples_after(time.time(), 3)  # both models recorded before anything happens

            # a reclaim: 10 pages, which only idle can give
            got = take(m, 40)
            wait_for(lambda: live("busy", shm).pressure.took_total >= 8 * MiB, what="busy to count what it took")
            wait_for(lambda: live("busy", shm).pressure.wanted_bytes == 0, what="busy to want nothing more")
            settled = time.time()
            script.reclaimed_by = settled
            sampler.samples_after(settled, 3)

            # a limit below what busy uses: deferred until its blocks are freed
            script.in_use_at_limit = live("busy", shm).pinned_bytes
            ack = request_limit("busy", 4 * MiB, wait=10)
            deferred_at = time.time()
            assert ack.status == "deferred", ack
            sampler.samples_after(deferred_at, 8)
            kept.extend(got[:4])
            m.free(got[4:])
            wait_for(lambda: live("busy", shm).limit_status == "applied", what="the limit to apply")
            script.deferred = (deferred_at, time.time())
            sampler.samples_after(script.deferred[1], 3)

            # a sleep and a wake
            slept = request_sleep("busy", "sleep", wait=10, until_done=True)
            assert slept.status == "asleep", slept
            slept_at = time.time()
            script.slept_bytes = slept.bytes_returned
            sampler.samples_after(slept_at, 8)
            request_sleep("busy", "wake", wait=10, until_done=True)
            script.asleep = (slept_at, time.time())
            sampler.samples_after(script.asleep[1], 3)

            # a second sleep, woken by the engine as by a request reaching it: no wake request, no revision
            again = request_sleep("busy", "sleep", wait=10, until_done=True)
            assert again.status == "asleep" and again.bytes_returned == 0, again  # nothing mapped since the wake
            slept_at = time.time()
            sampler.samples_after(slept_at, 5)
            m.sleep.wake()
            wait_for(lambda: live("busy", shm).sleep.state == "awake", what="busy woken by its engine")
            script.asleep_again = (slept_at, time.time())
            sampler.samples_after(script.asleep_again[1], 3)

            # a trim of the pages busy freed into its warm pool
            m.free(take(m, 8))
            wait_for(lambda: live("busy", shm).pages_reserved >= 2, what="busy's freed pages in its warm pool")
            sampler.samples_after(time.time(), 2)
            trim = kc.request_trim("busy", wait=10)
            assert trim.status == "trimmed" and trim.bytes_returned >= 2 * MiB, trim
            script.trimmed = (time.time(), trim.bytes_returned)
            sampler.samples_after(script.trimmed[0], 3)

            # the limit lifted: applied at once
            assert request_limit("busy", None, wait=10).status == "none"
            script.lifted_at = time.time()
            sampler.samples_after(script.lifted_at, 3)

            script.final = {name: live(name, shm) for name in ("busy", "idle")}
            sampler.samples_after(time.time(), 2)  # the final counters are in the recording
        script.peak_live = watcher.close()
        watcher = None
    finally:
        if watcher is not None:
            watcher.close()
        if sampler is not None:
            sampler.close()
            script.sample_times = sampler.times
        if donor.stdin is not None:
            donor.stdin.close()
        donor.wait(timeout=30)
    return script


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Script:
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.getbasetemp()
    shm = Path(os.path.realpath(base)) / f"kvc-report-{os.getpid()}-{time.monotonic_ns()}"
    shm.mkdir(mode=0o700)
    out = tmp_path_factory.mktemp("recording")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVCACHED_SHM_DIR", str(shm))
            mp.setenv("KVCACHED_HOST_CAPACITY", "26MiB")
            mp.setenv("KVCACHED_IDLE_RETURN_S", "-1")  # the donor's warm pool stays: it gives it first
            mp.delenv("KVCACHED_IPC_NAME", raising=False)
            return run_script(shm, out)
    finally:
        for child in shm.iterdir():
            child.unlink()
        shm.rmdir()


def report(*args: str) -> tuple[int, dict, str]:
    result = kvctl("report", *args, "--json")
    return result.exit_code, json.loads(result.stdout) if result.stdout else {}, result.stderr


def by_name(doc: dict) -> dict[str, dict]:
    return {m["name"]: m for m in doc["models"]}


# -- the figures against the script ----------------------------------------------------------------

def test_the_figures_are_what_the_script_did(script: Script) -> None:
    code, doc, err = report(str(script.recording))
    assert code == 0 and err == "", err
    models = by_name(doc)
    assert set(models) == {"busy", "idle"}
    busy, idle = models["busy"], models["idle"]

    # peak mapped: the largest figure seen live (each state was held until it was sampled)
    assert idle["peak_mapped_bytes"] == script.peak_live["idle"] == 26 * MiB
    assert busy["peak_mapped_bytes"] == script.peak_live["busy"]
    assert 0 < busy["mean_mapped_bytes"] < busy["peak_mapped_bytes"]

    # reclaims: the segments' own totals (both counters began at 0 with the recording)
    final_busy, final_idle = script.final["busy"].pressure, script.final["idle"].pressure
    assert final_busy.took_count >= 1 and final_idle.gave_count >= 1
    assert (busy["taken"]["count"], busy["taken"]["bytes"]) == (final_busy.took_count, final_busy.took_total)
    assert (idle["given"]["count"], idle["given"]["bytes"]) == (final_idle.gave_count, final_idle.gave_total)
    assert (busy["given"]["count"], idle["taken"]["count"]) == (0, 0)
    assert 1 <= busy["taken"]["latencies"] <= busy["taken"]["count"]
    assert 0 < busy["taken"]["latency_p50_s"] <= busy["taken"]["latency_p99_s"] < 30
    assert busy["given"]["latency_p50_s"] is None

    # durations: within one sample interval of the truth at each end
    truth = script.deferred[1] - script.deferred[0]
    slack = 2 * script.largest_gap(*script.deferred) + 0.05
    assert abs(busy["deferred_s"] - truth) <= slack, (busy["deferred_s"], truth, slack)
    truth = script.asleep[1] - script.asleep[0] + script.asleep_again[1] - script.asleep_again[0]
    slack = 2 * script.largest_gap(*script.asleep) + 2 * script.largest_gap(*script.asleep_again) + 0.05
    assert abs(busy["asleep_s"] - truth) <= slack, (busy["asleep_s"], truth, slack)
    assert idle["deferred_s"] == idle["asleep_s"] == 0

    # waste and waiting: the donor holds cached blocks (pinned over held known); no engine publishes traffic
    assert idle["waste_mean"] >= 1.0 and idle["waste_max"] >= idle["waste_mean"]
    assert busy["waiting_mean"] is None and busy["waiting_max"] is None


def near(at: float | None, truth: float, script: Script) -> bool:
    """``at`` is the sample that first showed what happened at ``truth``: within a sample interval of it."""
    slack = script.largest_gap(truth, truth) + 0.05
    return at is not None and truth - slack <= at <= truth + slack


def test_limits_trims_and_sleeps_are_what_the_script_did(script: Script) -> None:
    code, doc, err = report(str(script.recording))
    assert code == 0 and err == "", err
    busy, idle = by_name(doc)["busy"], by_name(doc)["idle"]
    final = script.final["busy"]

    # the 4 MiB limit: asked below what busy held, deferred until its blocks were freed, applied; then lifted
    lowered, lifted = busy["limits"]
    assert (lowered["revision"], lowered["asked_bytes"], lowered["effective_bytes"], lowered["status"]) == \
        (1, 4 * MiB, 4 * MiB, "deferred")
    assert lowered["in_use_bytes"] == script.in_use_at_limit == 10 * MiB
    assert near(lowered["set_at"], script.deferred[0], script) and near(lowered["applied_at"], script.deferred[1],
                                                                          script)
    assert lowered["deferred_s"] == busy["deferred_s"] > 0
    assert (lifted["revision"], lifted["asked_bytes"], lifted["effective_bytes"], lifted["status"]) == \
        (2, None, None, "none")
    assert near(lifted["set_at"], script.lifted_at, script) and lifted["applied_at"] == lifted["set_at"]
    assert lifted["deferred_s"] == 0

    # one trim, the bytes its answer said; the segment's own counters agree
    assert busy["trims"] == {"count": 1, "bytes": script.trimmed[1]}
    assert (final.trim_ack_seq, final.trimmed_total) == (1, script.trimmed[1])

    # two sleeps (what the first released, as its answer said; the second had nothing mapped), one woken by a wake
    # request, one by its engine
    assert busy["sleeps"] == {"count": 2, "released_bytes": script.slept_bytes, "wakes": 2, "woken_by_request": 1,
                              "woken_by_controller": 1, "woken_before_asleep": 0}
    assert script.slept_bytes > 0

    # idle: nothing set, trimmed or slept; what neither can have, and why
    assert idle["limits"] == [] and idle["trims"] == {"count": 0, "bytes": 0}
    assert busy["unknown"] == [{"figure": "waiting", "why": NO_TRAFFIC}]
    assert idle["unknown"] == [{"figure": "sleeps", "why": CANNOT_SLEEP}, {"figure": "waiting", "why": NO_TRAFFIC}]

    # the events themselves: what kvtop's log showed of busy, in order, within the window
    kinds = [e["kind"] for e in busy["events"]]
    for kind in ("limit_deferred", "limit_applied", "sleep", "wake", "trim", "limit"):
        assert kind in kinds, (kind, kinds)
    assert kinds.index("limit_deferred") < kinds.index("limit_applied") < kinds.index("wake") < kinds.index("trim")
    assert all(doc["from"] <= e["at"] <= doc["to"] for e in busy["events"])
    assert [e["text"] for e in busy["events"] if e["kind"] == "wake"] == [f"woken by {CONTROLLER_WAKE}",
                                                                          f"woken by {REQUEST_WAKE}"]
    assert any(e["kind"] == "trim" and f"trimmed: {kc.format_bytes(script.trimmed[1])} returned" == e["text"]
               for e in busy["events"])
    assert {e["kind"] for e in idle["events"]} >= {"reclaim"}


def test_a_limit_set_before_the_window_is_listed_as_such(script: Script) -> None:
    d0, d1 = script.deferred
    code, doc, _ = report(str(script.recording), "--from", iso((d0 + d1) / 2), "--to", iso(script.asleep[0]))
    assert code == 0
    (limit,) = by_name(doc)["busy"]["limits"]
    assert (limit["revision"], limit["set_at"], limit["status"], limit["asked_bytes"]) == (1, None, "deferred", 4 * MiB)
    assert near(limit["applied_at"], d1, script) and 0 < limit["deferred_s"] < d1 - d0
    story = kvctl("report", str(script.recording), "--from", iso((d0 + d1) / 2), "--to", iso(script.asleep[0]))
    assert re.search(r"  limit r1: 4\.0 MiB, set before the window, deferred \d+\.\ds \(10\.0 MiB in use\), applied "
                     r"\d\d:\d\d:\d\d\n", story.stdout), story.stdout


def test_the_text_tells_each_models_story(script: Script) -> None:
    result = kvctl("report", str(script.recording))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    header = out.splitlines()[1].split()
    for column in ("LIMITS", "DEFERRED", "TRIMS", "SLEEPS", "ASLEEP", "GAVE", "TOOK"):
        assert column in header, (column, header)
    busy_row = next(line for line in out.splitlines() if line.startswith("busy "))
    assert f"1 ({kc.format_bytes(script.trimmed[1])})" in busy_row and "n/a" in busy_row  # trims; waiting n/a
    story = out[out.index("\nbusy\n"):]
    assert re.search(r"  limit r1: 4\.0 MiB, set \d\d:\d\d:\d\d, deferred \d+\.\ds \(10\.0 MiB in use\), "
                     r"applied \d\d:\d\d:\d\d\n", story), story
    assert re.search(r"  limit r2: lifted, set \d\d:\d\d:\d\d, applied at once\n", story), story
    assert f"  trims: 1, {kc.format_bytes(script.trimmed[1])} returned\n" in story
    assert re.search(rf"  sleeps: 2, asleep \d+\.\ds, {re.escape(kc.format_bytes(script.slept_bytes))} released; "
                     r"woken 2: 1 by a request, 1 by a wake request\n", story), story
    assert f"  waiting: n/a: {NO_TRAFFIC}" in story
    idle = out[out.index("\nidle\n"):]
    assert "  limits: none\n" in idle and "  trims: none\n" in idle and f"  sleeps: n/a: {CANNOT_SLEEP}" in idle
    assert "WAITING requests queued in its engine" in " ".join(out.split())  # the columns explained


def test_the_report_marks_what_happened_in_order(script: Script) -> None:
    from kvtop.record.reading import Recording

    with Recording.open(script.recording) as rec:
        busy = model_report("busy", rec.samples_of("busy"))
    assert busy is not None
    kinds = [mark.kind for mark in busy.marks]
    assert kinds.index("reclaim") < kinds.index("limit deferred") < kinds.index("limit applied") \
        < kinds.index("sleep") < kinds.index("wake") < kinds.index("trim") < kinds.index("limit set")
    trim = next(mark.at for mark in busy.marks if mark.kind == "trim")
    assert near(trim, script.trimmed[0], script)
    deferred = next(mark.at for mark in busy.marks if mark.kind == "limit deferred")
    assert script.deferred[0] - script.largest_gap(*script.deferred) - 0.05 <= deferred \
        <= script.deferred[0] + script.largest_gap(*script.deferred) + 0.05


def test_the_json_keys_are_documented(script: Script) -> None:
    code, doc, _ = report(str(script.recording))
    assert code == 0
    busy = next(m for m in doc["models"] if m["name"] == "busy")
    doc["models"] = [busy]  # the one whose every figure is known (latencies, waste)
    assert_documented(flatten(doc), key_table("Reports"), "kvctl report --json")


def test_the_table(script: Script) -> None:
    result = kvctl("report", str(script.recording))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["MODEL", "SAMPLES", "PEAK", "MEAN"]
    assert [line.split()[0] for line in lines[2:4]] == ["busy", "idle"] and lines[4].startswith("LIMITS limits set")
    assert "26.0 MiB" in lines[3]


# -- windows and models ----------------------------------------------------------------------------

def iso(t: float) -> str:
    return datetime.fromtimestamp(t).isoformat()


def test_from_and_to_take_iso_and_relative_times(script: Script) -> None:
    d0, d1 = script.deferred
    gap = script.largest_gap(d0, d1)
    # the window around the deferred limit: all of it, no reclaim, no sleep
    code, doc, _ = report(str(script.recording), "--from", iso(d0 - gap), "--to", iso(d1 + gap))
    assert code == 0 and doc["from"] == pytest.approx(d0 - gap, abs=1e-3)
    busy = by_name(doc)["busy"]
    assert abs(busy["deferred_s"] - (d1 - d0)) <= 2 * gap + 0.05
    assert busy["asleep_s"] == 0 and busy["taken"]["count"] == 0
    assert d0 - gap <= busy["first_at"] and busy["last_at"] <= d1 + gap

    # after the sleep: nothing deferred, nothing asleep; relative to the recording's end
    code, doc, _ = report(str(script.recording), "--from", f"-{doc['recording_end'] - script.asleep_again[1] - 0.01:.3f}s")
    assert code == 0
    busy = by_name(doc)["busy"]
    assert busy["deferred_s"] == busy["asleep_s"] == 0 and busy["taken"]["count"] == 0

    # relative to its start: up to the first sample after the reclaims, every reclaim and none of the rest
    after = next(t for t in script.sample_times if t > script.reclaimed_by)
    code, doc, _ = report(str(script.recording), "--to", f"+{after - doc['recording_start'] + 0.001:.3f}s")
    busy = by_name(doc)["busy"]
    assert busy["taken"]["count"] == script.final["busy"].pressure.took_count and busy["deferred_s"] == 0


def test_clock_times_are_that_day_of_the_recording() -> None:
    start = datetime(2026, 12, 5, 22, 30, 15).timestamp()
    end = datetime(2026, 12, 6, 4, 0).timestamp()
    assert moment("23:00", start, end) == datetime(2026, 12, 5, 23, 0).timestamp()
    assert moment("03:10", start, end) == datetime(2026, 12, 6, 3, 10).timestamp()  # after midnight: the next day
    assert moment("22:30", start, end) == datetime(2026, 12, 5, 22, 30).timestamp()  # the start's minute: that day
    assert moment("-2h", start, end) == end - 7200 and moment("+1.5m", start, end) == start + 90
    assert moment("2026-12-06T01:00", start, end) == datetime(2026, 12, 6, 1).timestamp()


def test_bad_windows(script: Script) -> None:
    for args, code, words in ((("--from", "yesterday"), 2, "is not a time"), (("--from", "25:00"), 2, "no time of day"),
                              (("--from", "+2s", "--to", "+1s"), 2, "--from"),
                              (("--from", "2001-01-01", "--to", "2001-01-02"), 1, "outside the recording")):
        result = kvctl("report", str(script.recording), *args)
        assert result.exit_code == code and words in result.stderr, (args, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_model_by_name_or_prefix(script: Script) -> None:
    code, doc, _ = report(str(script.recording), "--model", "bu")
    assert code == 0 and [m["name"] for m in doc["models"]] == ["busy"]
    result = kvctl("report", str(script.recording), "--model", "nope")
    assert result.exit_code == 1 and result.stderr.strip() == \
        "kvctl: no model named 'nope' in this recording (known: busy, idle)"
    assert kvctl("report", str(script.recording), "--model", "a/b").exit_code == 2


# -- bad files ---------------------------------------------------------------------------------------

def day_file(script: Script) -> Path:
    [path] = sorted(script.recording.glob("kvrecord-*.sqlite"))
    return path


def copy_of(script: Script, tmp_path: Path) -> Path:
    """A self-contained copy of the day file (its WAL folded in)."""
    copy = tmp_path / day_file(script).name
    with sqlite3.connect(day_file(script)) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    return copy


@pytest.mark.parametrize("what", ["text", "sqlite", "newer"])
def test_what_is_no_recording_is_one_line(script: Script, tmp_path: Path, what: str) -> None:
    path = tmp_path / "rec.sqlite"
    if what == "text":
        path.write_text("hello\n" * 100)
    elif what == "sqlite":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE t (x)")
    else:
        path = copy_of(script, tmp_path)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    before = path.read_bytes()
    result = kvctl("report", str(path))
    assert result.exit_code == 1 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and str(path) in result.stderr
    assert ("newer" if what == "newer" else "not a recording") in result.stderr
    assert path.read_bytes() == before  # nothing written


def test_a_damaged_recording_is_reported_as_far_as_it_reads(script: Script, tmp_path: Path) -> None:
    path = copy_of(script, tmp_path)
    with sqlite3.connect(path) as db:
        last = db.execute("SELECT max(seq) FROM samples").fetchone()[0]
        db.execute("UPDATE samples SET crc = crc + 1 WHERE seq = ?", (last - 1,))
    result = kvctl("report", str(path), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert {m["name"] for m in doc["models"]} == {"busy", "idle"} and doc["skipped"]
    notes = result.stderr.splitlines()
    assert notes and all(line.startswith("kvctl: warning: ") and str(path) in line for line in notes)
    assert f"sample {last - 1}" in result.stderr


@pytest.mark.parametrize("kept", [0.3, 0.95])
def test_a_file_cut_short_is_read_as_far_as_it_goes_or_refused_in_one_line(script: Script, tmp_path: Path,
                                                                             kept: float) -> None:
    full = copy_of(script, tmp_path).read_bytes()
    path = tmp_path / "cut.sqlite"
    path.write_bytes(full[:int(len(full) * kept)])  # a recorder killed mid-write, a full disk
    result = kvctl("report", str(path), "--json")
    assert result.exit_code == 1 and result.stderr
    if result.stdout:  # what reads is reported; each part skipped named on stderr
        doc = json.loads(result.stdout)
        assert doc["models"] and doc["skipped"] == [line.removeprefix("kvctl: warning: ")
                                                    for line in result.stderr.splitlines()]
    else:
        assert len(result.stderr.splitlines()) == 1 and str(path) in result.stderr
    assert path.read_bytes() == full[:int(len(full) * kept)]


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    result = kvctl("report", str(tmp_path / "none"))
    assert result.exit_code == 1 and "no such file" in result.stderr and len(result.stderr.splitlines()) == 1


# -- --plot ------------------------------------------------------------------------------------------

def test_plot_without_matplotlib_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    result = kvctl("report", str(tmp_path / "rec"), "--plot", str(tmp_path / "out.png"))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == ("kvctl: --plot needs matplotlib, which is not installed: install the plot extra "
                                     "(pip install 'kvtop[plot]')")
    assert not (tmp_path / "out.png").exists()


def test_plot_draws_a_png(script: Script, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "night.png"
    result = kvctl("report", str(script.recording), "--plot", str(out))
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    from kvtop.record.reading import Recording
    from kvtop.record.report_plot import draw

    with Recording.open(script.recording) as rec:
        busy = model_report("busy", rec.samples_of("busy"), keep_series=True)
    assert busy is not None
    marked = draw([busy], tmp_path / "busy.png", "busy")
    assert set(marked) == {"limit deferred", "limit applied", "limit set", "trim", "reclaim", "sleep", "wake"}
    nowhere = kvctl("report", str(script.recording), "--plot", str(tmp_path / "no" / "such.png"))
    assert nowhere.exit_code == 1 and nowhere.stderr.strip().endswith("cannot write the plot: No such file or directory")


def test_percentiles_are_nearest_rank() -> None:
    values = [0.05, 0.01, 0.04, 0.02, 0.03]
    assert percentile(values, 50) == 0.03 and percentile(values, 99) == 0.05 and percentile([], 50) is None
    assert percentile(list(range(1, 101)), 99) == 99


def test_an_upstream_row_says_what_it_cannot_have_and_its_total_is_a_limit() -> None:
    """A public kvcached segment's row: bytes and a total only. Its new total is a limit (revision 0), applied once
    it is written; the figures it cannot have are n/a, each with why."""
    from fakes import fake_model

    from kvtop.record.report import NO_BLOCKS, NO_RECLAIMS, NO_SLEEP_STATE, NO_TRIMS
    from kvtop.record.report_text import story_lines, table_rows

    GiB = 1 << 30
    rows = [fake_model("kvcached_vllm_7", legacy=(total, 10 * GiB, 2 * GiB)) for total in (24 * GiB, 20 * GiB)]
    upstream = model_report("kvcached_vllm_7", [(100.0, rows[0]), (101.0, rows[1])])
    assert upstream is not None
    assert [(lim.revision, lim.asked_bytes, lim.set_at, lim.status, lim.applied_at) for lim in upstream.limits] == [
        (0, 24 * GiB, None, "written", None), (0, 20 * GiB, 101.0, "written", 101.0)]
    assert upstream.unknown == (("trims", NO_TRIMS), ("sleeps", NO_SLEEP_STATE), ("reclaims", NO_RECLAIMS),
                                ("waste", NO_BLOCKS), ("waiting", NO_TRAFFIC))
    (row,) = table_rows([upstream])
    assert row[6:] == ["n/a"] * 7  # trims, sleeps, asleep, gave, took, waste, waiting
    story = "\n".join(story_lines(upstream, dated=False))
    assert "  limit (upstream total): 24.0 GiB, set before the window, applied before the window" in story
    assert re.search(r"  limit \(upstream total\): 20\.0 GiB, set \d\d:\d\d:\d\d, applied at once", story), story
    for why in (NO_TRIMS, NO_SLEEP_STATE, NO_RECLAIMS, NO_BLOCKS, NO_TRAFFIC):
        assert f": n/a: {why}" in story
