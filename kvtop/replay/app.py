"""``kvtop --replay FILE``: the dashboard, every panel as it was, driven by a recording's clock.

The same app and widgets as the live dashboard (``kvtop.screen.dashboard``), with a time bar under the status line. Its one
poller reads the recording's frame at the clock's moment (``kvtop.replay.ReplaySource``) with the recorded
events up to it and the history the sparklines need, and posts them; the handler sets them as the live one does.
The log shows what was recorded, so going back shows it as it was. Actions that change a model are refused
through the read-only path, saying it is a replay.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.worker import get_current_worker

from kvtop.frames.history import History
from kvtop.frames.source import Frame
from kvtop.record.reading import RecordedEvent, Recording
from kvtop.replay.source import EVENT_FILTERS, LogUpdate, ReplayClock, ReplaySource, format_moment, parse_moment
from kvtop.screen.actions import REPLAY, bindings
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.messages import PollFailed
from kvtop.screen.widgets.jump import JumpScreen
from kvtop.screen.widgets.timebar import ReplayState, TimeBar, span_text

DRAWN_WAIT_S = 0.5  # at most this long the poller waits for a frame to be drawn before it reads its history
# What a replay refuses; their keys stay (pressing one says why), the footer leaves them out.
CHANGES = ("trim", "trim_all", "compact", "sleep_wake", "limit", "policy")


def replay_bindings() -> list[Binding]:
    return [dataclasses.replace(b, show=False) if b.action in CHANGES else b for b in bindings(REPLAY)]


class ReplayFrameReady(Message):
    """The replay's poller read the frame at the clock's moment and the events the log lacks. ``history``: None
    to feed this frame to the history the app holds; after a seek, first one of this frame alone (``complete``
    False: sparklines and rates wait), then the same frame again with the history of the samples before it."""

    def __init__(self, frame: Frame, log: LogUpdate, history: History | None, complete: bool = True) -> None:
        super().__init__()
        self.frame = frame
        self.log = log
        self.history = history
        self.complete = complete


class ReplayApp(KvtopApp):
    """The dashboard over a recording: the clock pauses, plays at 1x to 600x, steps and jumps."""

    MODE = REPLAY
    TITLE = "kvtop replay"
    BINDINGS: ClassVar[list[BindingType]] = list(replay_bindings())

    def __init__(self, recording: Recording, *, name: str = "", model: str | None = None,
                 gpus: Sequence[int] | None = None, at: float | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        clock = ReplayClock(recording.times(), at=at, monotonic=monotonic)
        source = ReplaySource(recording, clock)
        super().__init__(source, model=model, gpus=gpus, readonly=True)
        self.clock, self.replay, self.recording = clock, source, recording
        self.sub_title = name
        self.title = f"kvtop replay · {name}" if name else "kvtop replay"
        self._shown_playing: bool | None = None
        self._problems_said = 0
        self.history_complete = False  # the history behind the frame shown is all there (not only that frame)
        self._drawn = threading.Event()  # set once a frame posted without its history is on screen
        self.event_filter = 0  # what n / N stop at: an index into EVENT_FILTERS (e moves it on)

    def compose_bars(self) -> ComposeResult:
        yield TimeBar(id="timebar")

    def on_mount(self) -> None:
        self.timebar = self.query_one(TimeBar)
        super().on_mount()
        self._draw_time()
        self._say_problems()

    def _say_problems(self) -> None:
        """Damaged rows (read as absent), a file cut short: each said once, as the reads come upon them."""
        problems = self.recording.problems
        for problem in problems[self._problems_said:]:
            self.notify(problem, title="the recording", severity="warning", timeout=10, markup=False)
        self._problems_said = len(problems)

    # -- reading ---------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="poller", exit_on_error=False)
    def poll(self) -> None:
        """The one poller: the frame at the clock's moment, posted when it differs from the last; then sleep
        until the sample shown changes (paused: until a key wakes it)."""
        worker = get_current_worker()
        last: Frame | None = None
        while not worker.is_cancelled and not self._stopping.is_set():
            try:
                frame = self.replay.read(self._want)
                if frame is not last:
                    last = frame
                    log = self.replay.log(frame.taken_at)
                    if self.replay.continues(frame.taken_at):
                        self.post_message(ReplayFrameReady(frame, log, None))
                    else:  # on screen at once; the sparklines and rates follow from the samples before it,
                        # read once the screen is drawn (reading them at once would slow the drawing down)
                        alone = History()
                        alone.update(frame.models)
                        self._drawn.clear()
                        self.post_message(ReplayFrameReady(frame, log, alone, complete=False))
                        self._drawn.wait(DRAWN_WAIT_S)
                        self.post_message(ReplayFrameReady(frame, LogUpdate((), False),
                                                           self.replay.history(frame.taken_at)))
            except Exception as exc:  # noqa: BLE001 - shown in the log, the poller keeps going
                self.post_message(PollFailed(f"{type(exc).__name__}: {exc}"))
            if self._wake.wait(self.clock.wait_s()):
                self._wake.clear()

    def on_replay_frame_ready(self, message: ReplayFrameReady) -> None:
        frame = message.frame
        if message.history is not None:
            self.history = message.history
        else:
            self.history.update(frame.models)
        if message.log.reset:
            self.event_log.reset()
        for event in message.log.events:
            self.event_log.add(event)
        self._prev = frame
        self.frames_seen += 1
        self.history_complete = message.complete
        self.frame = frame
        self._draw_time()
        self._say_problems()
        if not message.complete:
            self.call_after_refresh(self._drawn.set)

    # -- drawing ---------------------------------------------------------------------------------
    @property
    def shown(self) -> float:
        """The moment on screen: the sample of the last frame drawn (the clock's, before the first)."""
        return self.frame.taken_at if self.frame is not None else self.clock.sample_at(self.clock.now())

    def _draw_status(self) -> None:
        self.status_line.show(self.frame, interval=None, paused=False, readonly=False, sort_key=self.sort_key,
                              filter_text=self.filter_text, waiting_for=self.model_arg, badge="kvtop replay")

    def _draw_time(self) -> None:
        clock = self.clock
        shown, playing = self.shown, clock.playing
        self.timebar.show(ReplayState(shown, clock.start, clock.end, playing, clock.speed,
                                      clock.sample_index(shown), len(clock.times)))
        if playing != self._shown_playing:
            self._shown_playing = playing
            self.refresh_bindings()  # the footer's space: Play or Pause

    def _clock_moved(self) -> None:
        self._draw_time()
        self._poll_now()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        verdict = super().check_action(action, parameters)
        if verdict and action in ("replay_pause", "replay_play"):
            return self.clock.playing == (action == "replay_pause")
        return verdict

    # -- the clock's keys ------------------------------------------------------------------------
    def action_replay_toggle(self) -> None:
        if self.clock.playing:
            self.action_replay_pause()
        else:
            self.action_replay_play()

    def action_replay_play(self) -> None:
        if not self.clock.play():
            self._say_once("the end of the recording: , steps back, g goes to a moment")
        self._clock_moved()

    def action_replay_pause(self) -> None:
        self.clock.pause()
        self._clock_moved()

    def action_replay_speed(self, step: int) -> None:
        self.clock.set_speed(step)
        self._clock_moved()

    def action_replay_step(self, samples: int) -> None:
        self.clock.seek(self.shown)  # from the sample on screen, not one the clock passed since
        self.clock.step(samples)
        self._clock_moved()

    def action_replay_jump(self) -> None:
        clock = self.clock

        def parse(text: str) -> float:
            return parse_moment(text, start=clock.start, end=clock.end, now=self.shown)

        def chosen(at: float | None) -> None:
            if at is not None:
                clock.seek(at)
                self._clock_moved()

        span = (f"The recording: {format_moment(clock.start)} to {format_moment(clock.end)} "
                f"({span_text(clock.end - clock.start)}); on screen {format_moment(self.shown)}")
        self.push_screen(JumpScreen(parse, format_moment, span), chosen)

    def action_replay_event(self, direction: int) -> None:
        self._find_event(self.shown, direction, EVENT_FILTERS[self.event_filter][1])

    def action_replay_events(self) -> None:
        self.event_filter = (self.event_filter + 1) % len(EVENT_FILTERS)
        self.notify(f"n / N stop at {EVENT_FILTERS[self.event_filter][0]} (e: the next choice)", markup=False)

    @work(thread=True, exclusive=True, group="seek", exit_on_error=False)
    def _find_event(self, shown: float, direction: int, kinds: tuple[str, ...] | None) -> None:
        """Off the UI thread: the recording's next (or previous) event of those chosen, then the clock goes there."""
        found = self.replay.event_near(shown, direction, kinds)
        self.call_from_thread(self._at_event, found, direction)

    def _at_event(self, event: RecordedEvent | None, direction: int) -> None:
        if event is None:
            chosen = EVENT_FILTERS[self.event_filter][0]
            what = "event" if chosen == EVENT_FILTERS[0][0] else f"event of {chosen} (e: other kinds)"
            self._say_once(f"no {'later' if direction > 0 else 'earlier'} {what}")
            return
        self.clock.pause()  # held there, to be looked at
        self.clock.seek(event.at)
        who = f"{event.model} " if event.model else ""
        self.notify(f"{format_moment(event.at, with_date=False)} {who}{event.text}", markup=False)
        self._clock_moved()

    # -- what a replay refuses -------------------------------------------------------------------
    def readonly_text(self, what: str) -> str:
        return f"replay: {what} is off: actions that change models are off in a replay"

    def _refuse_readonly(self, what: str) -> bool:
        """Said, not logged: the log shows what was recorded."""
        self.notify(self.readonly_text(what), severity="warning", markup=False)
        return True


__all__ = ["ReplayApp"]
