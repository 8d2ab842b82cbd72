"""kvtop's view: the keys that change it (every key the help screen lists; sort, pause, interval, tab, zoom) and
the model table's columns, driven by key presses (Textual's pilot) against the sample fleet, scripted fleets
and real allocators in child processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from conftest import send
from fakes import FAKE_T0, FakeSource, fake_model, fake_pages, sample_fleet
from kvtop_pilot import TIMEOUT_S, drive, said, seen, until
from textual.command import CommandPalette
from textual.pilot import Pilot

import kvcached_core as kc
from kvcached_core.segment.snapshot import Traffic
from kvtop.frames.source import Frame, LiveSource
from kvtop.screen.actions import KEY_NAMES
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.widgets import ConfirmScreen, DetailsScreen, FilterScreen, HelpScreen, LimitScreen, PolicyScreen


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


# -- every key the help screen lists does what it says ----------------------------------------------

def names(app: KvtopApp) -> list[str]:
    return [m.name for m in app._visible]


def at(app: KvtopApp, index: int) -> None:
    app.selected = names(app)[index]


def dialog(kind: type, question: str = "") -> Callable[[KvtopApp], bool]:
    return lambda app: isinstance(app.screen, kind) and question in str(getattr(app.screen, "question", ""))


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
    # The sample fleet's segments are upstream ones: these two keys say why not (the live tests in
    # tests/test_kvtop_pilot_controls.py say yes).
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
