"""``kvctl report``'s text: a table of every model's figures, what its columns mean, then each model's story
(its limits, trims, sleeps and wakes, reclaims, and why a figure it cannot have is ``n/a``)."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence

from kvcached_core import format_bytes
from kvtop.text import textfmt as T

from .report import ModelReport, Reclaims
from .report_events import APPLIED, LimitSet

NA = "n/a"  # a figure the model cannot have: its line below the table says why
COLUMNS = (T.Column("MODEL"), T.Column("SAMPLES", True), T.Column("PEAK", True), T.Column("MEAN", True),
           T.Column("LIMITS", True), T.Column("DEFERRED", True), T.Column("TRIMS", True), T.Column("SLEEPS", True),
           T.Column("ASLEEP", True), T.Column("GAVE", True), T.Column("TOOK", True),
           T.Column("WASTE mean/max", True), T.Column("WAITING mean/max", True))
LEGEND = textwrap.wrap(
    "LIMITS limits set in the window; DEFERRED time a lowered limit waited for pages to empty; TRIMS trims "
    "(bytes returned); SLEEPS times it fell asleep; ASLEEP time asleep; GAVE / TOOK reclaims given to and taken "
    "from other models (bytes); WASTE pinned / held, mean/max; WAITING requests queued in its engine, mean/max; "
    f"{NA}: the model cannot have it (why: below).", 110)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def moment(at: float, with_date: bool) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S", time.localtime(at))


def _latency(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _count_bytes(count: int, n_bytes: int) -> str:
    return f"{count} ({format_bytes(n_bytes)})"


def table_rows(reports: Sequence[ModelReport]) -> list[list[str]]:
    def known(r: ModelReport, figure: str, text: str) -> str:
        return NA if r.why_unknown(figure) else text

    return [[r.name, str(r.samples), format_bytes(r.peak_mapped_bytes), format_bytes(r.mean_mapped_bytes),
             str(sum(limit.set_at is not None for limit in r.limits)), duration(r.deferred_s),
             known(r, "trims", _count_bytes(r.trims.count, r.trims.bytes)),
             known(r, "sleeps", str(r.sleeps.count)), known(r, "sleeps", duration(r.asleep_s)),
             known(r, "reclaims", _count_bytes(r.given.count, r.given.bytes)),
             known(r, "reclaims", _count_bytes(r.taken.count, r.taken.bytes)),
             known(r, "waste", "-" if r.waste_mean is None else f"{T.fmt_ratio(r.waste_mean)}/{T.fmt_ratio(r.waste_max)}"),
             known(r, "waiting", "-" if r.waiting_mean is None else f"{r.waiting_mean:.1f}/{r.waiting_max}")]
            for r in reports]


def limit_line(limit: LimitSet, dated: bool) -> str:
    """One limit: what was asked, when, how long it was deferred and when it applied."""
    if limit.revision:
        what = f"limit r{limit.revision}"
    else:
        what = "limit (its engine's own)" if limit.status not in ("written", "pending") else "limit (upstream total)"
    if limit.asked_bytes is None and limit.effective_bytes is None:
        value = "lifted"
    else:
        value = format_bytes(limit.asked_bytes if limit.asked_bytes is not None else limit.effective_bytes)
        if limit.effective_bytes is not None and limit.effective_bytes != limit.asked_bytes:
            value += f" ({format_bytes(limit.effective_bytes)} in whole page bundles)"
    when = "set before the window" if limit.set_at is None else f"set {moment(limit.set_at, dated)}"
    parts = [f"{what}: {value}, {when}"]
    if limit.deferred_s > 0 or limit.status == "deferred":
        parts.append(f"deferred {duration(limit.deferred_s)} ({format_bytes(limit.in_use_bytes)} in use)")
    if limit.applied_at is not None:
        parts.append("applied at once" if limit.applied_at == limit.set_at and limit.deferred_s == 0
                     else f"applied {moment(limit.applied_at, dated)}")
    elif limit.status in APPLIED and limit.set_at is None:
        parts.append("applied before the window")
    elif limit.status == "deferred":
        parts.append("not applied in the window")
    elif limit.status not in APPLIED:
        parts.append(f"acknowledged {limit.status}")
    return ", ".join(parts)


def _reclaims(verb: str, r: Reclaims, latency: str) -> str:
    if not r.count:
        return f"{verb} none"
    return (f"{verb} {r.count} ({format_bytes(r.bytes)} in all; {latency}: p50 {_latency(r.p50_s)}, "
            f"p99 {_latency(r.p99_s)})")


def story_lines(r: ModelReport, dated: bool) -> list[str]:
    """A model's story over the window, one line a kind of thing, indented under its name."""
    lines = [r.name]

    def na(figure: str, label: str) -> bool:
        why = r.why_unknown(figure)
        if why:
            lines.append(f"  {label}: {NA}: {why}")
        return why is not None

    lines.extend(f"  {limit_line(limit, dated)}" for limit in r.limits)
    if not r.limits:
        lines.append("  limits: none")
    if not na("trims", "trims"):
        t = r.trims
        lines.append(f"  trims: {t.count}, {format_bytes(t.bytes)} returned" if t.count else "  trims: none")
    if not na("sleeps", "sleeps"):
        s = r.sleeps
        if s.count or s.wakes:
            line = f"  sleeps: {s.count}, asleep {duration(r.asleep_s)}, {format_bytes(s.released_bytes)} released"
            causes = [f"{n} by {what}" for n, what in ((s.woken_by_request, "a request"),
                                                     (s.woken_by_controller, "a wake request")) if n]
            line += f"; woken {s.wakes}: {', '.join(causes)}" if s.wakes else "; not woken in the window"
            if s.woken_before_asleep:
                line += f" ({s.woken_before_asleep} before it was asleep)"
            lines.append(line)
        else:
            lines.append("  sleeps: none")
    if not na("reclaims", "reclaims"):
        lines.append(f"  reclaims: {_reclaims('took', r.taken, 'ask to bytes')}; "
                     f"{_reclaims('gave', r.given, 'request to answer')}")
    na("waste", "waste")
    na("waiting", "waiting")
    return lines
