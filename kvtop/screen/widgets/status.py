"""The top line: host, the frame's time, the refresh interval, and whether kvtop is paused."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widget import Widget

from kvtop.frames.source import Frame


class StatusLine(Widget):
    """Drawn from the frame's own clock, so a replayed frame always reads the same.

    A plain render widget: its size never changes, so an update repaints one line, no layout.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = Text(" kvtop ", style="bold reverse")

    def show(self, frame: Frame | None, *, interval: float | None, paused: bool, readonly: bool,
             sort_key: str, filter_text: str, waiting_for: str | None = None, badge: str = "kvtop") -> None:
        """``interval`` None: no refresh interval to tell (a replay's time bar tells its clock)."""
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f" {badge} ", style="bold reverse")
        if frame is not None:
            text.append(f" {frame.host} ", style="bold")
            text.append(time.strftime("%H:%M:%S", time.localtime(frame.taken_at)))
            if frame.directory_problem:  # first: it is why the fleet looks empty
                text.append(f" · {frame.directory_problem}", style="bold red")
            else:
                live = sum(1 for m in frame.models if m.status == "live")
                text.append(f" · {len(frame.models)} models, {live} live")
        if interval is not None:
            text.append(f" · every {interval:g} s")
        text.append(f" · sort {sort_key}")
        if filter_text:
            text.append(f" · filter {filter_text!r}", style="bold cyan")
        if waiting_for:
            text.append(f" · waiting for {waiting_for!r}", style="yellow")
        if readonly:
            text.append(" · read-only", style="bold magenta")
        if paused:
            text.append("  PAUSED ", style="bold black on yellow")
        if text != self._text or text.spans != self._text.spans:
            self._text = text
            self.refresh()

    def render(self) -> Text:
        return self._text
