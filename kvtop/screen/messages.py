"""The messages kvtop's workers post to the app: a frame read, a poll that failed, a control request answered.

Workers run off the UI thread and never touch a widget; these are all they hand back.
"""

from __future__ import annotations

from textual.message import Message

from kvtop.frames.events import Event
from kvtop.frames.source import Frame


class FrameReady(Message):
    """The poller read a frame."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame


class PollFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class ControlDone(Message):
    """A control request's events: its answer (acknowledged, timed out or refused), or a draining sleep's
    first line (``finished`` empty: the request goes on)."""

    def __init__(self, events: list[Event], finished: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__()
        self.events = events
        self.finished = finished  # the (kind, model) requests this message ends
