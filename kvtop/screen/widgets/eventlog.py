"""Event log: appearances, stale models, limit acknowledgements, trims and kvtop's own requests (in a replay: the
events recorded up to the moment shown)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from kvtop.frames.events import ERROR, GOOD, WARN, Event

LEVEL_STYLES = {GOOD: "green", WARN: "yellow", ERROR: "bold red"}


class EventLog(RichLog, can_focus=False):
    """Not focusable: the dashboard's keys (arrows, home/end, page up/down) are the app's; the wheel scrolls it."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, max_lines=1000, wrap=False, markup=False, highlight=False, auto_scroll=True)
        self.border_title = "events"
        self.lines_text: list[str] = []  # plain text of every line, for tests and the details screen

    def add(self, event: Event) -> None:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(event.clock() + " ", style="grey50")
        if event.model:
            line.append(event.model + " ", style="bold")
        line.append(event.text, style=LEVEL_STYLES.get(event.level, ""))
        self.lines_text.append(line.plain)
        del self.lines_text[:-1000]
        self.write(line, expand=True)

    def reset(self) -> None:
        """Empty, to be written again (a replay that went back shows the log as it was then)."""
        self.clear()
        self.lines_text.clear()
