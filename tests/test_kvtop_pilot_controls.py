"""kvtop's keys that act on a model (trim, trim all, limit, policy, compact, sleep and wake) and --readonly's
refusals, driven by key presses (Textual's pilot) against real allocators in child processes."""

from __future__ import annotations

import re
import time

from conftest import kvctl, send
from fakes import sample_fleet
from kvtop_pilot import TIMEOUT_S, MiB, drive, log_has, panel_text, said, seen, until
from textual.command import CommandPalette
from textual.pilot import Pilot
from textual.widgets import OptionList

import kvcached_core as kc
from kvcached_core.segment.reader import snapshot as read_model
from kvtop.frames.source import LiveSource
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.widgets import ConfirmScreen, LimitScreen, PolicyScreen

BUNDLE = 256 * 1024 * 2 * 2  # spawn_allocator's page bundle: 256 KiB pages x 2 layers x K/V = 1 MiB


async def confirmed(pilot: Pilot, app: KvtopApp, key: str) -> None:
    """Once m1 is on screen and selected, press ``key`` and say yes in its confirm dialog."""
    await until(pilot, lambda: seen(app, "m1") and app.selected == "m1", "m1 on screen")
    await pilot.press(key)
    await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirm dialog")
    await pilot.press("y")


def refuses_readonly(key: str, refusal: str) -> None:
    """A read-only kvtop, m1 on screen: ``key`` opens no confirm dialog and ``refusal`` reaches the event log."""
    readonly = KvtopApp(LiveSource(), interval=0.2, readonly=True)

    async def refused(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(readonly, "m1"), "m1 on screen")
        await pilot.press(key)
        await pilot.pause(0.1)
        assert not isinstance(readonly.screen, ConfirmScreen)
        await until(pilot, lambda: log_has(readonly, refusal), "the refusal in the log")

    drive(readonly, refused)


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


def test_p_on_an_upstream_segment_says_why_not() -> None:
    app = KvtopApp(sample_fleet(), interval=0.2, model="kvcached_vllm_3311")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.selected == "kvcached_vllm_3311", "the upstream row selected")
        await pilot.press("p")
        await until(pilot, lambda: said(app, "kvcached_vllm_3311 is an upstream kvcached segment: it has no memory "
                                             "policy"), "the notice")
        assert not isinstance(app.screen, PolicyScreen)

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

    refuses_readonly("c", "read-only: compact is disabled")
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

    refuses_readonly("w", "read-only: sleep/wake is disabled")
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
