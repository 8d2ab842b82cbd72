"""kvtop --replay: a real demo fleet recorded in-process, replayed headless (Textual's pilot), every panel compared
with what the live dashboard drew from the frames the recorder read at the same moments; the replay's keys; the
replay screen's snapshot (a recording of the fake fleet, for determinism); bad files and options on the command line.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import cast

import pytest
from fakes import FAKE_T0, FakeSource, sample_fleet
from rich.console import Console, RenderableType
from textual.pilot import Pilot
from textual.widgets import Input

import kvcached_core as kc
from kvtop.demo.fleet import DemoFleet
from kvtop.frames.source import Frame, Source
from kvtop.record.reading import Recording
from kvtop.record.recorder import Recorder
from kvtop.replay.app import ReplayApp
from kvtop.replay.source import REFUSED, SPEEDS, ReplaySource, parse_moment
from kvtop.screen.actions import KEY_NAMES
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.widgets import ConfirmScreen, DetailsScreen, HelpScreen, LimitScreen, PolicyScreen
from kvtop.screen.widgets.jump import JumpScreen

SIZE = (150, 46)
TIMEOUT_S = 30.0


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):
    """Clock strings are local time: pin the zone (the snapshot and the typed times). Input cursors stay lit."""
    monkeypatch.setattr(Input, "_toggle_cursor", lambda self: None)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def until(pilot: Pilot, condition: Callable[[], object], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await pilot.pause(0.02)
    app = pilot.app
    frame = getattr(app, "frame", None)
    state = f"frame at {frame.taken_at if frame else None}, selected {getattr(app, 'selected', None)}"
    clock = getattr(app, "clock", None)
    if clock is not None:
        state += f" clock {clock.now()} {clock.sample_index(clock.now())} {list(clock.times)}"
    raise AssertionError(f"timed out waiting for {what} ({state})")


def drive(app: KvtopApp, script: Callable[[Pilot], Awaitable[None]], size: tuple[int, int] = SIZE) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await script(pilot)

    asyncio.run(main())


# -- what the panels show -------------------------------------------------------------------------------

def plain(renderable: RenderableType, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.print(renderable)
    return console.export_text()


@dataclass
class Shown:
    """One moment as the dashboard drew it: every panel's text, the page map's cells, the event log."""

    at: float
    rows: list[str]  # the models table: header, then a line per model
    map_title: str
    map_lines: list[str]  # the page map's lines on screen
    cells: list[list] = field(repr=False)  # every row of the page map's cells (kvtop.text.pagemap.Cell)
    frag: str = ""
    devices: str = ""
    log: list[str] = field(default_factory=list)


def shown(app: KvtopApp) -> Shown:
    assert app.frame is not None
    table, pagemap = app.table, app.pagemap
    rows = [table.render_line(y).text for y in range(len(table.order) + 1)]
    height = pagemap.scrollable_content_region.height
    cells = [list(pagemap._row(r)) for r in range(pagemap.rows)] if pagemap.total else []
    return Shown(app.frame.taken_at, rows, str(app.map_column.border_title),
                 [pagemap.render_line(y).text for y in range(height)], cells,
                 plain(app.frag.render(), app.frag.content_size.width),
                 plain(app.devices.render(), app.devices.content_size.width), list(app.event_log.lines_text))


def ready(app: KvtopApp, at: float, selected: str) -> bool:
    """The frame taken at ``at`` on screen, ``selected``'s page map in it, the table painted once."""
    frame = app.frame
    return (frame is not None and frame.taken_at == at and frame.detail is not None
            and frame.detail.name == selected and app.selected == selected and app.pagemap.detail is not None
            and app.pagemap.detail.name == selected and bool(app.table.render_line(0).text.strip())
            and getattr(app, "history_complete", True))


# -- recording a real demo fleet -------------------------------------------------------------------------

@dataclass
class Held:
    """The live dashboard's source over the frames the recorder read: the one at ``index``, with the selected
    model's page map as the live source reads it (the recorder's frames hold every model's)."""

    frames: Sequence[Frame]
    index: int = 0

    def read(self, selected: str | None) -> Frame:
        frame = self.frames[self.index]
        return replace(frame, detail=frame.model(selected))

    def reread(self, model: kc.ModelSnapshot) -> kc.ModelSnapshot:
        return model

    def close(self) -> None:
        pass


def busy_since(frame: Frame, names: Sequence[str]) -> Callable[[], bool]:
    """True once the demo models' allocations moved on from ``frame`` (the next sample differs)."""
    before = {m.name: m.alloc_blocks for m in frame.models}

    def moved() -> bool:
        now = {m.name: m.alloc_blocks for m in kc.scan().models}
        return all(now.get(n, -1) != before.get(n, -1) for n in names if n in now)

    return moved


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def record_demo(directory: Path) -> tuple[list[tuple[float, Frame]], list[str]]:
    """A real demo fleet of two models recorded sample by sample, each sample's live frame kept: their traffic,
    a lowered limit, a trim, one model killed (it goes stale)."""
    kept: list[tuple[float, Frame]] = []
    with DemoFleet(models=2, seed=7, prefix="rp") as fleet:
        assert fleet.wait_ready(20), fleet.failure
        names = fleet.names()
        recorder = Recorder(directory, gpus=False)

        def sample() -> Frame:
            frame = recorder.read()
            kept.append((recorder.write(frame), frame))
            return frame

        frame = sample()
        for _ in range(3):
            wait_for(busy_since(frame, names), "the demo models to allocate")
            frame = sample()
        first = kc.snapshot(names[0])
        kc.request_limit(first, first.bundle_bytes, wait=TIMEOUT_S)  # below what it holds: deferred or evicting
        frame = sample()
        wait_for(busy_since(frame, names), "the demo models to allocate")
        kc.request_trim(names[1], wait=TIMEOUT_S)
        frame = sample()
        fleet.procs[1].send_signal(signal.SIGKILL)
        fleet.procs[1].wait(TIMEOUT_S)
        wait_for(lambda: kc.snapshot(names[1]).status == "stale", f"{names[1]} to go stale")
        frame = sample()
        wait_for(busy_since(frame, names[:1]), "the live model to allocate")
        sample()
        recorder.close()
    return kept, names


def test_a_replayed_moment_shows_what_the_live_dashboard_showed(tmp_path: Path) -> None:
    """Every panel at every recorded moment, reached by jumps back and forth, equals the live dashboard's drawing
    of the frame the recorder read then: the models table's lines (sparklines and rates too), the page map's
    cells and lines, fragmentation, devices, and the event log as it was (not what came after)."""
    kept, names = record_demo(tmp_path / "rec")
    frames = [frame for _t, frame in kept]
    selected = names[0]

    live: list[Shown] = []
    source = Held(frames)
    live_app = KvtopApp(cast(Source, source), interval=0.05, model=selected)  # reads only: no control asked

    def live_at(at: float, index: int) -> bool:
        return ready(live_app, at, selected) and live_app.frames_seen > index

    async def watch_live(pilot: Pilot) -> None:
        for index, (at, _frame) in enumerate(kept):
            source.index = index
            await until(pilot, partial(live_at, at, index), f"live frame {index}")
            await pilot.pause()
            live.append(shown(live_app))

    drive(live_app, watch_live)
    assert any("went stale" in line for line in live[-1].log), live[-1].log
    assert any("trimmed" in line or "trim" in line for line in live[-1].log), live[-1].log

    recording = Recording.open(tmp_path / "rec")
    assert list(recording.times()) == [at for at, _ in kept]
    app = ReplayApp(recording, name="rec", model=selected)
    # the last moment first, then back to the start, then every moment forward, then backward by jumps
    order = [len(kept) - 1, 0, *range(1, len(kept)), 5, 2, 6, 1]

    async def replay(pilot: Pilot) -> None:
        await until(pilot, lambda: ready(app, kept[0][0], selected), "the first moment")
        for step, index in enumerate(order):
            at = kept[index][0]
            if step % 3 == 2 and index + 1 < len(kept):  # typed: a moment between two samples shows the first
                await pilot.press("g")
                await until(pilot, lambda: isinstance(app.screen, JumpScreen), "the go-to dialog")
                between = datetime.fromtimestamp((at + kept[index + 1][0]) / 2).isoformat()
                await pilot.press(*between, "enter")
            else:
                app.clock.seek(at)
                app._clock_moved()
            await until(pilot, partial(ready, app, at, selected), f"moment {index}")
            await pilot.pause()
            got, want = shown(app), live[index]
            assert got.rows == want.rows, f"moment {index}: the models table"
            assert got.cells == want.cells and got.cells, f"moment {index}: the page map's cells"
            assert (got.map_title, got.map_lines) == (want.map_title, want.map_lines), f"moment {index}: page map"
            assert got.frag == want.frag, f"moment {index}: fragmentation"
            assert got.devices == want.devices, f"moment {index}: devices"
            assert got.log == want.log, f"moment {index}: the event log"
            assert app.frame is not None and app.frame.detail is not None
            live_model = frames[index].model(selected)
            assert live_model is not None and app.frame.detail.pages == live_model.pages

    drive(app, replay, size=(SIZE[0], SIZE[1] + 1))  # a row more for the time bar: the panels as large as live


# -- a deterministic recording: the fake fleet's script -------------------------------------------------

def record_fake(directory: Path, source: FakeSource | None = None) -> FakeSource:
    """The fake fleet's scans written as a recording, a second apart from FAKE_T0 (the fleet's story: mistral
    goes stale at +3 s; at +4 s qwen's limit r2 is deferred and deepseek gives llama 48 MiB; +5 s a trim)."""
    source = source or sample_fleet(big_pages=20_000)
    recorder = Recorder(directory, gpus=False)
    for step, scan in enumerate(source.script):
        at = source.start + step * source.step
        models = tuple(replace(m, read_ns=int(at * 1e9), heartbeat_ns=int(at * 1e9)) for m in scan)
        recorder.write(Frame(models, (), (), source.gpu_note, source.host_capacity, None, at, source.host))
    recorder.close()
    return source


@pytest.fixture
def fake_recording(tmp_path: Path) -> Path:
    record_fake(tmp_path / "fake")
    return tmp_path / "fake"


def replay_app(path: Path, **kwargs) -> ReplayApp:
    return ReplayApp(Recording.open(path), name=path.name, **kwargs)


def at_moment(app: ReplayApp, seconds: float) -> bool:
    return app.frame is not None and app.frame.taken_at == FAKE_T0 + seconds


def logged(app: ReplayApp, text: str) -> bool:
    return any(text in line for line in app.event_log.lines_text)


def speed_is(app: ReplayApp, speed: int) -> bool:
    return app.clock.speed == speed


def said(app: ReplayApp, text: str) -> bool:
    return any(text in note.message for note in app._notifications)


def test_the_clock_keys_play_pause_speed_and_step(fake_recording: Path) -> None:
    app = replay_app(fake_recording)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0), "the first sample")
        assert "REPLAY" in app.timebar.text(150).plain and "paused" in app.timebar.text(150).plain
        assert app.status_line.render().plain.startswith(" kvtop replay ")
        await pilot.press("full_stop")
        await until(pilot, lambda: at_moment(app, 1), "one sample on")
        await pilot.press("full_stop", "full_stop")
        await until(pilot, lambda: at_moment(app, 3), "two more")
        await pilot.press("comma")
        await until(pilot, lambda: at_moment(app, 2), "one back")
        for speed in SPEEDS[1:4]:
            await pilot.press("plus")
            await until(pilot, partial(speed_is, app, speed), f"{speed}x")
        await pilot.press("minus")
        await until(pilot, lambda: app.clock.speed == SPEEDS[2], "slower")
        await pilot.press("space")
        await until(pilot, lambda: app.clock.playing, "playing")
        assert f"▶ {SPEEDS[2]}x" in app.timebar.text(150).plain
        await until(pilot, lambda: at_moment(app, 5) and not app.clock.playing, "played to the end")
        await until(pilot, lambda: "■ end" in app.timebar.text(150).plain, "the bar at the end")
        assert logged(app, "trimmed: 12.0 MiB returned")
        await pilot.press("space")  # at the end: nothing left to play
        await until(pilot, lambda: said(app, "the end of the recording"), "the end said")
        assert not app.clock.playing
        await pilot.press("comma", "comma")
        await until(pilot, lambda: at_moment(app, 3), "two back from the end")
        await pilot.press("space")
        await until(pilot, lambda: app.clock.playing, "playing again")
        await pilot.press("space")
        await until(pilot, lambda: not app.clock.playing, "paused again")
        assert "paused" in app.timebar.text(150).plain

    drive(app, script)


def test_n_and_N_jump_between_events_and_the_log_shows_them_as_they_were(fake_recording: Path) -> None:
    app = replay_app(fake_recording)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0), "the first sample")
        await pilot.press("n")
        await until(pilot, lambda: at_moment(app, 3), "the stale model")
        assert said(app, "mistral-7b went stale")
        assert logged(app, "went stale") and not logged(app, "deferred")
        await pilot.press("n")
        await until(pilot, lambda: at_moment(app, 4), "the deferred limit and the reclaim")
        assert logged(app, "limit r2 acknowledged: deferred") and logged(app, "gave 48.0 MiB to llama-3-8b")
        await pilot.press("n")
        await until(pilot, lambda: at_moment(app, 5), "the trim")
        assert said(app, "trimmed: 12.0 MiB returned")
        await pilot.press("n")
        await until(pilot, lambda: said(app, "no later event"), "nothing later")
        assert at_moment(app, 5)
        await pilot.press("N")
        await until(pilot, lambda: at_moment(app, 4), "back to the deferred limit")
        await pilot.press("N")
        await until(pilot, lambda: at_moment(app, 3), "back to the stale model")
        await until(pilot, lambda: not logged(app, "deferred"), "the log as it was at +3 s")
        assert logged(app, "went stale")
        await pilot.press("N")
        await until(pilot, lambda: at_moment(app, 0), "back to the recorder's start")
        await pilot.press("N")
        await until(pilot, lambda: said(app, "no earlier event"), "nothing earlier")

    drive(app, script)


def test_g_goes_to_a_typed_moment_and_refuses_one_outside(fake_recording: Path) -> None:
    app = replay_app(fake_recording)

    async def go(pilot: Pilot, text: str) -> JumpScreen:
        await pilot.press("g")
        await until(pilot, lambda: isinstance(app.screen, JumpScreen), "the go-to dialog")
        screen = app.screen
        assert isinstance(screen, JumpScreen)
        await pilot.press(*text, "enter")
        return screen

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0), "the first sample")
        await go(pilot, "00:00:04")
        await until(pilot, lambda: at_moment(app, 4), "00:00:04")
        await go(pilot, "-2s")
        await until(pilot, lambda: at_moment(app, 2), "two seconds back")
        await go(pilot, "2026-01-01T00:00:03.5")
        await until(pilot, lambda: at_moment(app, 3), "the sample before 3.5 s")
        screen = await go(pilot, "+1h")
        await pilot.pause(0.2)
        assert app.screen is screen and screen.has_class("-invalid")
        error = str(screen.query_one("#error").render())
        assert "outside the recording" in error, error
        await pilot.press(*["backspace"] * 3, *"25:00", "enter")
        await pilot.pause(0.2)
        assert app.screen is screen and "not a time of day" in str(screen.query_one("#error").render())
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, JumpScreen), "the dialog closed")
        assert at_moment(app, 3)

    drive(app, script)


def test_actions_that_change_models_are_refused_in_a_replay(fake_recording: Path) -> None:
    app = replay_app(fake_recording, model="llama")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0) and app.selected == "llama-3-8b", "llama selected")
        for key, what in (("t", "trim"), ("T", "trim all"), ("c", "compact"), ("w", "sleep/wake"),
                          ("l", "limit"), ("p", "policy")):
            await pilot.press(key)
            await until(pilot, partial(said, app, f"replay: {what} is off"), f"{key} refused")
            assert not isinstance(app.screen, ConfirmScreen | LimitScreen | PolicyScreen)
        assert not logged(app, "replay:")  # the log holds what was recorded only
        footer = {key for key, b in app.active_bindings.items() if b.binding.show}
        assert not footer & {"t", "l"}
        await pilot.press("enter")  # looking is still allowed
        await until(pilot, lambda: isinstance(app.screen, DetailsScreen), "the details")

    drive(app, script)
    source = ReplaySource(Recording.open(fake_recording), app.clock)
    for request in (lambda m: source.trim(m, 1), lambda m: source.limit(m, 0, 1), lambda m: source.compact(m, 1),
                    lambda m: source.sleep(m, "sleep", 1), lambda m: source.policy(m, 0, 0, 1)):
        with pytest.raises(kc.ControlError, match=REFUSED):
            request(app.frame.models[0])  # type: ignore[union-attr]
    source.close()


def test_the_replay_help_lists_its_keys_and_the_docs_name_them(fake_recording: Path) -> None:
    app = replay_app(fake_recording)
    keys = ReplayApp.help_keys()
    actions = {action for _keys, action, _ in keys}
    assert {"replay_pause", "replay_speed(1)", "replay_speed(-1)", "replay_step(1)", "replay_step(-1)",
            "replay_jump", "replay_event(1)", "replay_event(-1)"} <= actions
    assert not actions & {"pause", "faster", "slower"}  # the live refresh's keys are the clock's here
    assert {action for _keys, action, _ in KvtopApp.help_keys()}.isdisjoint(
        {a for a in actions if a.startswith("replay_")})

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frames_seen >= 1, "the first frame")
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
        shown_keys = [row[0] for row in app.screen.keys]  # type: ignore[attr-defined]
        assert shown_keys == [" ".join(KEY_NAMES.get(k, k) for k in ks) for ks, _, _ in keys]

    drive(app, script)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "kvtop.md").read_text()
    section = docs[docs.index("\n## Replay"):]
    table = section[section.index("| replay key |"):].split("\n\n")[0]
    for ks, action, _ in keys:
        if action.startswith("replay_"):
            for k in ks:
                assert f"`{KEY_NAMES.get(k, k)}`" in table, f"docs/kvtop.md's replay keys lack {k} ({action})"


def test_parse_moment_forms() -> None:
    start, end = FAKE_T0, FAKE_T0 + 86_400 + 3600  # 2026-01-01 00:00 to 2026-01-02 01:00 UTC
    assert parse_moment("+10m", start=start, end=end, now=start) == start + 600
    assert parse_moment("-30s", start=start, end=end, now=start + 60) == start + 30
    assert parse_moment("+1h30m", start=start, end=end, now=start) == start + 5400
    assert parse_moment("00:30", start=start, end=end, now=start) == start + 1800
    assert parse_moment("00:30", start=start, end=end, now=end) == start + 86_400 + 1800  # the nearer day
    assert parse_moment("12:00:30", start=start, end=end, now=end) == start + 43_230
    assert parse_moment("2026-01-01T03:00:00+00:00", start=start, end=end, now=start) == start + 10_800
    for bad, says in (("03:00 pm", "not a moment"), ("24:00", "not a time of day"), ("-1s", "outside"),
                      ("2026-01-03T00:00", "outside"), ("", "type a moment")):
        with pytest.raises(ValueError, match=says):
            parse_moment(bad, start=start, end=end, now=start)


def test_a_damaged_sample_shows_the_moment_before_it_and_says_why(fake_recording: Path) -> None:
    """A sample whose CRC does not match reads as absent: asked for it, the replay shows the sample before (the
    last one that can be rebuilt) and says what was skipped."""
    (day,) = fake_recording.glob("kvrecord-*.sqlite")
    db = sqlite3.connect(day)
    db.execute("UPDATE samples SET crc = crc + 1 WHERE seq = 3")
    db.commit()
    db.close()
    app = replay_app(fake_recording)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0), "the first sample")
        app.clock.seek(FAKE_T0 + 3)
        app._clock_moved()
        await until(pilot, lambda: said(app, "sample 3") and at_moment(app, 2), "the damaged sample said")
        assert "sample 3/6" in app.timebar.text(150).plain  # the bar: the sample before it, as the screen
        assert logged(app, "went stale") is False  # the log as it was at the moment shown

    drive(app, script)


# -- the screen snapshot ----------------------------------------------------------------------------------

def test_replay_screen(snap_compare, fake_recording: Path) -> None:
    """The fake fleet's recording at +4 s: the deferred limit and the reclaim in the log, the time bar paused."""

    async def at_four(pilot: Pilot) -> None:
        app = pilot.app
        assert isinstance(app, ReplayApp)
        await until(pilot, lambda: app.frame is not None, "the first frame")
        app.clock.seek(FAKE_T0 + 4)
        app._clock_moved()
        await until(pilot, lambda: at_moment(app, 4) and app.frame is not None and app.frame.detail is not None
                    and app.pagemap.detail is not None, "+4 s with qwen's page map")
        await pilot.pause(0.1)

    assert snap_compare(replay_app(fake_recording, model="qwen"), terminal_size=(160, 50), run_before=at_four)


# -- the command line -------------------------------------------------------------------------------------

def kvtop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtop.app", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TZ": "UTC"})


def test_bad_replay_files_and_options_are_one_line(tmp_path: Path, fake_recording: Path) -> None:
    not_one = tmp_path / "notes.txt"
    not_one.write_text("not a recording\n")
    (tmp_path / "empty-dir").mkdir()
    for args, code, says in (
        ((str(tmp_path / "missing"),), 1, "no such file or directory"),
        ((str(not_one),), 1, "notes.txt"),
        ((str(tmp_path / "empty-dir"),), 1, "no recording here"),
        ((str(fake_recording), "--at", "+1h"), 2, "outside the recording"),
        ((str(fake_recording), "--demo"), 2, "cannot go with --demo"),
    ):
        done = kvtop("--replay", *args)
        assert done.returncode == code, (args, done.stderr)
        assert done.stdout == "" and done.stderr.count("\n") == 1 and says in done.stderr, (args, done.stderr)
        assert done.stderr.startswith("kvtop: ") and "Traceback" not in done.stderr
    done = kvtop("--at", "03:00")
    assert (done.returncode, done.stderr.count("\n")) == (2, 1) and "goes with --replay" in done.stderr


def test_replay_once_prints_the_moment_asked(fake_recording: Path) -> None:
    """Without a terminal a replay prints one moment, as kvtop --once does live."""
    done = kvtop("--replay", str(fake_recording), "--at", "00:00:03", "--model", "mistral")
    assert done.returncode == 0, done.stderr
    assert "00:00:03" in done.stdout and "stale" in done.stdout and "page map · mistral-7b" in done.stdout
