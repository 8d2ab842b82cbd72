"""What kvtop shows and logs of the models it watches: a model's KV cache groups, a policy kvctl sets, memory one
model gives another, a model waiting for memory, models appearing and going stale. Driven by key presses
(Textual's pilot) against real allocators in child processes."""

from __future__ import annotations

import io
import re

import pytest
from conftest import send
from kvtop_pilot import MiB, drive, log_has, panel_text, seen, until
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static

from kvcached_core.control.policy import request_policy
from kvcached_core.segment.reader import snapshot as read_model
from kvtop.frames.source import LiveSource
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.widgets import DetailsScreen


def test_the_details_screen_shows_each_kv_cache_group(spawn_allocator) -> None:
    groups = [("sliding window", 256, 1, 3, 2, 2), ("full attention", None, 1, 4, 0, 1)]
    spawn_allocator("m1", script=f"ids = m.alloc(8)\nm.publish_groups({groups!r})\n")
    app = KvtopApp(LiveSource(), interval=0.2)

    def details() -> str:
        console = Console(width=120, file=io.StringIO(), record=True)
        for widget in app.screen.query(Static):
            console.print(widget.content)
        return console.export_text()

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, DetailsScreen), "the details screen")
        text = " ".join(details().split())
        assert "group 0 sliding window 256, 1 layers: 3 active + 2 cached blocks on 2 pages" in text, text
        assert "group 1 full attention, 1 layers: 4 active + 0 cached blocks on 1 pages" in text, text

    drive(app, script)


def test_a_policy_set_by_kvctl_is_logged(spawn_allocator) -> None:
    spawn_allocator("m1")
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1"), "m1 on screen")
        request_policy("m1", min_bytes=2 * MiB, priority=4)
        await until(pilot, lambda: log_has(app, "m1 policy r1 applied: min 2.0 MiB, priority 4"), "the policy in the log")

    drive(app, script)


# Models of 1 MiB page bundles under one 26 MiB host budget (as tests/test_core_pressure.py).
GEOMETRY = dict(num_blocks=256, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
DONOR = """
active = m.alloc(8)
cached = m.alloc(80)
m.mark_cached(cached)
m.set_evict_handler(lambda: m.evict_for_limit())
"""
ASKER = """
import threading, time
got = []
def grab(blocks):
    deadline = time.monotonic() + 60
    while len(got) < blocks and time.monotonic() < deadline:
        ids = m.alloc(4)
        if ids is None:
            time.sleep(0.01)
        else:
            got.extend(ids)
"""


@pytest.fixture
def budget(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "26MiB")
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")  # the donor's warm pool stays: it gives it first


def test_memory_one_model_gives_another_is_an_event(budget, spawn_allocator) -> None:
    spawn_allocator("idle", script=DONOR, **GEOMETRY)
    app = KvtopApp(LiveSource(), interval=0.2)
    gave = re.compile(r"idle gave (\d+\.\d) MiB to busy \(cached (\d+\.\d) MiB, reserved (\d+(?:\.\d)?) (MiB|B)\) "
                      r"in \d+ ms")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "idle", lambda m: m.mapped_bytes >= 22 * MiB), "the donor's pages")
        busy = spawn_allocator("busy", script=ASKER, **GEOMETRY)
        await until(pilot, lambda: seen(app, "busy"), "the asker on screen")
        send(busy, "threading.Thread(target=grab, args=(40,), daemon=True).start()")  # more than the budget leaves
        await until(pilot, lambda: any(gave.search(line) for line in app.event_log.lines_text), "the reclaim event")
        await until(pilot, lambda: read_model("busy").blocks_used == 40, "the asker's blocks")

    drive(app, script)
    lines = [line for line in app.event_log.lines_text if " gave " in line]
    donor, asker = read_model("idle").pressure, read_model("busy").pressure
    assert donor is not None and asker is not None and donor.gave_count >= 1
    given = 0.0
    for line in lines:
        match = gave.search(line)
        assert match, lines
        size, cached = float(match[1]), float(match[2])
        reserved = float(match[3]) if match[4] == "MiB" else 0.0
        assert size == cached + reserved and cached > 0, line  # the donor's engine evicted whole cached pages
        given += size
    assert given * MiB <= donor.gave_total == asker.took_total  # a line per refresh, each the last reclaim's figures


def test_a_model_waiting_for_memory_is_marked(budget, spawn_allocator) -> None:
    spawn_allocator("idle", script=DONOR, min_bytes=24 * MiB, **GEOMETRY)  # it gives nothing: at its min
    app = KvtopApp(LiveSource(), interval=0.2, model="busy")

    def row(name: str) -> str:
        return app.table.render_line(1 + app.table.order.index(name)).text

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "idle", lambda m: m.mapped_bytes >= 22 * MiB), "the donor's pages")
        busy = spawn_allocator("busy", script=ASKER, **GEOMETRY)
        await until(pilot, lambda: seen(app, "busy"), "the asker on screen")
        send(busy, "threading.Thread(target=grab, args=(40,), daemon=True).start()")
        await until(pilot, lambda: seen(app, "busy", lambda m: m.pressure is not None and m.pressure.wanted_bytes > 0),
                    "the asker waiting for memory")
        await until(pilot, lambda: "live ↑" in row("busy"), "the marker on the asker's row")
        frame = app.frame
        assert frame is not None
        for m in frame.models:  # a row is marked exactly when its model waits (its own warm pool counts too)
            assert ("↑" in row(m.name)) == (m.pressure is not None and m.pressure.wanted_bytes > 0), m
        await until(pilot, lambda: "wants ↑" in panel_text(app), "what it waits for in the panel")

    drive(app, script)


def test_events_follow_models_appearing_and_going_stale(spawn_allocator) -> None:
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: log_has(app, "watching 0 models"), "the first refresh")
        proc = spawn_allocator("late")
        await until(pilot, lambda: log_has(app, "late appeared"), "the appearance")
        send(proc, "ids = m.alloc(6)")
        await until(pilot, lambda: seen(app, "late", lambda m: m.blocks_used == 6), "the allocation on screen")
        proc.kill()
        proc.wait()
        await until(pilot, lambda: log_has(app, "late went stale"), "the model going stale")
        assert app.table.order == ["late"]

    drive(app, script)
