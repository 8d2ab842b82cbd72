"""The ``?`` screen draws every key beside what it does, live and in a replay (whose long descriptions once
squeezed the key columns to nothing), and the replay's help as a screen snapshot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import sample_fleet
from test_kvtop_replay import drive, record_fake, replay_app, until, utc  # noqa: F401 - utc: the zone fixture
from textual.pilot import Pilot
from textual.widgets import Static

from kvtop.screen.actions import LIVE, REPLAY, help_rows
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.widgets import HelpScreen


@pytest.fixture
def fake_recording(tmp_path: Path) -> Path:
    record_fake(tmp_path / "fake")
    return tmp_path / "fake"


async def help_open(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, KvtopApp)
    await until(pilot, lambda: app.frame is not None and app.frame.detail is not None
                and app.pagemap.detail is not None and getattr(app, "history_complete", True),
                "the first frame drawn, its page map and (in a replay) its history")
    await pilot.press("question_mark")
    await until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help screen")
    await pilot.pause(0.1)


def drawn_keys(app: KvtopApp) -> list[str]:
    """The key table's lines as the help screen draws them."""
    keys = app.screen.query_one("#keys", Static)
    return [keys.render_line(y).text for y in range(keys.size.height)]


@pytest.mark.parametrize("size", [(80, 24), (160, 50)], ids=["80x24", "160x50"])
@pytest.mark.parametrize("mode", [LIVE, REPLAY])
def test_every_key_is_drawn_beside_what_it_does(mode: str, size: tuple[int, int], fake_recording: Path) -> None:
    app = KvtopApp(sample_fleet(), interval=0.05) if mode == LIVE else replay_app(fake_recording)
    lines: list[str] = []

    async def script(pilot: Pilot) -> None:
        await help_open(pilot)
        lines.extend(drawn_keys(app))

    drive(app, script, size=size)
    text = "\n".join(lines)
    for row in help_rows(mode):
        # the key, at least one space, then the first words of what it does, on one line
        drawn = re.compile(rf"(^|\s){re.escape(row.key_text)} +{re.escape(row.help_text[:10])}", re.MULTILINE)
        assert drawn.search(text), f"{mode} help at {size}: {row.key_text!r} is not drawn beside " \
                                   f"{row.help_text!r}:\n{text}"


def test_replay_help_screen(snap_compare, fake_recording: Path) -> None:
    """The replay's ? screen: the clock's keys and e, n and N, every key beside its words (qwen selected: its
    512 pages fit one a cell whether or not the map has a scroll bar)."""
    assert snap_compare(replay_app(fake_recording, model="qwen"), terminal_size=(160, 50), run_before=help_open)

