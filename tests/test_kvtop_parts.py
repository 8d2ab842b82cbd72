"""kvtop's pieces without a screen: event diffing, history, view helpers, --once, and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from dataclasses import replace

import pytest
from conftest import child_env, send
from fakes import FakeSource, MiB, fake_model, fake_pages, sample_fleet
from rich.console import Console

from kvcached_core.backends import nvml
from kvcached_core.segment import layout as L
from kvcached_core.segment.snapshot import Problem, SleepInfo
from kvtop.frames.events import diff
from kvtop.frames.history import History
from kvtop.frames.source import LiveSource
from kvtop.screen.once import print_once, render
from kvtop.screen.view import (
    bar_text,
    device_bars,
    filter_models,
    fit_per_cell,
    model_cells,
    sort_models,
    sparkline,
)

KVTOP = [sys.executable, "-m", "kvtop.app"]


# -- events -------------------------------------------------------------------------------------

def test_first_scan_is_one_summary_line() -> None:
    events = diff(None, (fake_model("a"), fake_model("b")), 10.0)
    assert [e.kind for e in events] == ["watching"]
    assert events[0].text == "watching 2 models: a, b"


def test_appear_stale_live_disappear() -> None:
    a, b = fake_model("a"), fake_model("b")
    kinds = lambda evs: sorted((e.kind, e.model) for e in evs)  # noqa: E731
    assert kinds(diff((a,), (a, b), 1.0)) == [("appeared", "b")]
    assert kinds(diff((a, b), (a, replace(b, status="stale")), 2.0)) == [("stale", "b")]
    assert kinds(diff((replace(b, status="stale"),), (b,), 3.0)) == [("live", "b")]
    assert kinds(diff((a, b), (b,), 4.0)) == [("disappeared", "a")]
    assert diff((a, b), (a, b), 5.0) == []


def test_limit_acknowledgements_and_deferred_becoming_applied() -> None:
    before = fake_model("m", limit_bytes=None)
    deferred = fake_model("m", limit_bytes=64 * MiB, limit_status="deferred", revision=3, requested_limit=64 * MiB)
    [event] = diff((before,), (deferred,), 1.0)
    assert (event.kind, event.level, event.key) == ("limit", "warn", ("limit", "m", 3))
    assert "limit r3 acknowledged: deferred, 64.0 MiB asked" in event.text
    applied = replace(deferred, limit_status="applied")
    [event] = diff((deferred,), (applied,), 2.0)
    assert event.text == "deferred limit now applied: 64.0 MiB" and event.level == "good"


def test_trim_acknowledged_and_legacy_limit_and_new_problem() -> None:
    m = fake_model("m")
    trimmed = replace(m, trim_ack_seq=2, trim_bytes=5 * MiB)
    [event] = diff((m,), (trimmed,), 1.0)
    assert (event.kind, event.text, event.key) == ("trimmed", "trimmed: 5.0 MiB returned", ("trim", "m", 2))
    old = fake_model("kvcached_x_1", legacy=(0, MiB, 0))
    new = fake_model("kvcached_x_1", legacy=(8 * MiB, MiB, 0))
    [event] = diff((old,), (new,), 1.0)
    assert event.text == "limit (total) now 8.0 MiB"
    problem = Problem("/dev/shm/kvc.bad", "corrupt", "bad magic")
    [event] = diff((), (), 1.0, (), (problem,))
    assert event.kind == "problem" and "corrupt: bad magic" in event.text
    assert diff((), (), 2.0, (problem,), (problem,)) == []


def slept(m, state: str, revision: int = 0, slept_bytes: int = 0, took_s: float = 0.0, after_idle_s=None):
    return replace(m, sleep=SleepInfo(True, state, revision, after_idle_s, slept_bytes, took_s))


def test_sleeps_and_wakes_are_logged_with_their_cause() -> None:
    m = fake_model("m")
    awake = slept(m, "awake")
    texts = lambda a, b: [e.text for e in diff((a,), (b,), 1.0)]  # noqa: E731
    draining = slept(m, "draining", 1)
    assert texts(awake, draining) == ["going to sleep (sleep request r1): running requests finish first"]
    asleep = slept(m, "asleep", 1, 10 * MiB, 5.2)
    [event] = diff((draining,), (asleep,), 2.0)
    assert (event.text, event.key) == ("asleep: 10.0 MiB released in 5200 ms", ("sleep", "m", "asleep", 1, 10 * MiB, 5.2))
    # Woken with no new revision: a request reached the engine (or an alloc needed a page).
    woken = slept(m, "awake", 1, 10 * MiB, 5.2)
    assert texts(asleep, woken) == ["woken by a request (its engine took one, or an alloc needed a page)"]
    # A controller's wake takes a revision.
    assert texts(asleep, slept(m, "awake", 2, 10 * MiB, 5.2)) == [
        "woken by a wake request (kvctl wake, kvtop's w, or kvctl route for a request)"]
    assert texts(draining, slept(m, "awake", 1)) == [
        "woken before it slept by a request (its engine took one, or an alloc needed a page)"]
    # The after-idle policy: no revision.
    idle = slept(m, "awake", 1, 10 * MiB, 5.2, after_idle_s=30.0)
    assert texts(idle, slept(m, "draining", 1, 10 * MiB, 5.2, after_idle_s=30.0)) == [
        "going to sleep (after-idle policy: 30 s without a request): running requests finish first"]
    # Asleep and awake again between two refreshes: its last sleep's figures changed.
    assert texts(woken, slept(m, "awake", 1, 4 * MiB, 0.25)) == [
        "slept (4.0 MiB released in 250 ms) and was woken by a request (its engine took one, or an alloc needed "
        "a page), both since the last refresh"]
    assert diff((woken,), (woken,), 3.0) == []


# -- history and view ---------------------------------------------------------------------------

def test_history_rate_and_repeated_reads() -> None:
    h = History()
    m = fake_model("m", alloc_blocks=100, read_ns=1_000_000_000)
    h.update([m])
    assert h.rate("m") is None and h.mapped("m") == [m.mapped_bytes]
    h.update([m])  # the same read again adds nothing
    assert h.mapped("m") == [m.mapped_bytes]
    later = replace(m, alloc_blocks=300, read_ns=3_000_000_000)
    h.update([later])
    assert h.rate("m") == pytest.approx(200 * m.block_bundle_bytes / 2.0)
    h.update([])
    assert h.mapped("m") == [] and h.rate("m") is None


def test_history_traffic_rates_and_restarts() -> None:
    from kvcached_core.segment.snapshot import Traffic

    def traffic(finished: int, generated: int, read_ns: int) -> Traffic:
        return Traffic(running=1, waiting=0, finished=finished, prompt_tokens=0, generated_tokens=generated,
                       preemptions=0, last_request_ns=read_ns, read_ns=read_ns)

    h = History()
    quiet = fake_model("quiet", read_ns=1_000_000_000)
    busy = replace(fake_model("busy", read_ns=1_000_000_000), traffic=traffic(10, 1000, 1_000_000_000))
    h.update([quiet, busy])
    assert h.traffic_rates("busy") == (None, None)  # one reading: no rate yet
    h.update([replace(quiet, read_ns=3_000_000_000),
              replace(busy, read_ns=3_000_000_000, traffic=traffic(14, 1600, 3_000_000_000))])
    assert h.traffic_rates("busy") == (pytest.approx(2.0), pytest.approx(300.0))
    assert h.tokens("busy") == [pytest.approx(300.0)]
    assert h.traffic_rates("quiet") == (None, None)  # an engine without traffic figures has no rates
    h.update([replace(busy, read_ns=4_000_000_000, traffic=traffic(0, 0, 4_000_000_000))])
    assert h.traffic_rates("busy") == (None, None)  # counters went back: another engine, not a negative rate


def test_sparkline_and_fit() -> None:
    assert sparkline([]) == ""
    assert sparkline([0, 0]) == "▁▁"
    assert sparkline([0, 50, 100]) == "▁▅█"
    assert len(sparkline(list(range(100)), width=10)) == 10
    assert fit_per_cell(100_000, 40 * 6) == 512
    assert fit_per_cell(100, 400) == 1
    assert fit_per_cell(65_536, 1) == 65_536


def test_sort_filter_and_cells() -> None:
    fleet = sample_fleet(big_pages=2000)
    models = fleet.read(None).models
    assert [m.name for m in sort_models(models, "name")] == sorted(m.name for m in models)
    by_mapped = sort_models(models, "mapped")
    assert [m.mapped_bytes for m in by_mapped] == sorted((m.mapped_bytes for m in models), reverse=True)
    assert [m.name for m in filter_models(models, "SGLANG")] == ["qwen2-7b"]
    assert [m.name for m in filter_models(models, "shrink")] == ["qwen2-7b"]
    assert len(filter_models(models, "  ")) == len(models)
    live = next(m for m in models if m.display_status == "live")
    sleeping = replace(live, sleep=SleepInfo(capable=True, state="asleep", acked_revision=1, after_idle_s=None,
                                             slept_bytes=0, took_s=0.0))
    assert [m.name for m in filter_models([*models, sleeping], "asleep")] == [live.name]  # what the column shows
    qwen = next(m for m in models if m.name == "qwen2-7b")
    cells = model_cells(qwen)
    assert cells["status"].plain == "shrinking" and cells["limit"].plain == "↓12.5 GiB"
    legacy = next(m for m in models if m.status == "legacy")
    assert model_cells(legacy)["waste"].plain == "-"


def test_device_bars_host_and_gpu() -> None:
    host = sample_fleet(big_pages=2000).read(None)
    [bar] = device_bars(host)
    assert bar.title == "no NVIDIA GPU: host backend" and bar.total == host.host_capacity
    live_host = [m for m in host.models if m.backend == "host" and m.status != "stale"]
    assert bar.taken == sum(m.mapped_bytes for m in live_host)
    assert bar_text(bar, 50).cell_len == 50
    gpu = sample_fleet(gpus=True, big_pages=2000).read(None)
    bars = device_bars(gpu)
    assert [b.title for b in bars] == ["GPU 0 NVIDIA H200", "GPU 1 NVIDIA H200"]
    others = next(p for p in bars[1].parts if p.label == "others")
    qwen = gpu.model("qwen2-7b")
    assert others.nbytes == gpu.gpus[1].used_bytes - qwen.mapped_bytes
    assert bars[0].taken == gpu.gpus[0].used_bytes  # ours + others = what NVML says is used


def test_fake_pages_agree_with_counters() -> None:
    pages = fake_pages(300, inuse=40, reserved=7, bpp=8, cached_pages=5, seed=9)
    m = fake_model("m", pages=pages, page_size=2 * MiB, block_bytes=256 * 1024)
    assert (m.pages_inuse, m.pages_reserved) == (40, 7)
    assert m.blocks_used == sum(e & L.PAGE_FIELD_MASK for e in pages)
    assert m.blocks_cached > 0


def test_fake_source_replays_then_holds() -> None:
    a1, a2 = fake_model("a", alloc_blocks=1), fake_model("a", alloc_blocks=2)
    src = FakeSource([(a1,), (a2,)])
    first, second, third = src.read("a"), src.read("a"), src.read(None)
    assert first.models[0].alloc_blocks == 1 and second.models[0].alloc_blocks == 2
    assert third.models == second.models and third.taken_at == second.taken_at and src.done
    assert second.detail is not None and second.detail.pages is not None and second.models[0].pages is None


# -- the live source and --once -----------------------------------------------------------------

def test_live_source_reads_the_page_map_of_the_selected_model_only(spawn_allocator) -> None:
    for name in ("m1", "m2"):
        proc = spawn_allocator(name)
        send(proc, "ids = m.alloc(6)")
    src = LiveSource()
    frame = src.read("m2")
    assert [m.name for m in frame.models] == ["m1", "m2"]
    assert all(m.pages is None for m in frame.models)
    assert frame.detail is not None and frame.detail.name == "m2" and isinstance(frame.detail.pages, array)
    assert frame.detail.blocks_used == 6 and frame.host_capacity == 2048 * MiB
    assert src.read(None).detail is None
    if not frame.gpus:
        assert frame.gpu_note


def test_once_renders_everything() -> None:
    console = Console(record=True, width=120, force_terminal=False)
    src = sample_fleet(big_pages=2000)
    for _ in src.script:
        frame = src.read("qwen2-7b")
    for renderable in render(frame, width=120, model="qwen2-7b"):
        console.print(renderable)
    out = console.export_text()
    for text in ("no NVIDIA GPU: host backend", "qwen2-7b", "shrinking", "stale", "legacy",
                 "page map · qwen2-7b", "fragmentation", "limit is", "deferred"):
        assert text in out, text


def test_print_once_unknown_model_is_one_line(capsys) -> None:
    assert print_once(sample_fleet(big_pages=2000), model="nope") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvtop: no model named 'nope'")


def run_kvtop(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVTOP, *args], capture_output=True, text=True, timeout=timeout, env=child_env(),
                          stdin=subprocess.DEVNULL)


def test_without_a_terminal_kvtop_prints_one_snapshot(spawn_allocator) -> None:
    proc = spawn_allocator("served", script="ids = m.alloc(12)\n")
    send(proc, "m.set_limit(3 * 1024 * 1024)")  # 3 pages in use: applied
    result = run_kvtop()  # stdout is a pipe: --once by itself
    assert result.returncode == 0, result.stderr
    assert "served" in result.stdout
    gpus = nvml.probe()  # the device panel is what NVML reports on this host: GPU bars, or the host bar and why
    if gpus:
        assert all(f"GPU {gpu.index}" in result.stdout for gpu in gpus) and "no NVIDIA GPU" not in result.stdout
    else:
        assert "no NVIDIA GPU: host backend" in result.stdout
        assert (nvml.unavailable_reason() if not nvml.available() else "NVML reports no GPU") in result.stdout
    assert "\x1b[" not in result.stdout  # no colour codes into a pipe
    result = run_kvtop("--once", "--model", "serv")
    assert result.returncode == 0, result.stderr
    assert "page map · served" in result.stdout and "fragmentation" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("--interval", "0"), "--interval"),
    (("--interval", "fast"), "--interval"),
    (("--gpu", "zero"), "--gpu"),
    (("--gpu", "-1"), "--gpu"),
    (("--bogus",), "--bogus"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message) -> None:
    result = run_kvtop(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvtop: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_once_with_an_unknown_model_exits_1(shm_dir) -> None:
    result = run_kvtop("--once", "--model", "ghost")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "kvtop: no model named 'ghost' (known: none running)\n"
    assert not os.listdir(shm_dir)


def test_help_and_version() -> None:
    result = run_kvtop("--help")
    assert result.returncode == 0 and "--demo" in result.stdout and "--readonly" in result.stdout
    result = run_kvtop("--version")
    assert result.returncode == 0 and "kvtop" in result.stdout


def test_the_fragmentation_panel_shows_compaction_once_one_happened() -> None:
    from kvcached_core.segment.snapshot import CompactInfo
    from kvtop.screen.view import frag_table

    def text(m) -> str:
        console = Console(record=True, width=60, force_terminal=False)
        console.print(frag_table(m))
        return console.export_text()

    m = fake_model("m", pages=fake_pages(64, inuse=20, reserved=4, bpp=8, seed=3), pages_total=64)
    none_yet = replace(m, compaction=CompactInfo(True, 0, 0, 0, 0, 0.0))
    assert "compacted" not in text(m) and "compacted" not in text(none_yet)
    done = replace(m, compaction=CompactInfo(True, 3, 40, 80 * MiB, 1024 * MiB, 0.0123))
    out = text(done)
    assert "compacted" in out and "1.0 GiB (3×)" in out, out
    assert "80.0 MiB, last 12.3 ms" in out, out
