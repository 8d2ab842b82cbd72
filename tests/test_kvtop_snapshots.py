"""Screen snapshots of kvtop from a deterministic fake source, at 80x24 and 160x50.

The fleet (``kvtop.frames.source.sample_fleet``) holds a live model, a stale one, one shrinking under
a deferred limit, an upstream (legacy) segment and a model with 100,000 pages; there is no
GPU unless a test asks for two fake H200s. Regenerate with ``--snapshot-update`` and look at
the SVGs in tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import time

import pytest
from fakes import FakeSource, sample_fleet
from textual.pilot import Pilot
from textual.widgets import Input

from kvtop.screen.dashboard import KvtopApp

SMALL, LARGE = (80, 24), (160, 50)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):
    """Clock strings in the screens are local time: pin the zone. Input cursors stay lit (no blink)."""
    monkeypatch.setattr(Input, "_toggle_cursor", lambda self: None)
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def make_app(*, gpus: bool = False, model: str | None = None, source: FakeSource | None = None) -> KvtopApp:
    return KvtopApp(source or sample_fleet(gpus=gpus), interval=0.05, model=model)


async def settled(pilot: Pilot) -> None:
    """Wait until the whole script was read and the selected model's page map has arrived."""
    app = pilot.app
    assert isinstance(app, KvtopApp)
    for _ in range(400):
        frame = app.frame
        if (frame is not None and frame.taken_at == app.source.final_at and app.selected is not None
                and frame.detail is not None and frame.detail.name == app.selected):
            await pilot.pause(0.1)
            return
        await pilot.pause(0.025)
    raise AssertionError("the fake source never settled")


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x50"])
def test_fleet_without_gpu(snap_compare, size) -> None:
    """Host backend panel, stale + shrinking + legacy rows, the 100k-page model selected (first by name)."""
    assert snap_compare(make_app(), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x50"])
def test_fleet_on_two_gpus(snap_compare, size) -> None:
    assert snap_compare(make_app(gpus=True), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x50"])
def test_shrinking_model_selected(snap_compare, size) -> None:
    """A limit below what is in use: deferred, the row says shrinking, the summary says so."""
    assert snap_compare(make_app(model="qwen"), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x50"])
def test_stale_model_selected(snap_compare, size) -> None:
    assert snap_compare(make_app(model="mistral"), terminal_size=size, run_before=settled)


def test_legacy_segment_selected(snap_compare) -> None:
    assert snap_compare(make_app(model="kvcached_"), terminal_size=SMALL, run_before=settled)


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["80x24", "160x50"])
def test_100k_pages_zoomed_and_scrolled(snap_compare, size) -> None:
    """Three zoom steps in from fit, then a page down: the title says which pages are shown."""
    assert snap_compare(make_app(model="deepseek"), press=["z", "z", "z", "pagedown"], terminal_size=size,
                        run_before=settled)


def test_one_page_per_cell(snap_compare) -> None:
    async def zoomed_all_the_way(pilot: Pilot) -> None:
        await settled(pilot)
        await pilot.press(*["z"] * 12)
        pilot.app.clear_notifications()  # "one page per cell" goes after 3 s of wall time: not on the snapshot
        await pilot.pause(0.1)

    assert snap_compare(make_app(model="llama"), terminal_size=LARGE, run_before=zoomed_all_the_way)


def test_invalid_limit_input(snap_compare) -> None:
    assert snap_compare(make_app(model="llama"), press=["l", *"30x", "enter"], terminal_size=SMALL,
                        run_before=settled)


def test_limit_preview(snap_compare) -> None:
    """A valid size previews its page bundles and warns that it will be deferred."""
    assert snap_compare(make_app(model="llama"), press=["l", *"4G"], terminal_size=LARGE, run_before=settled)


def test_trim_confirmation(snap_compare) -> None:
    assert snap_compare(make_app(model="llama"), press=["t"], terminal_size=SMALL, run_before=settled)


def test_help_screen(snap_compare) -> None:
    assert snap_compare(make_app(), press=["question_mark"], terminal_size=LARGE, run_before=settled)


async def first_frame(pilot: Pilot) -> None:
    for _ in range(400):
        if pilot.app.frames_seen >= 1:
            await pilot.pause(0.1)
            return
        await pilot.pause(0.025)
    raise AssertionError("no frame")


def test_no_models_at_all(snap_compare) -> None:
    assert snap_compare(make_app(source=FakeSource([()])), terminal_size=SMALL, run_before=first_frame)


def test_policy_dialog(snap_compare) -> None:
    """The memory policy dialog: the model's policy now, its limit, and a min typed in (previewed)."""
    assert snap_compare(make_app(model="llama"), press=["p", *"8G"], terminal_size=SMALL, run_before=settled)
