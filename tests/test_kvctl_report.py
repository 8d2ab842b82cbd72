"""``kvctl report`` against a known script: real allocators, a real recorder, the figures checked against the truth.

The script (one recording for the module): a budget of 26 MiB shared by two models of 1 MiB page bundles
(256 KiB pages, 2 layers, K and V; 4 blocks a page). ``idle``, in a child process, fills it (cached blocks
and its warm pool); ``busy``, in this process, takes 10 pages, which only a reclaim from ``idle`` can give;
then a 4 MiB limit below what ``busy`` uses (deferred, held for several samples, applied when its blocks
are freed); then a sleep and a wake. A :class:`~kvtop.record.recorder.Recorder` samples every 0.1 s in a
thread meanwhile, and a watcher reads the segments every few milliseconds for the largest mapped figure
seen live. Each state is held until the recorder has sampled it, so the truth is known to within one
sample interval.
"""

from __future__ import annotations

import json
import os
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
from kvtop.record.recorder import Recorder
from kvtop.record.report import model_report, moment, percentile

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
    asleep: tuple[float, float] = (0.0, 0.0)  # busy: seen asleep, seen awake
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
            assert request_sleep("busy", "sleep", wait=10, until_done=True).status == "asleep"
            slept_at = time.time()
            sampler.samples_after(slept_at, 8)
            request_sleep("busy", "wake", wait=10, until_done=True)
            script.asleep = (slept_at, time.time())
            sampler.samples_after(script.asleep[1], 3)

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
    truth = script.asleep[1] - script.asleep[0]
    slack = 2 * script.largest_gap(*script.asleep) + 0.05
    assert abs(busy["asleep_s"] - truth) <= slack, (busy["asleep_s"], truth, slack)
    assert idle["deferred_s"] == idle["asleep_s"] == 0

    # waste and waiting: the donor holds cached blocks (pinned over held known); no engine publishes traffic
    assert idle["waste_mean"] >= 1.0 and idle["waste_max"] >= idle["waste_mean"]
    assert busy["waiting_mean"] is None and busy["waiting_max"] is None


def test_the_report_marks_what_happened_in_order(script: Script) -> None:
    from kvtop.record.reading import Recording

    with Recording.open(script.recording) as rec:
        busy = model_report("busy", rec.samples_of("busy"))
    assert busy is not None
    kinds = [mark.kind for mark in busy.marks]
    assert kinds.index("reclaim") < kinds.index("limit deferred") < kinds.index("limit applied") \
        < kinds.index("sleep") < kinds.index("wake")
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
    assert [line.split()[0] for line in lines[2:]] == ["busy", "idle"]
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
    code, doc, _ = report(str(script.recording), "--from", f"-{doc['recording_end'] - script.asleep[1] - 0.01:.3f}s")
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
    nowhere = kvctl("report", str(script.recording), "--plot", str(tmp_path / "no" / "such.png"))
    assert nowhere.exit_code == 1 and nowhere.stderr.strip().endswith("cannot write the plot: No such file or directory")


def test_percentiles_are_nearest_rank() -> None:
    values = [0.05, 0.01, 0.04, 0.02, 0.03]
    assert percentile(values, 50) == 0.03 and percentile(values, 99) == 0.05 and percentile([], 50) is None
    assert percentile(list(range(1, 101)), 99) == 99
