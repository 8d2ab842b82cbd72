"""Modal screens: confirm a destructive action, enter a limit or a memory policy, filter, details, help."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.validation import ValidationResult, Validator
from textual.widgets import Button, Input, Label, Static

from kvcached_core import ModelSnapshot, SizeError, format_bytes, fragmentation, parse_size
from kvcached_core.control import (
    KEEP,
    PRIORITY_MAX,
    PRIORITY_MIN,
    NoDeviceTotal,
    limit_percent_base,
    limit_refusal,
    policy_problem,
)
from kvtop.screen.view import STATE_STYLES, frag_table
from kvtop.text.pagemap import GLYPHS, LEGEND
from kvtop.text.textfmt import fmt_device, group_fields


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no for a destructive action: ``y`` or Enter confirms, ``n`` or Escape cancels."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, detail: str = "", confirm_label: str = "Yes", *,
                 model: ModelSnapshot | None = None, describe: Callable[[ModelSnapshot], str] | None = None) -> None:
        """``describe``: the detail drawn from ``model``, drawn again from each refresh (:meth:`update_model`)."""
        super().__init__(classes="dialog")
        self.question, self.confirm_label = question, confirm_label
        self.model, self.describe = model, describe
        self.detail = describe(model) if describe is not None and model is not None else detail

    def update_model(self, model: ModelSnapshot) -> None:
        """A fresher read of the model the question is about: its figures in the detail follow it."""
        if self.describe is None or self.model is None or model.name != self.model.name:
            return
        self.model = model
        detail = self.describe(model)
        if detail != self.detail:
            self.detail = detail
            self.query_one("#detail", Static).update(Text(detail))

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(Text(self.question), id="question")
            if self.detail:
                yield Static(Text(self.detail), id="detail")
            with Horizontal(id="buttons"):
                yield Button(f"{self.confirm_label} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#yes", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


@dataclass(frozen=True)
class LimitRequest:
    """What the limit dialog returns: bytes, or None to lift the limit."""

    limit_bytes: int | None


class SizeValidator(Validator):
    """Accepts what ``parse_size`` accepts: ``4G``, ``512MiB``, ``30%`` (of the device), ``none``."""

    def __init__(self, percent_of: int | None) -> None:
        super().__init__()
        self.percent_of = percent_of or None

    def validate(self, value: str) -> ValidationResult:
        try:
            parse_size(value, percent_of=self.percent_of, allow_none=True)
        except SizeError as exc:
            return self.failure(str(exc))
        return self.success()


class LimitScreen(ModalScreen[LimitRequest | None]):
    """Enter a limit; invalid input shows why inline and keeps the dialog open."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, model: ModelSnapshot, router: dict | None = None) -> None:
        super().__init__(classes="dialog")
        self.model = model
        self.router = router  # kvctl route's figures for it (kvtop.serve.router.published), None when no router has any
        self.percent_of: int | None = None  # what a percentage is taken of: the base kvctl limit takes
        self.percent_note = ""  # how a percentage is taken, when the model does not say it
        self.percent_problem = ""  # why no percentage can be taken
        try:
            self.percent_of, self.percent_note = limit_percent_base(model)
        except NoDeviceTotal as exc:
            self.percent_problem = str(exc)

    def compose(self) -> ComposeResult:
        m = self.model
        with Vertical(id="dialog"):
            yield Label(Text(f"Set the limit of {m.name}"), id="question")
            yield Static(self._summary(), id="detail")
            yield Input(placeholder="4G, 512MiB, 30%, none", id="limit-input",
                        validators=[SizeValidator(self.percent_of)], validate_on=["changed", "submitted"])
            yield Static("", id="preview")
            yield Static("", id="error")
            yield Static("Enter applies · Escape cancels", id="hint")

    def _summary(self) -> Text:
        m = self.model
        text = Text()
        current = "none" if m.limit_bytes is None else format_bytes(m.limit_bytes)
        text.append(f"current {current} · mapped {format_bytes(m.mapped_bytes)} · in use {format_bytes(m.pinned_bytes)}")
        if self.percent_of:
            of = self.percent_note or f"of {format_bytes(self.percent_of)}"
            text.append(f"\n30% = {format_bytes(self.percent_of * 0.3)} {of}")
        if not m.legacy:
            text.append(f"\nrounded down to whole page bundles of {format_bytes(m.bundle_bytes)}")
        else:
            text.append("\nupstream segment: written to its total field")
        return text

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def _parse(self, value: str) -> int | None:
        if self.percent_problem and value.strip().endswith("%"):
            raise SizeError(self.percent_problem)
        return parse_size(value, percent_of=self.percent_of, allow_none=True)

    def update_model(self, model: ModelSnapshot) -> None:
        """A fresher read of the model: the current figures and the preview follow it while the dialog is open."""
        if model.name != self.model.name:
            return
        self.model = model
        self.query_one("#detail", Static).update(self._summary())
        self._check(self.query_one(Input).value)

    def on_input_changed(self, event: Input.Changed) -> None:
        self._check(event.value)

    def _check(self, typed: str) -> None:
        """As the text is typed: the size it means, or why it is none (the same words Enter would show)."""
        preview, error = self.query_one("#preview", Static), self.query_one("#error", Static)
        if not typed.strip():
            preview.update("")
            error.update("")
            self.remove_class("-invalid")
            return
        try:
            value = self._parse(typed)
            refusal = limit_refusal(self.model.name, value) if self.model.legacy else None
            if refusal is not None:
                raise SizeError(refusal)
        except SizeError as exc:
            preview.update("")
            error.update(Text(f"✗ {exc}", style="bold red"))
            self.add_class("-invalid")
            return
        error.update("")
        self.remove_class("-invalid")
        preview.update(self._describe(value))

    def _describe(self, value: int | None) -> Text:
        m = self.model
        refusal = limit_refusal(m.name, value) if m.legacy else None  # upstream: no "no limit", no 0
        if value is None:
            return Text(refusal, style="red") if refusal else Text("= no limit", style="green")
        text = Text(f"= {format_bytes(value)}")
        if m.legacy:
            if refusal is not None:
                text.append(f"\n{refusal}", style="red")
            elif value < m.held_bytes:
                text.append(f"\nbelow the {format_bytes(m.held_bytes)} in use: pending until the engine frees pages "
                            "(upstream never acknowledges a limit)", style="yellow")
        elif m.bundle_bytes:
            pages = value // m.bundle_bytes
            text.append(f" ({pages} page bundle{'s' if pages != 1 else ''})")
            if pages == 0 and value > 0:
                text.append(f"\nless than one page bundle ({format_bytes(m.bundle_bytes)}): "
                            "rounds down to 0, the model can take no pages", style="yellow")
            if pages * m.bundle_bytes < m.pinned_bytes:
                text.append(f"\nbelow the {format_bytes(m.pinned_bytes)} in use: deferred until pages empty",
                            style="yellow")
        return text

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            value = self._parse(event.value)
            refusal = limit_refusal(self.model.name, value) if self.model.legacy else None
            if refusal is not None:
                raise SizeError(refusal)
        except SizeError as exc:
            self.query_one("#error", Static).update(Text(f"✗ {exc}", style="bold red"))
            self.add_class("-invalid")
            return
        self.dismiss(LimitRequest(value))

    def action_cancel(self) -> None:
        self.dismiss(None)


@dataclass(frozen=True)
class PolicyRequest:
    """What the policy dialog returns: each figure, or ``KEEP`` to leave it as it is (``min_bytes`` None: none)."""

    min_bytes: int | None | object = KEEP
    priority: int | object = KEEP

    def describe(self) -> str:
        parts = []
        if self.min_bytes is not KEEP:
            parts.append(f"min {format_bytes(self.min_bytes) if self.min_bytes else 'none'}")  # type: ignore[arg-type]
        if self.priority is not KEEP:
            parts.append(f"priority {self.priority}")
        return ", ".join(parts)


class PolicyScreen(ModalScreen[PolicyRequest | None]):
    """Enter a model's min (a size, a percentage or none) and priority; an empty field stays as it is.
    Invalid input shows why inline and keeps the dialog open."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, model: ModelSnapshot, router: dict | None = None) -> None:
        super().__init__(classes="dialog")
        self.model = model
        self.router = router  # kvctl route's figures for it (kvtop.serve.router.published), None when no router has any
        self.percent_of: int | None = None
        self.percent_problem = ""
        try:
            self.percent_of, _note = limit_percent_base(model)
        except NoDeviceTotal as exc:
            self.percent_problem = str(exc)

    def compose(self) -> ComposeResult:
        m = self.model
        with Vertical(id="dialog"):
            yield Label(Text(f"Set the memory policy of {m.name}"), id="question")
            yield Static(self._summary(), id="detail")
            yield Label("min (never reclaimed from it): 4G, 512MiB, 30%, none")
            yield Input(placeholder="empty: as it is", id="min-input")
            yield Label(f"priority (lower gives first): {PRIORITY_MIN} to {PRIORITY_MAX}")
            yield Input(placeholder="empty: as it is", id="priority-input")
            yield Static("", id="preview")
            yield Static("", id="error")
            yield Static("Enter applies · Tab moves · Escape cancels", id="hint")

    def _summary(self) -> Text:
        m = self.model
        p = m.pressure
        now = "-" if p is None else f"min {format_bytes(p.min_bytes) if p.min_bytes else 'none'}, priority {p.priority}"
        limit = "none" if m.limit_bytes is None else format_bytes(m.limit_bytes)
        return Text(f"now {now} · limit {limit} · mapped {format_bytes(m.mapped_bytes)}\n"
                    "When the device's budget refuses another model's growth, the lowest priority gives first: "
                    "reserved pages, then whole pages of cached blocks, never below its min.")

    def on_mount(self) -> None:
        self.query_one("#min-input", Input).focus()

    def _request(self) -> PolicyRequest:
        """The two fields as a request; raises ValueError with the reason when one is wrong."""
        min_text = self.query_one("#min-input", Input).value.strip()
        priority_text = self.query_one("#priority-input", Input).value.strip()
        min_bytes: int | None | object = KEEP
        priority: int | object = KEEP
        if min_text:
            if self.percent_problem and min_text.endswith("%"):
                raise SizeError(self.percent_problem)
            min_bytes = parse_size(min_text, percent_of=self.percent_of, allow_none=True)
        if priority_text:
            try:
                priority = int(priority_text)
            except ValueError:
                raise ValueError(f"a priority is a whole number from {PRIORITY_MIN} to {PRIORITY_MAX}, "
                                 f"not {priority_text!r}") from None
        problem = policy_problem(self.model, min_bytes, priority)
        if problem is not None:
            raise ValueError(problem)
        return PolicyRequest(min_bytes, priority)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_one("#error", Static).update("")
        self.remove_class("-invalid")
        try:
            request = self._request()
        except ValueError:
            self.query_one("#preview", Static).update("")
            return
        self.query_one("#preview", Static).update(Text(f"= {request.describe()}"))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            request = self._request()
        except ValueError as exc:
            self.query_one("#error", Static).update(Text(f"✗ {exc}", style="bold red"))
            self.add_class("-invalid")
            return
        self.dismiss(request)

    def action_cancel(self) -> None:
        self.dismiss(None)


class FilterScreen(ModalScreen[str | None]):
    """Filter the model table by a substring of name, model, engine or status; empty clears it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: str) -> None:
        super().__init__(classes="dialog")
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Filter models", id="question")
            yield Input(value=self.current, placeholder="part of a name, engine or status (empty: all)",
                        id="filter-input")
            yield Static("Enter applies · Escape cancels", id="hint")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class _InfoScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,enter", "close", "Close")]

    def action_close(self) -> None:
        self.dismiss(None)


TERMS = (
    ("held", "blocks in use × block bundle"),
    ("pinned", "in-use pages × page bundle: what the blocks keep mapped"),
    ("waste", "pinned / held; 1.00× is ideal"),
    ("floor", "the packed floor: ceil(used blocks / blocks per page) pages"),
    ("shrinking", "a lowered limit waits for in-use pages to empty (deferred)"),
    ("stale", "the process is gone or its heartbeat is older than 3 s"),
    ("legacy", "an upstream kvcached segment: counters only, limit via its total field"),
    ("↑", "after the status: waits for memory; the budget refused its growth and it asked the other models"),
    ("min, prio", "its memory policy: bytes never reclaimed from it; who gives first (lowest)"),
)


class HelpScreen(_InfoScreen):
    """Keys, the page-map legend, and what the columns mean."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "close", "Close")]

    def __init__(self, bindings: Iterable[tuple[str, str]], readonly: bool) -> None:
        super().__init__(classes="dialog")
        self.keys = list(bindings)
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        # A key column is as wide as its widest key and never gives way: a long description wraps instead.
        keys = Table.grid(padding=(0, 1))
        half = -(-len(self.keys) // 2)
        key_width = max((cell_len(k) for k, _ in self.keys), default=0)
        for column in range(2):
            keys.add_column(style="bold cyan", no_wrap=True, min_width=key_width)
            keys.add_column(ratio=1)
            if column == 0:
                keys.add_column(width=1)  # the gutter between the halves
        left, right = self.keys[:half], self.keys[half:] + [("", "")] * (2 * half - len(self.keys))
        for (k1, d1), (k2, d2) in zip(left, right, strict=True):
            keys.add_row(Text(k1), Text(d1), "", Text(k2), Text(d2))
        legend = Text()
        for state, label in LEGEND:
            legend.append(GLYPHS[state], style=STATE_STYLES[state])
            legend.append(f" {label}   ")
        terms = Table.grid(padding=(0, 1))
        terms.add_column(style="bold", no_wrap=True, min_width=max(cell_len(term) for term, _ in TERMS))
        terms.add_column(ratio=1)
        for term, meaning in TERMS:
            terms.add_row(term, meaning)
        with VerticalScroll(id="dialog"):
            yield Label("kvtop — keys" + ("  (read-only: trim, compact, sleep/wake, limit and policy are disabled)" if self.readonly else ""),
                        id="question")
            yield Static(keys, id="keys")
            yield Label("page map", classes="section")
            yield Static(legend)
            yield Static(terms, classes="section")
            yield Static("Escape, q or ? closes", id="hint")


class DetailsScreen(_InfoScreen):
    """Everything about one model: identity, counters, limit and trim acknowledgements, worst pages."""

    def __init__(self, model: ModelSnapshot, router: dict | None = None) -> None:
        super().__init__(classes="dialog")
        self.model = model
        self.router = router  # kvctl route's figures for it (kvtop.serve.router.published), None when no router has any

    def compose(self) -> ComposeResult:
        m = self.model
        info = Table.grid(padding=(0, 2))
        info.add_column(style="grey70", no_wrap=True)
        info.add_column()
        rows = [
            ("model", m.model), ("segment", m.path), ("engine", m.engine), ("backend", m.backend),
            ("pid", str(m.pid)), ("device", fmt_device(m)), ("status", m.display_status),
            ("tensor parallel", f"{m.tp_world} ranks" if m.tp_world > 1 else "no"),
        ]
        if not m.legacy:
            rows += [
                ("geometry", f"{m.num_layers} layers × {m.num_kv_buffers} KV buffers, page {format_bytes(m.page_size)}, "
                             f"block {format_bytes(m.block_bytes)}, {m.blocks_per_page} blocks/page"),
                ("pages", f"{m.pages_total:,} virtual · {m.pages_inuse:,} in use · {m.pages_reserved:,} reserved"),
                ("blocks", f"{m.blocks_used:,} used · {m.blocks_cached:,} cached · {m.num_blocks:,} total"),
                ("limit", f"{m.limit_status}, effective {format_bytes(m.limit_bytes)}, requested "
                          f"{format_bytes(m.requested_limit)}, revision {m.applied_revision}/{m.limit_revision}"),
                ("trim", f"{m.trim_ack_seq}/{m.trim_seq} acknowledged, last returned {format_bytes(m.trim_bytes)}, "
                         f"{format_bytes(m.trimmed_total)} in all"),
                ("sleep", "-" if m.sleep is None else
                          f"{m.sleep.state}" + ("" if m.sleep.capable else " (its engine cannot sleep)")
                          + ("" if m.sleep.after_idle_s is None else f", after {m.sleep.after_idle_s:g} s idle")
                          + (f", last released {format_bytes(m.sleep.slept_bytes)} in {m.sleep.took_s * 1000:.0f} ms"
                             if m.sleep.slept_bytes else "")),
                ("traffic", f"{m.alloc_count:,} allocs ({m.alloc_blocks:,} blocks) · {m.free_count:,} frees · "
                            f"{m.evicted_blocks:,} evicted"),
                ("device capacity", format_bytes(m.device_capacity) if m.device_capacity else "N/A"),
                *pressure_rows(m),
                *group_fields(m),
            ]
            if m.endpoint is not None:
                rows.append(("endpoint", m.endpoint))
            if self.router is not None:
                from kvtop.serve.router.published import summary

                rows.append(("router", summary(self.router)))
            for r in m.ranks:
                rows.append((f"rank {r.rank}", f"device {r.device}, pid {r.pid}, {format_bytes(r.mapped_bytes)}"
                             + ("" if r.alive else " (gone)")))
        for key, value in rows:
            info.add_row(key, Text(value))  # names and paths come from other processes: no markup
        with VerticalScroll(id="dialog"):
            yield Label(Text(m.name), id="question")
            yield Static(info)
            yield Label("fragmentation", classes="section")
            yield Static(frag_table(m))
            if m.pages is not None and not m.legacy:
                worst = fragmentation(m).worst_pages
                if worst:
                    yield Label("emptiest in-use pages (what pins memory)", classes="section")
                    yield Static(Text("  ".join(f"#{p.page} {p.used}/{p.capacity}" for p in worst)))
            yield Static("Escape or Enter closes", id="hint")


def pressure_rows(m: ModelSnapshot) -> list[tuple[str, str]]:
    """The details screen's policy and reclaim rows (none when the model publishes no policy)."""
    p = m.pressure
    if p is None:
        return []
    rows = [("policy", f"min {format_bytes(p.min_bytes) if p.min_bytes else 'none'}, priority {p.priority}, "
                       f"revision {p.policy_revision}"
                       + ("" if p.can_give_cached else "; its engine cannot give cached pages"))]
    rows.append(("reclaim", f"gave {format_bytes(p.gave_total)} in {p.gave_count} · took {format_bytes(p.took_total)} "
                            f"in {p.took_count} · asked {p.asked_count}"
                            + (f" · waits for {format_bytes(p.wanted_bytes)}" if p.wanted_bytes else "")
                            + (f" · last {p.latency_s * 1000:.0f} ms" if p.took_count else "")))
    return rows
