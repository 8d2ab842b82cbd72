"""kvtop driven by key presses (Textual's pilot) in tests: run a script against the app, wait for what it shows,
read its event log, its notifications and the selected model's panel."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Awaitable, Callable

from rich.console import Console
from textual.pilot import Pilot

import kvcached_core as kc
from kvtop.screen.dashboard import KvtopApp

MiB = 1024 * 1024
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


def panel_text(app: KvtopApp) -> str:
    """The selected model's panel (fragmentation, policy, reclaim) as plain text."""
    console = Console(width=60, file=io.StringIO(), record=True)
    console.print(app.frag.render())
    return console.export_text()


def said(app: KvtopApp, text: str) -> bool:
    return any(note.message == text for note in app._notifications)
