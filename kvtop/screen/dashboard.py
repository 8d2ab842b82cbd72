"""The dashboard (a Textual app) of kvcached models — devices, models, page maps, fragmentation, trim and limits.

One thread worker polls the source and posts each frame; the frame handler is the only place
that sets reactives, and widgets draw the frozen snapshots they are handed. Trims and limits run
in worker threads and report back to the event log, so the screen never waits on a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import ClassVar

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.screen import ModalScreen
from textual.widgets import Footer, Static
from textual.worker import get_current_worker

from kvcached_core import AckTimeout, ControlError, ModelNotFound, ModelSnapshot, format_bytes, resolve
from kvtop.frames.events import ERROR, GOOD, INFO, WARN, Event, asleep_key, asleep_text, diff, policy_text
from kvtop.frames.history import History
from kvtop.frames.source import Frame, Source
from kvtop.screen.actions import LIVE, bindings, help_rows
from kvtop.screen.commands import KvtopCommands
from kvtop.screen.messages import ControlDone, FrameReady, PollFailed
from kvtop.screen.view import SORT_KEYS, filter_models, legend_text, sort_models
from kvtop.screen.widgets import (
    ConfirmScreen,
    DetailsScreen,
    DevicePanel,
    EventLog,
    FilterScreen,
    FragSummary,
    HelpScreen,
    LimitRequest,
    LimitScreen,
    ModelTable,
    PageMapView,
    PolicyRequest,
    PolicyScreen,
    StatusLine,
)
from kvtop.text.textfmt import REFILL_NOTE

INTERVALS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
# How long kvtop's worker waits for an engine to acknowledge a control. It waits off the UI thread, so
# it can be generous: on a loaded host an ack can take seconds, and a shorter wait then logs
# 'not acknowledged' for a request the engine carries out a moment later.
CONTROL_WAIT_S = 10.0


class KvtopApp(App[int]):
    """The dashboard. ``source`` is a LiveSource in production and a FakeSource (tests/fakes.py) in snapshot tests."""

    CSS_PATH = Path(__file__).with_name("kvtop.tcss")  # whole: textual reads a relative one beside a subclass's module (ReplayApp)
    TITLE = "kvtop"
    COMMANDS = {KvtopCommands}  # ours only: one list, one style (quit, keys and help are in it)
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS: ClassVar[list[BindingType]] = list(bindings(LIVE))  # kvtop/screen/actions.py: keys, palette and help in one table
    MODE = LIVE  # the rows of kvtop/screen/actions.py this dashboard has (kvtop.replay.app: REPLAY)

    # ``var``: no repaint of the whole screen when one changes; the watchers redraw what changed.
    frame: var[Frame | None] = var(None, always_update=True, init=False)
    selected: var[str | None] = var(None, init=False)
    paused: var[bool] = var(False, init=False)
    interval: var[float] = var(1.0, init=False)
    sort_key: var[str] = var("name", init=False)
    filter_text: var[str] = var("", init=False)

    def __init__(self, source: Source, *, interval: float = 1.0, model: str | None = None,
                 gpus: Sequence[int] | None = None, readonly: bool = False) -> None:
        super().__init__()
        self.source = source
        self.readonly = readonly
        self.gpus = set(gpus) if gpus is not None else None
        self.model_arg = model
        self.history = History()
        self.frames_seen = 0
        self.set_reactive(KvtopApp.interval, interval)
        # Plain copies the poller thread reads; only the UI thread writes them.
        self._want: str | None = None
        self._paused = False
        self._interval = interval
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._prev: Frame | None = None
        self._logged: set[tuple] = set()
        # (kind, model) of our own requests still in a control worker: the worker reports their
        # acknowledgement with its latency, so the refresh diff's shorter line for them is held back
        self._awaiting: set[tuple[str, str]] = set()
        self._visible: list[ModelSnapshot] = []
        self._said: dict[str, float] = {}  # notification -> when it was last shown
        self.arrows = "models"  # what ↑/↓ drive: "models" (the selection) or "map" (the page map's rows); tab

    # -- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield from self.compose_bars()
        yield DevicePanel(id="devices")
        yield ModelTable(id="models")
        with Horizontal(id="lower"):
            with Vertical(id="map-column", classes="panel"):
                yield PageMapView(id="pagemap")
                yield Static(legend_text(), id="legend")
            yield FragSummary(id="frag")
        yield EventLog(id="events")
        yield Footer(compact=True)

    def compose_bars(self) -> ComposeResult:
        """Bars under the status line: none live (a replay's time bar)."""
        yield from ()

    def on_mount(self) -> None:
        # Kept as attributes: a frame may arrive while a modal screen is on top.
        self.status_line = self.query_one(StatusLine)
        self.devices = self.query_one(DevicePanel)
        self.table = self.query_one(ModelTable)
        self.pagemap = self.query_one(PageMapView)
        self.map_column = self.query_one("#map-column")
        self.frag = self.query_one(FragSummary)
        self.event_log = self.query_one(EventLog)
        for widget in (self.devices, self.table, self.frag, self.event_log):
            widget.add_class("panel")
        self.map_column.border_title = "page map"
        self.table.add_class("-arrows")  # the panel ↑/↓ drive: the models until tab says the page map
        self._draw_status()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self._stop_and_exit)
        self.poll()

    def _stop_and_exit(self) -> None:
        self._stop_poller()
        self.exit(0)

    def on_unmount(self) -> None:
        self._stop_poller()

    def _stop_poller(self) -> None:
        self._stopping.set()
        self._wake.set()

    # -- polling ---------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="poller", exit_on_error=False)
    def poll(self) -> None:
        """The one poller: read a frame, post it, sleep until the interval passes or someone wakes us."""
        worker = get_current_worker()
        while not worker.is_cancelled and not self._stopping.is_set():
            if not self._paused:
                try:
                    frame = self.source.read(self._want)
                except Exception as exc:  # noqa: BLE001 - shown in the log, the poller keeps going
                    self.post_message(PollFailed(f"{type(exc).__name__}: {exc}"))
                else:
                    self.post_message(FrameReady(frame))
            if self._wake.wait(self._interval):
                self._wake.clear()

    def _poll_now(self) -> None:
        self._wake.set()

    def on_frame_ready(self, message: FrameReady) -> None:
        if self.paused:  # read just before the pause: a paused screen does not change
            return
        frame = message.frame
        prev = self._prev
        events = diff(prev.models if prev else None, frame.models, frame.taken_at,
                      prev.problems if prev else (), frame.problems)
        self._add_events(events)
        self.history.update(frame.models)
        self._prev = frame
        self.frames_seen += 1
        self.frame = frame
        for screen in self.screen_stack:  # an open dialog's figures follow the model it is about
            update, about = getattr(screen, "update_model", None), getattr(screen, "model", None)
            fresh = frame.model(about.name) if isinstance(about, ModelSnapshot) else None
            if callable(update) and fresh is not None:
                update(fresh)

    def on_poll_failed(self, message: PollFailed) -> None:
        self._add_events([Event(time.time(), "error", "", f"reading segments failed: {message.error}", ERROR)])

    # -- drawing ---------------------------------------------------------------------------------
    def watch_frame(self) -> None:
        self._redraw()

    def watch_sort_key(self) -> None:
        self._redraw()

    def watch_filter_text(self) -> None:
        self._redraw()

    def watch_paused(self, paused: bool) -> None:
        self._paused = paused
        self._draw_status()
        self.refresh_bindings()  # the footer's space: Pause or Resume
        self._poll_now()

    def watch_interval(self, interval: float) -> None:
        self._interval = interval
        self._draw_status()
        self._poll_now()

    def watch_selected(self, name: str | None) -> None:
        self._want = name
        if self.frame is not None:
            self.table.show(self._visible, self.history, name, [m.name for m in self.frame.models])
        self._draw_selected()
        self._poll_now()

    def _filtered(self, frame: Frame) -> list[ModelSnapshot]:
        models: list[ModelSnapshot] = list(frame.models)
        if self.gpus is not None:
            models = [m for m in models if any(d in self.gpus for d in m.devices)]
        return sort_models(filter_models(models, self.filter_text), self.sort_key, self.history)

    def _redraw(self) -> None:
        frame = self.frame
        if frame is None:
            return
        self._visible = self._filtered(frame)
        names = [m.name for m in self._visible]
        if self.model_arg is not None:
            try:
                self.selected = resolve(self.model_arg, self._visible).name
                self.model_arg = None
            except ModelNotFound:
                pass
        if self.selected not in names:
            table = self.table
            old = table.order
            index = old.index(self.selected) if self.selected in old else 0
            self.selected = names[min(index, len(names) - 1)] if names else None
        self.table.show(self._visible, self.history, self.selected, [m.name for m in frame.models])
        self.devices.show(frame)
        self._draw_selected()
        self._draw_status()

    def _draw_selected(self) -> None:
        frame = self.frame
        detail = None
        if frame is not None and self.selected is not None:
            detail = frame.detail if frame.detail is not None and frame.detail.name == self.selected \
                else frame.model(self.selected)
        self.pagemap.show(detail)  # counters only until the poller brings the page map
        self.frag.show(detail)
        self.map_column.border_title = self.pagemap.border_title or "page map"

    def _draw_status(self) -> None:
        self.status_line.show(self.frame, interval=self.interval, paused=self.paused, readonly=self.readonly,
                              sort_key=self.sort_key, filter_text=self.filter_text, waiting_for=self.model_arg)

    def _add_events(self, events: list[Event], own: bool = False) -> None:
        """Log ``events``; an acknowledgement is logged once, by the worker when the request was ours."""
        log = self.event_log
        for event in events:
            if event.key and not own and event.key[:2] in self._awaiting:
                continue
            if event.key:
                if event.key in self._logged:
                    continue
                self._logged.add(event.key)
            log.add(event)

    # -- selection -------------------------------------------------------------------------------
    @on(ModelTable.Clicked)
    def _row_clicked(self, event: ModelTable.Clicked) -> None:
        if event.double and event.name == self.selected:
            self.action_details()
        self.selected = event.name

    def action_switch_arrows(self) -> None:
        """Tab: ↑/↓ (j/k, home/end) move the selection in the models, or scroll the page map; the panel they
        drive has its border lit."""
        self.arrows = "map" if self.arrows == "models" else "models"
        self.table.set_class(self.arrows == "models", "-arrows")
        self.map_column.set_class(self.arrows == "map", "-arrows")
        self._say_once("↑/↓ scroll the page map (tab: back to the models)" if self.arrows == "map"
                       else "↑/↓ select a model (tab: the page map)")

    def action_cursor(self, step: int) -> None:
        if self.arrows == "map":
            self._scroll_map(step)
            return
        names = [m.name for m in self._visible]
        if not names:
            return
        here = names.index(self.selected) if self.selected in names else 0
        self.selected = names[max(0, min(len(names) - 1, here + step))]

    def selected_model(self) -> ModelSnapshot | None:
        frame = self.frame
        if frame is None or self.selected is None:
            return None
        if frame.detail is not None and frame.detail.name == self.selected:
            return frame.detail
        return frame.model(self.selected)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """While a dialog is open, the dashboard's keys do nothing (quit, and tab between a dialog's fields, still
        work); space says what it does now."""
        if action in ("quit", "command_palette", "focus_next", "focus_previous"):
            return True
        if isinstance(self.screen, ModalScreen):
            return False
        if action in ("pause", "resume"):
            return self.paused == (action == "resume")
        return True

    # -- view actions ----------------------------------------------------------------------------
    @classmethod
    def help_keys(cls) -> list[tuple[tuple[str, ...], str, str]]:
        """The help screen's rows: (Textual key names, action, description), from kvtop/screen/actions.py."""
        return [(tuple(a.keys.split(",")), a.action, a.help_text) for a in help_rows(cls.MODE)]

    def action_help(self) -> None:
        self.push_screen(HelpScreen([(a.key_text, a.help_text) for a in help_rows(self.MODE)], self.readonly))

    def action_details(self) -> None:
        m = self.selected_model()
        if m is None:
            self.notify("no model selected", severity="warning", markup=False)
            return
        self.push_screen(DetailsScreen(m, self.frame.router.get(m.name) if self.frame is not None else None))

    def action_cycle_sort(self) -> None:
        self.sort_key = SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)]
        self.table.border_title = f"models · sort {self.sort_key}"

    def action_filter(self) -> None:
        def done(text: str | None) -> None:
            if text is not None:
                self.filter_text = text
                self.table.border_subtitle = f"filter {text!r}" if text else ""

        self.push_screen(FilterScreen(self.filter_text), done)

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def action_pause(self) -> None:
        self.paused = True

    def action_resume(self) -> None:
        self.paused = False

    def action_faster(self) -> None:
        shorter = [i for i in INTERVALS if i < self.interval - 1e-9]
        self.interval = shorter[-1] if shorter else INTERVALS[0]

    def action_slower(self) -> None:
        longer = [i for i in INTERVALS if i > self.interval + 1e-9]
        self.interval = longer[0] if longer else INTERVALS[-1]

    ZOOM_NOTHING = "the whole map fits at one page per cell: nothing to zoom"

    def action_zoom_in(self) -> None:
        if not self.pagemap.zoom_in():
            self._say_once(self.ZOOM_NOTHING if self.pagemap.fit() <= 1 else "one page per cell: Z zooms out")
        self._draw_selected()

    def action_zoom_out(self) -> None:
        if not self.pagemap.zoom_out():
            self._say_once(self.ZOOM_NOTHING if self.pagemap.fit() <= 1 else "whole map on screen: z zooms in")
        self._draw_selected()

    def _say_once(self, text: str, timeout: float = 3.0) -> None:
        """A notification, not repeated while the same one is still on screen (a key held down)."""
        now = time.monotonic()
        if now - self._said.get(text, -timeout) >= timeout:
            self._said[text] = now
            self.notify(text, timeout=timeout, markup=False)

    def action_map_scroll(self, rows: int) -> None:
        """One row of the page map back (earlier pages) or on (later pages)."""
        self._scroll_map(rows)

    def action_map_page(self, direction: int) -> None:
        """One screen of the page map back or on."""
        self._scroll_map(direction * max(1, self.pagemap.scrollable_content_region.height))

    def _scroll_map(self, rows: int) -> None:
        """Scroll now, whatever a layout pass in progress says of the scrollbar: a key pressed while a frame
        re-lays the map out (its page count changed) was dropped by a scroll deferred to the next refresh."""
        self.pagemap.scroll_to(y=self.pagemap.scroll_y + rows, animate=False, immediate=True, force=True)
        self.call_after_refresh(self._draw_selected)

    async def action_quit(self) -> None:
        self._stop_poller()
        self.exit(0)

    # -- control actions -------------------------------------------------------------------------
    def readonly_text(self, what: str) -> str:
        """Why ``what`` is refused in read-only mode."""
        return f"read-only: {what} is disabled (kvtop was started with --readonly)"

    def _refuse_readonly(self, what: str) -> bool:
        if not self.readonly:
            return False
        text = self.readonly_text(what)
        self.notify(text, severity="warning", markup=False)
        self._add_events([Event(time.time(), "action", "", text, WARN)])
        return True

    def _controllable(self, m: ModelSnapshot | None, what: str) -> bool:
        if m is None:
            self.notify("no model selected", severity="warning", markup=False)
            return False
        if m.status == "stale":
            self.notify(f"{m.name} is stale: its process is gone, nothing would apply a {what}", severity="warning", markup=False)
            return False
        if m.status == "legacy" and what == "trim":
            self.notify(f"{m.name} is an upstream kvcached segment: it cannot be trimmed from outside",
                        severity="warning", markup=False)
            return False
        return True

    def _control_target(self, action: str, what: str,
                        problem: Callable[[ModelSnapshot], str | None] | None = None) -> ModelSnapshot | None:
        """The selected model, read again (the figures a dialog shows are the ones the action acts on), or None
        after saying why not: kvtop is read-only (``action``), no model or one that cannot take a ``what``,
        or ``problem`` has a reason."""
        if self._refuse_readonly(action):
            return None
        m = self.selected_model()
        if not self._controllable(m, what):
            return None
        assert m is not None
        m = self.source.reread(m)
        reason = None if problem is None else problem(m)
        if reason is not None:
            self.notify(reason, severity="warning", markup=False)
            return None
        return m

    def action_trim(self) -> None:
        m = self._control_target("trim", "trim")
        if m is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._add_events([Event(time.time(), "action", m.name, "trim requested", INFO)])
                self._control("trim", [m], None)

        self.push_screen(ConfirmScreen(
            f"Trim {m.name}?",
            f"Unmaps its {m.pages_reserved} reserved pages ({format_bytes(m.reserved_bytes)}) now; "
            f"pages in use are not touched. {REFILL_NOTE.capitalize()}.", "Trim"), confirmed)

    def action_trim_all(self) -> None:
        if self._refuse_readonly("trim all"):
            return
        frame = self.frame
        targets = [m for m in self._visible if m.status == "live"] if frame else []
        if not targets:
            self.notify("no live model to trim", severity="warning", markup=False)
            return
        reserved = sum(m.reserved_bytes for m in targets)

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._add_events([Event(time.time(), "action", "", f"trim requested for {len(targets)} models", INFO)])
                self._control("trim", targets, None)

        self.push_screen(ConfirmScreen(
            f"Trim all {len(targets)} live models?",
            f"Unmaps every reserved page ({format_bytes(reserved)} in all) now. {REFILL_NOTE.capitalize()}.",
            "Trim all"), confirmed)

    def action_compact(self) -> None:
        from kvcached_core.control import compact_problem

        m = self._control_target("compact", "compaction", compact_problem)
        if m is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._add_events([Event(time.time(), "action", m.name, "compaction requested", INFO)])
                self._control("compact", [m], None)

        self.push_screen(ConfirmScreen(
            f"Compact {m.name}?",
            f"Its engine copies the cached blocks of its sparsest pages ({m.blocks_cached} cached blocks in "
            f"{m.pages_inuse} pages in use) into free slots of denser pages; the pages emptied are unmapped. "
            "Nothing is dropped from the prefix cache; blocks of running requests are not touched.", "Compact"),
            confirmed)

    def action_sleep_wake(self) -> None:
        """Put the selected model's KV cache to sleep, or wake it when it sleeps (or drains)."""
        from kvcached_core.control import sleep_problem

        m = self._control_target("sleep/wake", "sleep", sleep_problem)
        if m is None:
            return
        assert m.sleep is not None
        kind = "wake" if m.sleep.state != "awake" else "sleep"

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._add_events([Event(time.time(), "action", m.name, f"{kind} requested", INFO)])
                self._control(kind, [m], None)

        if kind == "wake":
            self.push_screen(ConfirmScreen(
                f"Wake {m.name}?", f"It is {m.sleep.state}. Its engine schedules again; pages are mapped as its "
                "requests need them.", "Wake"), confirmed)
            return
        self.push_screen(ConfirmScreen(f"Put {m.name} to sleep?", confirm_label="Sleep", model=m,
                                       describe=sleep_detail), confirmed)

    def action_limit(self) -> None:
        m = self._control_target("limit", "limit")
        if m is None:
            return

        def chosen(request: LimitRequest | None) -> None:
            if request is not None:
                shown = "none" if request.limit_bytes is None else format_bytes(request.limit_bytes)
                self._add_events([Event(time.time(), "action", m.name, f"limit {shown} requested", INFO)])
                self._control("limit", [m], request.limit_bytes)

        self.push_screen(LimitScreen(m), chosen)

    def action_policy(self) -> None:
        """Set the selected model's memory policy: its min and its priority."""
        from kvcached_core.control import KEEP, policy_problem

        m = self._control_target("policy", "policy", lambda m: policy_problem(m, KEEP, 0))
        if m is None:
            return

        def chosen(request: PolicyRequest | None) -> None:
            if request is not None:
                self._add_events([Event(time.time(), "action", m.name, f"policy {request.describe()} requested", INFO)])
                self._control("policy", [m], request)

        self.push_screen(PolicyScreen(m), chosen)

    def _control(self, kind: str, models: list[ModelSnapshot], value: int | PolicyRequest | None) -> None:
        self._awaiting.update((kind, m.name) for m in models)
        self.run_worker(partial(self._control_thread, kind, models, value), thread=True, group="control",
                        exit_on_error=False, description=f"{kind} {', '.join(m.name for m in models)}")

    def _control_thread(self, kind: str, models: list[ModelSnapshot], value: int | PolicyRequest | None) -> None:
        """Runs in a worker thread: ask each model and wait for its acknowledgement."""
        events: list[Event] = []
        try:
            for m in models:
                try:
                    events += self._ask(kind, m, value)
                except AckTimeout as exc:
                    events.append(Event(time.time(), kind, m.name, f"{kind} not acknowledged: {exc}", WARN))
                except (ControlError, ModelNotFound, OSError, ValueError) as exc:
                    events.append(Event(time.time(), kind, m.name, f"{kind} failed: {exc}", ERROR))
        finally:  # even on an error no except names, so the refresh diff reports these models again
            self.post_message(ControlDone(events, tuple((kind, m.name) for m in models)))

    def _ask(self, kind: str, m: ModelSnapshot, value: int | PolicyRequest | None) -> list[Event]:
        """In the control worker: one request to one model, and the events its answer makes."""
        if isinstance(value, PolicyRequest):
            return [self._ask_policy(m, value)]
        if kind == "compact":
            ack = self.source.compact(m, CONTROL_WAIT_S)
            return [Event(time.time(), "compacted", m.name,
                          f"compaction acknowledged: {format_bytes(ack.bytes_returned)} returned, "
                          f"{format_bytes(ack.bytes_copied)} copied in {ack.latency_s * 1000:.0f} ms", GOOD)]
        if kind in ("sleep", "wake"):
            ack = self.source.sleep(m, kind, CONTROL_WAIT_S)
            text = f"{kind} acknowledged: {ack.status}"
            key: tuple = (kind, m.name, ack.revision)
            if ack.status == "asleep":
                text += f", {format_bytes(ack.bytes_returned)} released in {ack.latency_s * 1000:.0f} ms"
                key = asleep_key(m.name, ack.revision, ack.bytes_returned, ack.latency_s)
            elif ack.status == "draining":
                text += " (running requests finish first)"
                key = ("sleep", m.name, "draining", ack.revision)
            elif ack.status == "woken":
                text = (f"sleep acknowledged: slept ({format_bytes(ack.bytes_returned)} released in "
                        f"{ack.latency_s * 1000:.0f} ms), then woken")
            said = Event(time.time(), kind, m.name, text, WARN if ack.status == "superseded" else GOOD, key)
            if ack.status != "draining":
                return [said]
            self.post_message(ControlDone([said]))  # say so now, then when it is asleep
            return [e for e in (self._asleep_event(m),) if e is not None]
        if kind == "trim":
            ack = self.source.trim(m, CONTROL_WAIT_S)
            return [Event(time.time(), "trimmed", m.name,
                          f"trim acknowledged: {format_bytes(ack.bytes_returned)} returned "
                          f"in {ack.latency_s * 1000:.0f} ms; {REFILL_NOTE}", GOOD, ("trim", m.name, ack.revision))]
        ack = self.source.limit(m, value, CONTROL_WAIT_S)
        shown = "none" if ack.effective_limit is None else format_bytes(ack.effective_limit)
        if ack.status == "legacy":
            text, level = f"limit {shown} written to the upstream total field", GOOD
            if ack.in_use is not None and ack.effective_limit is not None and ack.in_use > ack.effective_limit:
                text += f"; pending: {format_bytes(ack.in_use)} is in use, it applies only as pages free"
                level = WARN
            return [Event(time.time(), "limit", m.name, text, level)]
        level = WARN if ack.status in ("deferred", "conflict", "superseded") else GOOD
        text = f"limit r{ack.revision} acknowledged: {ack.status}, effective {shown}"
        if ack.status == "deferred":
            text += f" (asked {format_bytes(value)}: waits for pages to empty)"
        return [Event(time.time(), "limit", m.name, text, level, ("limit", m.name, ack.revision))]

    def _ask_policy(self, m: ModelSnapshot, request: PolicyRequest) -> Event:
        ack = self.source.policy(m, request.min_bytes, request.priority, CONTROL_WAIT_S)
        if ack.status == "superseded":
            text = f"policy r{ack.revision} superseded by r{ack.superseded_by} from another controller"
            return Event(time.time(), "policy", m.name, text, WARN, ("policy", m.name, ack.revision))
        now = policy_text(self.source.reread(m))
        return Event(time.time(), "policy", m.name, f"policy r{ack.revision} acknowledged: {ack.status}, {now} "
                     f"in {ack.latency_s * 1000:.0f} ms", GOOD, ("policy", m.name, ack.revision))

    def _asleep_event(self, m: ModelSnapshot) -> Event | None:
        """In the control worker: a model that acknowledged a sleep while draining, once it is asleep (None
        when it is still draining after CONTROL_WAIT_S, or was woken: the status column says so)."""
        deadline = time.monotonic() + CONTROL_WAIT_S
        while time.monotonic() < deadline:
            info = self.source.reread(m).sleep
            if info is None or info.state != "draining":
                if info is None or info.state != "asleep":
                    return None
                return Event(time.time(), "sleep", m.name, asleep_text(info.slept_bytes, info.took_s), GOOD,
                             asleep_key(m.name, info.acked_revision, info.slept_bytes, info.took_s))
            time.sleep(0.1)
        return None

    def on_control_done(self, message: ControlDone) -> None:
        self._add_events(message.events, own=True)
        self._awaiting.difference_update(message.finished)
        for event in message.events:
            if event.level == ERROR:
                self.notify(f"{event.model}: {event.text}", severity="error", markup=False)
        self._poll_now()


def sleep_detail(m: ModelSnapshot) -> str:
    """What putting ``m`` to sleep gives back, from its latest read (the dialog redraws it at each refresh)."""
    cached = m.cached_bytes or 0  # (a model that can sleep publishes it)
    active = max(0, m.held_bytes - cached)
    return (f"Every page it has mapped is unmapped once its running requests finish: {format_bytes(m.mapped_bytes)} "
            f"mapped now ({format_bytes(m.reserved_bytes)} reserved, {format_bytes(m.pinned_bytes)} in pages in use, "
            f"holding {format_bytes(cached)} of cached blocks, dropped, and {format_bytes(active)} of running "
            "requests, which finish first). The event log says what was released: what it had mapped when the "
            "sleep began. New requests wait in its engine's queue; weights stay. The next request wakes it, as "
            "does this key.")
