"""The replay's go-to dialog: a moment typed as a time of day, an ISO time or an offset, checked as it is typed."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


class JumpScreen(ModalScreen[float | None]):
    """Enter a moment; one the recording does not hold shows why inline and keeps the dialog open.

    ``parse`` turns the text into a moment or raises ValueError with the reason; ``describe`` writes a moment.
    """

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, parse: Callable[[str], float], describe: Callable[[float], str], span: str) -> None:
        super().__init__(classes="dialog")
        self.parse, self.describe, self.span = parse, describe, span

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Go to a moment of the recording", id="question")
            yield Static(Text(self.span), id="detail")
            yield Input(placeholder="03:00, 03:00:30, 2026-01-01T03:00, +10m, -30s", id="jump-input")
            yield Static("", id="preview")
            yield Static("", id="error")
            yield Static("Enter goes there · Escape cancels", id="hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def _check(self, typed: str) -> float | None:
        """The moment ``typed`` names, drawn in the preview, or None with the reason under the input."""
        preview, error = self.query_one("#preview", Static), self.query_one("#error", Static)
        try:
            at = self.parse(typed)
        except ValueError as exc:
            preview.update("")
            error.update(Text(f"✗ {exc}", style="bold red") if typed.strip() else "")
            self.set_class(bool(typed.strip()), "-invalid")
            return None
        error.update("")
        self.remove_class("-invalid")
        preview.update(Text(f"= {self.describe(at)}", style="green"))
        return at

    def on_input_changed(self, event: Input.Changed) -> None:
        self._check(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        at = self._check(event.value)
        if at is None:
            if not event.value.strip():
                self.query_one("#error", Static).update(Text("✗ type a moment first", style="bold red"))
            return
        self.dismiss(at)

    def action_cancel(self) -> None:
        self.dismiss(None)
