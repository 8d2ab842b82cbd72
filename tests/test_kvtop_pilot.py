"""kvtop driven by key presses (Textual's pilot) against real allocators in child processes."""

from __future__ import annotations

import asyncio
import io
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
from conftest import kvctl, send
from fakes import FAKE_T0, FakeSource, fake_model, fake_pages, sample_fleet
from rich.console import Console
from textual.command import CommandPalette
from textual.pilot import Pilot
from textual.widgets import OptionList, Static

import kvcached_core as kc
from kvcached_core.control.policy import request_policy
from kvcached_core.segment.reader import snapshot as read_model
from kvcached_core.segment.snapshot import Traffic
from kvtop.actions import KEY_NAMES
from kvtop.dashboard import KvtopApp
from kvtop.source import Frame, LiveSource
from kvtop.widgets import ConfirmScreen, DetailsScreen, FilterScreen, HelpScreen, LimitScreen, PolicyScreen

MiB = 1024 * 1024
BUNDLE = 256 * 1024 * 2 * 2  # spawn_allocator's page bundle: 256 KiB pages x 2 layers x K/V = 1 MiB
TIMEOUT_S = 30.0


def drive(app: KvtopApp, script: Callable[[Pilot], Awaitable[None]], size: tuple[int, int] = (140, 44)) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await script(pilot)

    asyncio.run(main())


async def until(pilot: Pilot, condition: Callable[[], object], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await pilot.pause(0.05)
    log = "\n".join(line for line in pilot.app.event_log.lines_text) if hasattr(pilot.app, "event_log") else ""
    raise AssertionError(f"timed out waiting for {what}; the event log:\n{log}")


def log_has(app: KvtopApp, text: str) -> bool:
    return any(text in line for line in app.event_log.lines_text)


def seen(app: KvtopApp, name: str, check: Callable[[kc.ModelSnapshot], bool] = lambda m: True) -> bool:
    m = app.frame.model(name) if app.frame else None
    return m is not None and check(m)


async def confirmed(pilot: Pilot, app: KvtopApp, key: str) -> None:
    """Once m1 is on screen and selected, press ``key`` and say yes in its confirm dialog."""
    await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
    await pilot.press(key)
    await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog")
    await pilot.press("y")


def test_t_then_y_trims_the_selected_model(spawn_allocator) -> None:
    proc = spawn_allocator("m1", script="ids = m.alloc(20)\n")
    send(proc, "m.try_to_reserve(40)")  # maps 5 more pages up front: reserved, empty
    before = read_model("m1")
    assert before.pages_reserved >= 5
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await confirmed(pilot, app, "t")
        await until(pilot, lambda: read_model("m1").trim_ack_seq >= 1, "the segment to acknowledge the trim")
        await until(pilot, lambda: log_has(app, "trim acknowledged"), "the trim in the event log")

    drive(app, script)
    after = read_model("m1")
    assert after.trim_seq == after.trim_ack_seq == 1
    assert after.trim_bytes >= 5 * BUNDLE and after.trim_bytes % BUNDLE == 0  # whole reserved pages
    assert after.pages_reserved == 0
    assert after.blocks_used == 20  # pages in use untouched
    assert log_has(app, f"trim acknowledged: {kc.format_bytes(after.trim_bytes)} returned")


class RefreshFirst(LiveSource):
    """A live source whose trim answers only after kvtop's own refresh has shown the acknowledgement:
    the order a busy machine can produce, forced."""

    app: KvtopApp

    def trim(self, model: kc.ModelSnapshot, wait: float) -> kc.Ack:
        ack = super().trim(model, wait)
        deadline = time.monotonic() + TIMEOUT_S
        while not seen(self.app, model.name, lambda m: m.trim_ack_seq >= ack.revision):
            assert time.monotonic() < deadline, "the refresh never showed the acknowledgement"
            time.sleep(0.02)
        return ack


def test_a_trim_the_refresh_sees_first_is_logged_once_with_its_latency(spawn_allocator) -> None:
    proc = spawn_allocator("m1", script="ids = m.alloc(20)\n")
    send(proc, "m.try_to_reserve(40)")
    source = RefreshFirst()
    app = source.app = KvtopApp(source, interval=0.2)

    async def script(pilot: Pilot) -> None:
        await confirmed(pilot, app, "t")
        await until(pilot, lambda: log_has(app, "trim acknowledged"), "the trim in the event log")
        await pilot.pause(0.5)  # refreshes after the answer log nothing more about it

    drive(app, script)
    lines = [line for line in app.event_log.lines_text if "trim" in line and "requested" not in line]
    assert len(lines) == 1 and " ms; " in lines[0], lines


def test_l_sets_a_limit_deferred_then_a_percentage(spawn_allocator) -> None:
    spawn_allocator("m1", script="ids = m.alloc(20)\n")  # 5 pages in use (4 blocks per page)
    capacity = read_model("m1").device_capacity
    assert capacity == 2048 * MiB
    app = KvtopApp(LiveSource(), interval=0.2)

    async def set_limit(pilot: Pilot, text: str) -> None:
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LimitScreen), "the limit dialog")
        await pilot.press(*text)
        await pilot.press("enter")
        await until(pilot, lambda: not isinstance(app.screen, LimitScreen), "the dialog to close")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1"), "m1 on screen")
        await set_limit(pilot, "3MiB")  # below the 5 MiB in use: deferred
        await until(pilot, lambda: read_model("m1").applied_revision >= 1, "revision 1 acknowledged")
        await until(pilot, lambda: log_has(app, "limit r1 acknowledged: deferred"), "the deferral in the log")
        await until(pilot, lambda: seen(app, "m1", lambda m: m.display_status == "shrinking"), "m1 shown shrinking")
        snap = read_model("m1")
        assert (snap.limit_revision, snap.limit_status, snap.requested_limit) == (1, "deferred", 3 * MiB)
        await set_limit(pilot, "30%")
        await until(pilot, lambda: read_model("m1").applied_revision >= 2, "revision 2 acknowledged")
        await until(pilot, lambda: log_has(app, "limit r2 acknowledged: applied"), "the new limit in the log")

    drive(app, script)
    snap = read_model("m1")
    wanted = int(capacity * 0.3)
    assert snap.limit_revision == snap.applied_revision == 2
    assert snap.limit_status == "applied"
    assert snap.requested_limit == wanted
    assert snap.limit_bytes == wanted // BUNDLE * BUNDLE


def test_the_limit_dialog_checks_as_you_type_and_follows_the_model(spawn_allocator) -> None:
    """A bad size is explained before Enter, a good one previewed; the model's current figures follow each refresh."""
    proc = spawn_allocator("m1", script="ids = m.alloc(8)\n")  # 2 pages in use
    app = KvtopApp(LiveSource(), interval=0.1)

    def shown(part: str) -> str:
        return str(app.screen.query_one(part).render())

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1", lambda m: m.pages_inuse == 2), "m1 on screen")
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LimitScreen), "the limit dialog")
        assert "in use 2.0 MiB" in shown("#detail")
        await pilot.press(*"12 parsecs")
        await until(pilot, lambda: "unknown unit 'parsecs'" in shown("#error"), "the error, without Enter")
        assert app.screen.has_class("-invalid") and shown("#preview") == ""
        for _ in range(len("12 parsecs")):
            await pilot.press("backspace")
        await pilot.press(*"8MiB")
        await until(pilot, lambda: "= 8.0 MiB" in shown("#preview"), "the preview")
        assert shown("#error") == "" and not app.screen.has_class("-invalid")
        send(proc, "more = m.alloc(16)")  # 4 more pages in use while the dialog is open
        await until(pilot, lambda: "in use 6.0 MiB" in shown("#detail"), "the current figures refreshed")
        await pilot.press("escape")

    drive(app, script)
    assert read_model("m1").limit_revision == 0


def test_the_sleep_dialog_says_what_is_released_and_every_wake_is_logged_with_its_cause(spawn_allocator) -> None:
    """The sleep dialog's figures follow the model until it is confirmed, and the event log says who woke it:
    a request reaching the engine (no revision), or a controller's wake (a revision)."""
    proc = spawn_allocator("m1", script=SLEEPER)  # 20 blocks: 5 pages in use
    app = KvtopApp(LiveSource(), interval=0.1)

    def detail() -> str:
        return str(app.screen.query_one("#detail").render())

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the sleep dialog")
        mapped = read_model("m1").mapped_bytes
        assert f"{kc.format_bytes(mapped)} mapped now" in detail()
        send(proc, "more = m.alloc(16)")  # 4 pages more while the dialog is open: the figure follows
        await until(pilot, lambda: f"{kc.format_bytes(read_model('m1').mapped_bytes)} mapped now" in detail()
                    and read_model("m1").mapped_bytes > mapped, "the dialog's figures refreshed")
        send(proc, "m.free(more)")
        await until(pilot, lambda: read_model("m1").blocks_used == 20, "the extra blocks freed")
        await pilot.press("y")
        await until(pilot, lambda: log_has(app, "sleep acknowledged: asleep") or log_has(app, "asleep: "),
                    "the sleep in the event log")
        send(proc, "m.sleep.wake()")  # the engine took a request: no controller, no revision
        await until(pilot, lambda: log_has(app, "woken by a request"), "the request's wake in the log")
        assert kvctl("sleep", "m1", "--wait", "10").exit_code == 0
        assert kvctl("wake", "m1", "--wait", "10").exit_code == 0
        await until(pilot, lambda: log_has(app, "woken by a wake request"), "kvctl's wake in the log")

    drive(app, script)


def test_invalid_limit_keeps_the_dialog_open_and_writes_nothing(spawn_allocator) -> None:
    spawn_allocator("m1")
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1"), "m1 on screen")
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LimitScreen), "the limit dialog")
        await pilot.press(*"12 parsecs", "enter")
        await pilot.pause(0.2)
        assert isinstance(app.screen, LimitScreen)
        error = str(app.screen.query_one("#error").render())
        assert "unknown unit 'parsecs'" in error
        assert app.screen.has_class("-invalid")
        for _ in range(len("12 parsecs")):
            await pilot.press("backspace")
        await pilot.press(*"-5G", "enter")
        await pilot.pause(0.2)
        assert "cannot be negative" in str(app.screen.query_one("#error").render())
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, LimitScreen), "escape to close the dialog")

    drive(app, script)
    snap = read_model("m1")
    assert snap.limit_revision == 0 and snap.limit_bytes is None


def test_readonly_refuses_trim_limit_and_policy_and_says_so(spawn_allocator) -> None:
    proc = spawn_allocator("m1", script="ids = m.alloc(8)\n")
    send(proc, "m.try_to_reserve(40)")
    app = KvtopApp(LiveSource(), interval=0.2, readonly=True)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1"), "m1 on screen")
        for key in ("t", "T", "l", "p"):
            await pilot.press(key)
            await pilot.pause(0.1)
            assert not isinstance(app.screen, ConfirmScreen | LimitScreen | PolicyScreen)
        await until(pilot, lambda: sum("read-only" in line for line in app.event_log.lines_text) == 4,
                    "four read-only refusals in the log")
        assert log_has(app, "read-only: policy is disabled")
        assert "read-only" in app.status_line.render().plain  # type: ignore[union-attr]

    drive(app, script)
    snap = read_model("m1")
    assert snap.trim_seq == 0 and snap.limit_revision == 0 and snap.pages_reserved > 0
    assert snap.pressure is not None and snap.pressure.policy_revision == 0


def panel_text(app: KvtopApp) -> str:
    """The selected model's panel (fragmentation, policy, reclaim) as plain text."""
    console = Console(width=60, file=io.StringIO(), record=True)
    console.print(app.frag.render())
    return console.export_text()


async def open_policy(pilot: Pilot, app: KvtopApp) -> None:
    await pilot.press("p")
    await until(pilot, lambda: isinstance(app.screen, PolicyScreen), "the policy dialog")


def test_p_sets_min_and_priority_and_bad_input_keeps_the_dialog_open(spawn_allocator) -> None:
    spawn_allocator("m1", script="ids = m.alloc(8)\n")
    assert kc.request_limit("m1", 32 * MiB).status == "applied"
    app = KvtopApp(LiveSource(), interval=0.2)

    def error(app: KvtopApp) -> str:
        return str(app.screen.query_one("#error").render())

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
        await open_policy(pilot, app)
        await pilot.press(*"64MiB", "enter")  # above its limit: refused in the dialog, nothing written
        await until(pilot, lambda: "above m1's limit" in error(app), "the reason in the dialog")
        assert isinstance(app.screen, PolicyScreen) and app.screen.has_class("-invalid")
        for _ in range(len("64MiB")):
            await pilot.press("backspace")
        await pilot.press(*"4MiB", "tab", *"5000", "enter")
        await until(pilot, lambda: "from -1000 to 1000, not 5000" in error(app),
                    f"the priority refused (the dialog says {error(app)!r})")
        for _ in range(len("5000")):
            await pilot.press("backspace")
        await pilot.press(*"7", "enter")
        await until(pilot, lambda: not isinstance(app.screen, PolicyScreen), "the dialog to close")
        await until(pilot, lambda: log_has(app, "m1 policy r1 acknowledged: applied, min 4.0 MiB, priority 7 in "),
                    "the acknowledgement in the event log")
        await until(pilot, lambda: re.search(r"min +4\.0 MiB\n *priority +7\n", panel_text(app)),
                    "the policy in the selected model's panel")
        await open_policy(pilot, app)  # an empty min stays as it is
        await pilot.press("tab", *"-3", "enter")
        await until(pilot, lambda: log_has(app, "policy r2 acknowledged: applied, min 4.0 MiB, priority -3"),
                    "the second acknowledgement")
        await pilot.pause(0.5)  # refreshes after the answer log nothing more about it

    drive(app, script)
    snap = read_model("m1")
    assert snap.pressure is not None and snap.pressure.policy_dict() == {"min_bytes": 4 * MiB, "priority": -3}
    assert snap.pressure.policy_revision == 2
    assert sum("policy r" in line for line in app.event_log.lines_text) == 2  # each logged once


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


def test_p_on_an_upstream_segment_says_why_not() -> None:
    app = KvtopApp(sample_fleet(), interval=0.2, model="kvcached_vllm_3311")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.selected == "kvcached_vllm_3311", "the upstream row selected")
        await pilot.press("p")
        await until(pilot, lambda: said(app, "kvcached_vllm_3311 is an upstream kvcached segment: it has no memory "
                                             "policy"), "the notice")
        assert not isinstance(app.screen, PolicyScreen)

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


def test_trim_all_from_the_command_palette(spawn_allocator) -> None:
    procs = [spawn_allocator(name, script="ids = m.alloc(4)\n") for name in ("a1", "a2")]
    for proc in procs:
        send(proc, "m.try_to_reserve(24)")
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "a1") and seen(app, "a2"), "both models on screen")
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette), "the command palette")
        await pilot.press(*"trim all")
        options = app.screen.query_one(OptionList)

        def trim_all_highlighted() -> bool:
            at = options.highlighted
            return at is not None and str(options.get_option_at_index(at).prompt).startswith("Trim all")

        await until(pilot, trim_all_highlighted, "'Trim all' highlighted in the palette")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog")
        await pilot.press("enter")  # Enter confirms too
        await until(pilot, lambda: all(read_model(n).trim_ack_seq >= 1 for n in ("a1", "a2")), "both trims acked")
        await until(pilot, lambda: sum("trim acknowledged" in line or "trimmed:" in line
                                       for line in app.event_log.lines_text) >= 2, "two trims in the log")

    drive(app, script)
    for name in ("a1", "a2"):
        snap = read_model(name)
        assert snap.pages_reserved == 0 and snap.blocks_used == 4


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


@pytest.mark.parametrize("keys, check", [
    (("s",), lambda app: app.sort_key == "mapped"),
    (("space",), lambda app: app.paused and "PAUSED" in app.status_line.render().plain),
    (("minus",), lambda app: app.interval == 0.25),
    (("plus",), lambda app: app.interval == 0.1),
])
def test_view_keys_change_state(spawn_allocator, keys, check) -> None:
    spawn_allocator("m1")
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1"), "m1 on screen")
        await pilot.press(*keys)
        await pilot.pause(0.1)
        assert check(app)

    drive(app, script)


class HeldReads(LiveSource):
    """A live source whose reads wait while ``hold`` is set (``holding`` says one waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.holding = threading.Event(), threading.Event()

    def read(self, selected: str | None) -> Frame:
        deadline = time.monotonic() + TIMEOUT_S
        while self.hold.is_set() and time.monotonic() < deadline:
            self.holding.set()
            time.sleep(0.01)
        return super().read(selected)


def test_paused_kvtop_stops_reading(spawn_allocator) -> None:
    """Paused, the screen stands still: no read starts, and a read that was in flight is not shown."""
    proc = spawn_allocator("m1")
    source = HeldReads()
    app = KvtopApp(source, interval=0.1)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1"), "m1 on screen")
        source.hold.set()  # the poller's next read waits until the pause is on: a read in flight
        await until(pilot, source.holding.is_set, "a read in flight")
        await pilot.press("space")
        frames = app.frames_seen
        send(proc, "ids = m.alloc(9)")
        source.hold.clear()
        await pilot.pause(0.6)
        assert app.frames_seen == frames and app.frame.model("m1").blocks_used == 0
        await pilot.press("space")
        await until(pilot, lambda: seen(app, "m1", lambda m: m.blocks_used == 9), "fresh frames after resuming")

    drive(app, script)


COMPACTABLE = """
from kvcached_core.allocator.compact import host_copy
ids = [m.alloc(1)[0] for _ in range(4 * m.blocks_per_page)]
bpp = m.blocks_per_page
m.free([b for b in ids if b % bpp >= 2])  # four pages keep two blocks each
m.mark_cached([b for b in ids if b % bpp < 2])
m.set_compact_handler(lambda moves: host_copy(m.backend, m.block_bytes, moves))
"""


def test_c_then_y_compacts_the_selected_model_and_readonly_refuses(spawn_allocator, monkeypatch) -> None:
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")  # emptied pages are unmapped, not pooled
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    spawn_allocator("m1", policy="best-fit", script=COMPACTABLE)
    before = read_model("m1")
    assert before.pages_inuse == 4 and before.blocks_cached == 8

    readonly = KvtopApp(LiveSource(), interval=0.2, readonly=True)

    async def refused(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(readonly, "m1"), "m1 on screen")
        await pilot.press("c")
        await pilot.pause(0.1)
        assert not isinstance(readonly.screen, ConfirmScreen)
        await until(pilot, lambda: log_has(readonly, "read-only: compact is disabled"), "the refusal in the log")

    drive(readonly, refused)
    assert read_model("m1").compaction.acked_seq == 0  # type: ignore[union-attr]

    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await confirmed(pilot, app, "c")
        await until(pilot, lambda: log_has(app, "compaction acknowledged"), "the compaction in the event log")

    drive(app, script)
    after = read_model("m1")
    assert after.compaction is not None and after.compaction.acked_seq == 1
    assert after.pages_inuse == 2 and after.blocks_cached == 8  # the packed floor; nothing dropped from the cache
    assert log_has(app, f"compaction acknowledged: {kc.format_bytes(2 * BUNDLE)} returned, "
                        f"{kc.format_bytes(4 * 64 * 1024 * 4)} copied")


# An engine that frees its blocks when asked to sleep and takes them again on a wake (its poller thread).
SLEEPER = """
held = m.alloc(20)
def handler(action):
    global held
    if action.startswith("sleep"):
        m.free(held)
        held = []
        m.sleep.ready()
    else:
        held = m.alloc(20)
m.set_sleep_handler(handler)
"""


def test_w_then_y_puts_the_selected_model_to_sleep_and_wakes_it(spawn_allocator) -> None:
    spawn_allocator("m1", script=SLEEPER)
    before = read_model("m1")
    assert before.mapped_bytes > 0 and before.sleep is not None and before.sleep.state == "awake"

    readonly = KvtopApp(LiveSource(), interval=0.2, readonly=True)

    async def refused(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(readonly, "m1"), "m1 on screen")
        await pilot.press("w")
        await pilot.pause(0.1)
        assert not isinstance(readonly.screen, ConfirmScreen)
        await until(pilot, lambda: log_has(readonly, "read-only: sleep/wake is disabled"), "the refusal in the log")

    drive(readonly, refused)
    assert read_model("m1").sleep.acked_revision == 0  # type: ignore[union-attr]

    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog")
        assert "sleep" in str(app.screen.question).lower()  # type: ignore[attr-defined]
        await pilot.press("n")  # cancelled: nothing is asked
        await pilot.pause(0.2)
        assert read_model("m1").sleep.state == "awake"  # type: ignore[union-attr]
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog again")
        await pilot.press("y")
        # The ack may come while the model drains (then a second line says when it is asleep) or once asleep.
        await until(pilot, lambda: log_has(app, "sleep acknowledged: asleep") or log_has(app, "asleep: "),
                    "the sleep in the event log")
        # The table says it sleeps; the next press offers to wake it.
        await until(pilot, lambda: "asleep" in app.table.render_line(1).text, "asleep in the status column")
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the wake dialog")
        assert "wake" in str(app.screen.question).lower()  # type: ignore[attr-defined]
        await pilot.press("y")
        await until(pilot, lambda: log_has(app, "wake acknowledged: awake"), "the wake in the event log")
        # The wake is acknowledged before the engine's handler allocates again.
        await until(pilot, lambda: read_model("m1").blocks_used == 20, "the engine's blocks back")

    drive(app, script)
    after = read_model("m1")
    assert after.sleep is not None and after.sleep.state == "awake" and after.sleep.acked_revision == 2
    assert after.sleep.slept_bytes >= before.mapped_bytes and after.blocks_used == 20


def test_w_on_a_model_that_cannot_sleep_says_why(spawn_allocator) -> None:
    spawn_allocator("m1", script="ids = m.alloc(4)\n")
    app = KvtopApp(LiveSource(), interval=0.2)
    notes: list[str] = []

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
        app.notify = lambda message, **kw: notes.append(str(message))  # type: ignore[method-assign]
        await pilot.press("w")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, ConfirmScreen)

    drive(app, script)
    assert notes == ["m1 cannot sleep: its engine (custom) registered no sleep handler"]
    assert read_model("m1").sleep.acked_revision == 0  # type: ignore[union-attr]


SLOW_SLEEPER = """
import threading
held = m.alloc(20)
go = threading.Event()  # the test sets it once kvtop logged the drain
def handler(action):
    global held
    if action.startswith("sleep"):  # a request still running: the engine drains until the test says go
        def finish():
            global held
            go.wait()
            m.free(held)
            held = []
            m.sleep.ready()
        threading.Thread(target=finish, daemon=True).start()
m.set_sleep_handler(handler)
"""


def test_a_sleep_acknowledged_while_draining_is_logged_again_once_asleep(spawn_allocator) -> None:
    proc = spawn_allocator("m1", script=SLOW_SLEEPER)
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await confirmed(pilot, app, "w")
        await until(pilot, lambda: log_has(app, "sleep acknowledged: draining"), "the draining ack in the event log")
        assert not log_has(app, "asleep: ")
        send(proc, "go.set()")
        await until(pilot, lambda: log_has(app, "asleep: "), "the model asleep in the event log")

    drive(app, script)
    assert read_model("m1").sleep.state == "asleep"  # type: ignore[union-attr]


# -- every key the help screen lists does what it says ----------------------------------------------

def names(app: KvtopApp) -> list[str]:
    return [m.name for m in app._visible]


def at(app: KvtopApp, index: int) -> None:
    app.selected = names(app)[index]


def dialog(kind: type, question: str = "") -> Callable[[KvtopApp], bool]:
    return lambda app: isinstance(app.screen, kind) and question in str(getattr(app.screen, "question", ""))


def said(app: KvtopApp, text: str) -> bool:
    return any(note.message == text for note in app._notifications)


def zoomed(app: KvtopApp) -> None:
    """The page map zoomed to one page per cell (the 100k-page model's map is rows longer than the screen)."""
    while app.pagemap.zoom_in():
        pass


# action -> (set up before the key, the effect the key must have). The setups put the app where the
# key has something to do: a selection to move, a page map longer than the screen. A setup that returns
# False has not taken hold yet and is run again at the next look.
KEY_EFFECTS: dict[str, tuple[Callable[[KvtopApp], bool | None], Callable[[KvtopApp], bool]]] = {
    "quit": (lambda app: None, lambda app: app.return_code == 0),
    "help": (lambda app: None, lambda app: isinstance(app.screen, HelpScreen)),
    "cursor(1)": (lambda app: at(app, 0), lambda app: app.selected == names(app)[1]),
    "cursor(-1)": (lambda app: at(app, 2), lambda app: app.selected == names(app)[1]),
    "cursor(-1000000)": (lambda app: at(app, 3), lambda app: app.selected == names(app)[0]),
    "cursor(1000000)": (lambda app: at(app, 0), lambda app: app.selected == names(app)[-1]),
    "switch_arrows": (lambda app: None, lambda app: app.map_column.has_class("-arrows")
                      and not app.table.has_class("-arrows")),
    "map_scroll(-1)": (zoomed, lambda app: app.pagemap.scroll_y == 4),
    "map_scroll(1)": (zoomed, lambda app: app.pagemap.scroll_y == 1),
    "details": (lambda app: at(app, 2), lambda app: isinstance(app.screen, DetailsScreen)
                and app.screen.model.name == names(app)[2]),  # type: ignore[attr-defined]
    "trim": (lambda app: at(app, 2), dialog(ConfirmScreen, "Trim llama-3-8b?")),
    "trim_all": (lambda app: None, dialog(ConfirmScreen, "Trim all")),
    # The sample fleet's segments are upstream ones: these two keys say why not (the live tests above say yes).
    "compact": (lambda app: at(app, 2), lambda app: said(app, "llama-3-8b is an upstream kvcached segment: "
                                                          "it cannot be compacted")),
    "sleep_wake": (lambda app: at(app, 2), lambda app: said(app, "llama-3-8b is an upstream kvcached segment: "
                                                             "it cannot sleep")),
    "limit": (lambda app: at(app, 2), dialog(LimitScreen)),
    "policy": (lambda app: at(app, 2), dialog(PolicyScreen)),
    "cycle_sort": (lambda app: None, lambda app: app.sort_key == "mapped"),
    "filter": (lambda app: None, dialog(FilterScreen)),
    "pause": (lambda app: None, lambda app: app.paused and "PAUSED" in app.status_line.render().plain),
    "faster": (lambda app: None, lambda app: app.interval == 0.1),
    "slower": (lambda app: None, lambda app: app.interval == 0.25),
    "zoom_in": (lambda app: app.pagemap.total > 0, lambda app: app.pagemap.zoom is not None),
    # zoomed in once the selected model's page map is there (before it arrives zoom_in does nothing)
    "zoom_out": (lambda app: app.pagemap.zoom is not None or app.pagemap.zoom_in(),
                 lambda app: app.pagemap.zoom is None),
    "map_page(1)": (zoomed, lambda app: app.pagemap.scroll_y > 1),
    "map_page(-1)": (zoomed, lambda app: app.pagemap.scroll_y < 29),
    "command_palette": (lambda app: None, lambda app: isinstance(app.screen, CommandPalette)),
}
# The row the zoomed page map starts at before the key: scrolled to once the zoom is laid out (on a loaded
# host that takes a few refreshes; a scroll asked before it is clamped to the unzoomed map's height).
START_ROW = {"map_scroll(-1)": 5, "map_scroll(1)": 0, "map_page(1)": 0, "map_page(-1)": 30}
HELP_KEYS = [(key, action) for keys, action, _ in KvtopApp.help_keys() for key in keys]


def test_every_action_the_help_lists_has_its_effect_checked() -> None:
    assert {action for _key, action in HELP_KEYS} == set(KEY_EFFECTS)
    assert {"down", "up", "home", "end", "left", "right", "j", "k"} <= {key for key, _ in HELP_KEYS}


@pytest.mark.parametrize("key, action", HELP_KEYS, ids=[f"{key}-{action}" for key, action in HELP_KEYS])
def test_every_key_the_help_lists_does_what_it_says(key: str, action: str) -> None:
    """Pressed as a person presses it, on the screen as it starts (nothing focused but the dashboard)."""
    app = KvtopApp(sample_fleet(), interval=0.2)
    setup, effect = KEY_EFFECTS[action]

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frames_seen >= 2 and len(names(app)) == 5, "the sample fleet on screen")
        await until(pilot, lambda: setup(app) is not False, f"the setup for {action} in place")
        await pilot.pause(0.2)
        row = START_ROW.get(action)
        if row is not None:
            # zoomed again at every look: the selected model's page map may arrive after the setup ran
            await until(pilot, lambda: zoomed(app) or app.pagemap.max_scroll_y > 30, "the zoomed page map laid out")
            app.pagemap.scroll_to(y=row, animate=False, immediate=True, force=True)
            await until(pilot, lambda: app.pagemap.scroll_y == row, f"the page map at row {row}")
        assert not effect(app), f"{key}: the effect holds before the key is pressed"
        await pilot.press(key)
        await until(pilot, lambda: effect(app), f"{key} to {action}", timeout=10.0)

    drive(app, script, size=(120, 40))


def test_the_help_screen_lists_the_keys_the_tests_press() -> None:
    app = KvtopApp(sample_fleet(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frames_seen >= 1, "the first frame")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
        shown = [row[0] for row in app.screen.keys]  # type: ignore[attr-defined]
        assert shown == [" ".join(KEY_NAMES.get(k, k) for k in keys) for keys, _, _ in KvtopApp.help_keys()]
        assert {"↓ j", "↑ k", "home", "end", "←", "→"} <= set(shown)

    drive(app, script)


def busy_fleet(steps: int = 10) -> FakeSource:
    """Three models whose figures all grow, step by step: mapped and held from a few MiB to hundreds, their
    allocation rates and token rates from nothing to thousands; the set of models stays the same."""
    bpp = 8

    def model(name: str, pid: int, step: int) -> kc.ModelSnapshot:
        m = fake_model(name, pages=fake_pages(512, inuse=1 + step * step * 4, reserved=2, bpp=bpp, seed=pid),
                       pid=pid, page_size=256 * 1024, block_bytes=32 * 1024, num_layers=4,
                       alloc_blocks=10 * step ** 4)
        at = int((FAKE_T0 + step) * 1e9)
        return replace(m, traffic=Traffic(running=step, waiting=step % 4 * 7, finished=step * step,
                                          prompt_tokens=50 * step ** 3, generated_tokens=40 * step ** 4,
                                          preemptions=step // 3, last_request_ns=at - step * 7 * 10**9, read_ns=at))

    return FakeSource([tuple(model(n, 1300 + i, step) for i, n in enumerate(("llama-3-8b", "qwen2-7b", "phi-3")))
                       for step in range(steps)])


@pytest.mark.parametrize("width", [116, 148, 188])
def test_the_model_tables_columns_stay_while_the_models_stay(width: int) -> None:
    """Figures that widen frame after frame never swap one column for another: the columns are chosen for the
    models and the width, not for this frame's values (148 wide they went 'tok/s req/s wait engine pid dev',
    then 'tok/s wait idle engine pid dev', then '... dev min')."""
    source = busy_fleet()
    app = KvtopApp(source, interval=0.05)
    shown: list[list[str]] = []

    async def script(pilot: Pilot) -> None:
        frames = -1
        while not (source.done and app.frames_seen > len(source.script) + 1):
            await pilot.pause(0.01)
            if app.frames_seen != frames and app.frame is not None:
                frames = app.frames_seen
                if not shown or shown[-1] != app.table.headers:
                    shown.append(app.table.headers)

    drive(app, script, size=(width, 30))
    assert len(shown) == 1, shown


def test_columns_no_model_can_fill_are_left_out_until_one_can() -> None:
    """Traffic columns of models whose engines publish no traffic would only ever say '-': they make room for
    others, and come back when a model that publishes traffic appears."""
    quiet = tuple(replace(m, traffic=None) for m in busy_fleet(2).script[1])
    busy = busy_fleet(3).script[2]
    source = FakeSource([quiet, quiet, (*quiet[1:], busy[0])])  # the same models; llama's engine now publishes
    app = KvtopApp(source, interval=0.05)
    seen_headers: list[list[str]] = []

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frame is not None, "the first frame")
        seen_headers.append(app.table.headers)
        await until(pilot, lambda: source.done and app.frame.model("llama-3-8b").traffic is not None,
                    "the model that publishes traffic")
        await until(pilot, lambda: {"tok/s", "wait"} <= set(app.table.headers), "the traffic columns drawn")
        seen_headers.append(app.table.headers)

    drive(app, script, size=(200, 30))
    assert not {"tok/s", "req/s", "wait", "idle"} & set(seen_headers[0]), seen_headers[0]
    assert {"tok/s", "wait"} <= set(seen_headers[1]), seen_headers[1]


def test_tab_moves_the_arrow_keys_to_the_page_map_and_back() -> None:
    """Tab lights the page map's border and ↑/↓ scroll it; tab again, and they select models."""
    app = KvtopApp(sample_fleet(), interval=0.2, model="deepseek")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.selected == "deepseek-v3-100k" and app.frame.detail is not None,
                    "the 100k-page map")
        await until(pilot, lambda: zoomed(app) or app.pagemap.max_scroll_y > 3, "a page map longer than the screen")
        assert app.table.has_class("-arrows") and not app.map_column.has_class("-arrows")
        await pilot.press("tab")
        assert app.map_column.has_class("-arrows") and not app.table.has_class("-arrows")
        await pilot.press("down", "down")
        await until(pilot, lambda: app.pagemap.scroll_y == 2, "↓ to scroll the page map")
        assert app.selected == "deepseek-v3-100k"
        await pilot.press("tab", "down")
        await until(pilot, lambda: app.selected == "kvcached_vllm_3311", "↓ to select the next model again")
        assert app.table.has_class("-arrows")

    drive(app, script, size=(120, 40))


def test_zoom_keys_at_a_map_that_fits_say_there_is_nothing_to_zoom(spawn_allocator) -> None:
    """A page map that fits the screen at one page per cell: z and Z say one thing, not point at each other."""
    spawn_allocator("m1", script="ids = m.alloc(4)\n")
    app = KvtopApp(LiveSource(), interval=0.2)
    told: list[str] = []

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frame is not None and app.frame.detail is not None, "m1's page map")
        await until(pilot, lambda: app.pagemap.total > 0 and app.pagemap.fit() == 1, "the map at one page per cell")
        app.notify = lambda message, **kw: told.append(str(message))  # type: ignore[method-assign]
        await pilot.press("z")
        await pilot.press("Z")
        await pilot.pause(0.1)

    drive(app, script)
    assert told == ["the whole map fits at one page per cell: nothing to zoom"]
