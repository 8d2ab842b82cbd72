"""A model whose process stops inside a publish (its seqlock odd) is still there: late, with its last figures.

The allocator runs in a child process. A hook in it parks one publish of the Python path (the reference the C
path is held to, tests/test_fastpath.py) exactly where a stop can land: after its page entries, before a
counter, or among its counters; the C path's is stopped by SIGSTOP timed on its sequence word. Every front end
is asked while it stands: snapshot(), kvctl list (text and --json), kvtop --once and the exporter's scrape.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import child_env, wait_for
from test_exporter import scrape, value

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment import reader, stuck
from kvtop.serve.exporter import Exporter

MiB = 1 << 20
NO_POOL = {"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0"}  # no refill thread publishing
# 4 blocks a page, a page bundle of 1 MiB (256 KiB x 2 layers x K and V)
GEOMETRY = dict(num_blocks=512, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)

# park(n): the next publish writes its page entries, then the first n counters' words as the publish would,
# then its process stops (SIGSTOP) with the sequence odd; once continued it finishes the publish as always.
PARK = """
import os, signal, struct
from kvcached_core.segment import layout as L
def park(words):
    seg = m.segment
    def parked(counters):
        del seg.publish
        struct.pack_into(f"<{words}Q", seg._buf, L.COUNTERS_OFF, *counters[:words])
        os.kill(os.getpid(), signal.SIGSTOP)
        seg.publish(counters)
    seg.publish = parked
a = m.alloc(6)
"""


def tool(module: str, *args: str) -> subprocess.CompletedProcess:
    """A front end in a process of its own: it never read the model before, as an operator's kvctl has not."""
    return subprocess.run([sys.executable, "-m", module, *args], env=dict(child_env(), COLUMNS="200"),
                          capture_output=True, text=True, timeout=60)


def sequence(shm_dir: Path, name: str) -> int:
    with open(shm_dir / f"kvc.{name}", "rb") as fh:
        fh.seek(L.SEQ_OFF)
        return L.U64.unpack(fh.read(8))[0]


def parked(spawn_allocator, shm_dir: Path, words: int):
    """An allocator holding 6 blocks (2 pages), stopped inside the publish of 5 more (11 blocks, 3 pages)."""
    proc = spawn_allocator("frozen", script=PARK, env={"KVCACHED_FASTPATH": "0", **NO_POOL}, **GEOMETRY)
    assert kc.snapshot("frozen").blocks_used == 6  # read once while it runs: this process remembers that copy
    proc.stdin.write(f"park({words}); b = m.alloc(5)\n")
    proc.stdin.flush()
    wait_for(lambda: sequence(shm_dir, "frozen") & 1 and _stopped(proc.pid), what="the publish to park")
    return proc


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def resume(proc) -> None:
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.stdout.readline().strip() == "OK"  # the alloc that was parked returned


def listed(name: str) -> dict:
    """``kvctl list --json``'s row for ``name``, from a process of its own."""
    out = tool("kvtop.cli", "list", "--json")
    assert out.returncode == 0, out.stderr
    return next(row for row in json.loads(out.stdout) if row["name"] == name)


def test_stopped_before_a_counter_every_front_end_shows_it_late_with_the_publish_before(spawn_allocator, shm_dir):
    proc = parked(spawn_allocator, shm_dir, words=0)
    with Exporter("127.0.0.1", 0) as exporter:
        snap = kc.snapshot("frozen")  # this process read it before: its page map too
        assert (snap.status, snap.late, snap.display_status) == ("live", True, "late")
        assert (snap.blocks_used, snap.pages_inuse, snap.mapped_bytes) == (6, 2, 2 * MiB)
        assert snap.figures_ns and snap.figures_age_s is not None and 0 <= snap.figures_age_s < 60
        assert sum(L.decode_page(e)[1] for e in snap.page_entries()) == 6  # the map of those figures

        stuck.forget()  # as a fresh process: the counters of the publish before still verify; the map moved on
        fresh = kc.snapshot("frozen")
        assert (fresh.display_status, fresh.blocks_used, fresh.mapped_bytes) == ("late", 6, 2 * MiB)
        assert fresh.pages is None  # its page entries are the next publish's: not shown as these figures' map

        row = listed("frozen")
        assert (row["status"], row["late"], row["blocks_used"], row["mapped_bytes"]) == ("live", True, 6, 2 * MiB)
        assert row["figures_age_s"] is not None and row["figures_age_s"] >= 0
        text = tool("kvtop.cli", "list")
        assert text.returncode == 0 and "no models" not in text.stdout
        (line,) = [ln for ln in text.stdout.splitlines() if ln.startswith("frozen")]
        assert line.split()[4:6] == ["late", "2.0"], line  # STATUS, MAPPED
        assert "frozen: late: its process" in text.stderr and "stays inside a publish" in text.stderr
        once = tool("kvtop.app", "--once")
        assert once.returncode == 0, once.stderr
        (row_line,) = [ln for ln in once.stdout.splitlines() if "frozen" in ln and str(proc.pid) in ln]
        assert row_line.split()[2:5] == ["late", row_line.split()[3], "2.0"], row_line  # status, its age, mapped
        assert row_line.split()[3].endswith("s")

        samples = scrape(exporter.url)
        labels = {"model": "frozen", "pid": str(proc.pid)}
        assert value(samples, "kvcached_model_info", status="late", **labels) == 1
        assert value(samples, "kvcached_mapped_bytes", **labels) == 2 * MiB
        assert value(samples, "kvcached_figures_age_seconds", **labels) >= 0

        resume(proc)  # it finishes the publish: live again, nothing lost
        after = kc.snapshot("frozen")
        assert (after.display_status, after.late, after.figures_ns, after.figures_age_s) == ("live", False, 0, None)
        assert (after.blocks_used, after.pages_inuse, after.mapped_bytes, after.alloc_count) == (11, 3, 3 * MiB, 2)
        assert listed("frozen")["figures_age_s"] is None
        samples = scrape(exporter.url)
        assert value(samples, "kvcached_model_info", status="live", model="frozen") == 1
        assert value(samples, "kvcached_figures_age_seconds", model="frozen") == 0


def test_stopped_among_its_counters_shows_what_can_be_known(spawn_allocator, shm_dir):
    """Four counters written: no copy verifies. This process shows the last consistent copy it read; a fresh one
    counts the page map, whole once a counter is written (the entries come first)."""
    proc = parked(spawn_allocator, shm_dir, words=4)
    remembered = kc.snapshot("frozen")
    assert (remembered.display_status, remembered.blocks_used, remembered.mapped_bytes) == ("late", 6, 2 * MiB)
    assert remembered.figures_age_s is not None

    row = listed("frozen")  # no earlier copy in that process
    assert (row["status"], row["late"]) == ("live", True)
    assert (row["blocks_used"], row["pages_inuse"], row["mapped_bytes"]) == (11, 3, 3 * MiB)
    assert row["figures_age_s"] is not None

    resume(proc)
    after = kc.snapshot("frozen")
    assert (after.display_status, after.blocks_used, after.mapped_bytes, after.figures_ns) == ("live", 11, 3 * MiB, 0)


def test_a_second_read_of_a_stopped_writer_does_not_wait_again(spawn_allocator, shm_dir, monkeypatch):
    """The first read waits out its retries (the writer may only be slow); a read that finds the writer still at
    the sequence it was found stopped at knows at once (a dashboard refreshing every second is not held up)."""
    proc = parked(spawn_allocator, shm_dir, words=0)
    stuck.forget()
    waits: list[int] = []
    real = reader._backoff
    monkeypatch.setattr(reader, "_backoff", lambda attempt: (waits.append(attempt), real(attempt)))
    assert kc.scan().models[0].late
    assert len(waits) == reader.READ_RETRIES  # it waited out every retry
    waits.clear()
    assert kc.scan().models[0].late and kc.snapshot("frozen").late
    assert waits == []
    resume(proc)
    assert not kc.snapshot("frozen").late


# The C path runs no Python inside its window but one call: the length of a page's cached blocks, for its entry.
# A ledger entry whose length stops the process, once armed and only with the sequence odd, parks that publish
# among its page entries.
PARK_C = """
import os, signal
assert m._fast is not None, "the C path is not built"
class Parking(dict):
    armed = False
    def __len__(self):
        if Parking.armed and m.segment.current_seq() & 1:
            Parking.armed = False
            os.kill(os.getpid(), signal.SIGSTOP)
        return dict.__len__(self)
a = m.alloc(6)
m.mark_cached(a[:2])
"""
ARM_C = "page = next(iter(m.cache.by_page)); m.cache.by_page[page] = Parking(m.cache.by_page[page]); Parking.armed = True"


def test_the_c_path_stopped_inside_its_publish(spawn_allocator, shm_dir):
    proc = spawn_allocator("frozen", script=PARK_C, env={"KVCACHED_FASTPATH": "1", **NO_POOL}, **GEOMETRY)
    proc.stdin.write(f"{ARM_C}; m.free(a[2:4])\n")  # frees two blocks of the page with the cached ones
    proc.stdin.flush()
    wait_for(lambda: sequence(shm_dir, "frozen") & 1 and _stopped(proc.pid), what="the C publish to park")
    row = listed("frozen")
    assert (row["status"], row["late"], row["blocks_used"], row["blocks_cached"]) == ("live", True, 6, 2)
    assert row["figures_age_s"] is not None
    held = kc.snapshot("frozen")
    assert (held.display_status, held.blocks_used, held.alloc_count, held.free_count) == ("late", 6, 1, 0)
    resume(proc)
    after = kc.snapshot("frozen")
    assert (after.display_status, after.figures_ns, after.blocks_used, after.blocks_cached) == ("live", 0, 4, 2)
    assert (after.alloc_blocks - after.free_blocks, after.free_count) == (4, 1)  # the free that was parked, counted
