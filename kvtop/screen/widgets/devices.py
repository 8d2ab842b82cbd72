"""Device panel: one stacked bar per GPU (KV in use per model, reserved, others, free), or the host backend."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from kvtop.frames.source import Frame
from kvtop.screen.view import DeviceBar, device_bars, device_lines


class DevicePanel(Widget):
    """Two lines per device; without NVML a clear host-backend bar against the host capacity."""

    def __init__(self, *, id: str | None = None) -> None:  # textual's name
        super().__init__(id=id)
        self._bars: list[DeviceBar] = []
        self.border_title = "devices"

    def show(self, frame: Frame) -> None:
        bars = device_bars(frame)
        self.border_subtitle = frame.gpu_note if not frame.gpus else ""
        if bars != self._bars:
            grew = len(bars) != len(self._bars)
            self._bars = bars
            self.refresh(layout=grew)

    def render(self) -> Group | Text:
        if not self._bars:
            return Text("reading devices…", style="grey50")
        width = max(20, self.content_size.width)
        return Group(*(line for bar in self._bars for line in device_lines(bar, width)))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, 2 * len(self._bars))
