"""The replay's time bar: REPLAY, playing or paused and the speed, the moment shown, where it lies in the recording."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

MARK, DONE, TODO = "●", "━", "─"


@dataclass(frozen=True)
class ReplayState:
    """What the bar draws, handed in by the app (which reads the clock)."""

    shown: float  # the sample on screen (seconds since the epoch)
    start: float
    end: float
    playing: bool
    speed: int
    sample: int  # its index, 0-based
    samples: int


def span_text(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


class TimeBar(Widget):
    """One line: the moment shown, the recording's span, play state and speed, a bar of where the moment lies."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.state: ReplayState | None = None

    def show(self, state: ReplayState) -> None:
        if state != self.state:
            self.state = state
            self.refresh()

    def text(self, width: int) -> Text:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(" REPLAY ", style="bold reverse magenta")
        s = self.state
        if s is None:
            line.append(" reading the recording…", style="grey50")
            return line
        if s.playing:
            line.append(f" ▶ {s.speed}x ", style="bold green")
        elif s.shown >= s.end:
            line.append(" ■ end ", style="bold yellow")
        else:
            line.append(f" ❚❚ paused ({s.speed}x) ", style="bold yellow")
        days_differ = time.localtime(s.start)[:3] != time.localtime(s.end)[:3]
        line.append(time.strftime(" %Y-%m-%d %H:%M:%S ", time.localtime(s.shown)), style="bold")
        clock = "%m-%d %H:%M:%S" if days_differ else "%H:%M:%S"
        left = time.strftime(clock, time.localtime(s.start))
        right = time.strftime(clock, time.localtime(s.end))
        tail = f" {right} · {span_text(s.end - s.start)} · sample {s.sample + 1}/{s.samples}"
        room = width - line.cell_len - len(left) - len(tail) - 2
        line.append(f" {left} ", style="grey50")
        if room >= 8:
            at = 0 if s.end <= s.start else round((s.shown - s.start) / (s.end - s.start) * (room - 1))
            line.append(DONE * at, style="magenta")
            line.append(MARK, style="bold magenta")
            line.append(TODO * (room - 1 - at), style="grey37")
        line.append(tail, style="grey50")
        return line

    def render(self) -> Text:
        return self.text(self.content_size.width or 80)
