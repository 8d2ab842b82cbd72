"""Text output for kvctl: tables (plain, or rich on a terminal), human figures, the page-map grid.

rich is imported only inside :func:`print_table` when a terminal asks for it; everything else
here is plain Python, so machine output (``--json``, pipes) never pays for it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from kvcached_core import Fragmentation, ModelSnapshot, format_bytes
from kvtop.text.pagemap import GLYPHS, LEGEND, fold, grid_lines

# What a trim of a busy model leads to, said wherever a trim is asked for or answered.
REFILL_NOTE = "the warm pool refills while traffic lasts; a limit keeps it down"


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # numbers align right


def want_rich(stream: TextIO | None = None) -> bool:
    """Rich tables only for a person at a terminal."""
    stream = stream or sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return tty and os.environ.get("TERM") != "dumb"


def plain_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns separated by two spaces; no trailing blanks; stable for scripts and tests."""
    widths = [len(c.header) for c in columns]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [cell.rjust(w) if col.right else cell.ljust(w) for cell, w, col in zip(cells, widths, columns, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line([c.header for c in columns]), *(line(r) for r in rows)])


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], *, rich: bool | None = None,
                title: str | None = None) -> None:
    """Write a table to stdout: rich box drawing on a terminal, plain text elsewhere."""
    if rich is None:
        rich = want_rich()
    if not rich:
        if title:
            sys.stdout.write(title + "\n")
        sys.stdout.write(plain_table(columns, rows) + "\n")
        sys.stdout.flush()
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    for col in columns:
        table.add_column(col.header, justify="right" if col.right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell, style=cell_style(col.header, cell)) for col, cell in zip(columns, row, strict=True)))
    console = Console(highlight=False)
    console.width = max(console.width, len(plain_table(columns, rows).split("\n", 1)[0]) + 4)  # wrap, never truncate
    console.print(table)


# A model's status and sleep state, one colour each wherever they are shown (kvctl's tables, kvtop's).
STATUS_STYLES = {"live": "green", "stale": "bold red", "legacy": "cyan", "shrinking": "bold yellow",
                 "late": "bold yellow", "draining": "yellow", "asleep": "blue"}


def cell_style(header: str, cell: str) -> str:
    """Colour for a person at a terminal: status by state, waste by how far from 1.00x it is."""
    if header == "STATUS":
        return STATUS_STYLES.get(cell, "")
    if header == "WASTE" and cell.endswith("x"):
        ratio = float(cell[:-1])
        return "red" if ratio >= 4 else "yellow" if ratio >= 2 else ""
    return ""


# -- human figures -------------------------------------------------------------------------

def fmt_bytes(n: int | None) -> str:
    return format_bytes(n)


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def fmt_limit(m: ModelSnapshot) -> str:
    """``4.0 GiB applied``, ``1.0 GiB deferred``, or ``none``."""
    if m.limit_bytes is None and m.requested_limit is None:
        return "none"
    shown = m.limit_bytes if m.limit_bytes is not None else m.requested_limit
    return f"{format_bytes(shown)} {m.limit_status}"


def fmt_device(m: ModelSnapshot) -> str:
    """``0``, or ``0,1 tp2`` for a model split over tensor-parallel ranks."""
    text = ",".join(str(d) for d in m.devices)
    return f"{text} tp{m.tp_world}" if m.tp_world > 1 else text


def fmt_pages(m: ModelSnapshot) -> str:
    return "-" if m.legacy else f"{m.pages_inuse}/{m.pages_total}"


LIST_COLUMNS = (
    Column("NAME"), Column("ENGINE"), Column("PID", True), Column("DEV", True), Column("STATUS"),
    Column("MAPPED", True), Column("HELD", True), Column("RESERVED", True), Column("CACHED", True),
    Column("LIMIT", True), Column("WASTE", True), Column("PAGES", True),
)


def list_row(m: ModelSnapshot) -> list[str]:
    """One ``kvctl list`` row."""
    return [
        m.name, m.engine, str(m.pid) if m.pid else "-", fmt_device(m), m.display_status,
        fmt_bytes(m.mapped_bytes), fmt_bytes(m.held_bytes), fmt_bytes(m.reserved_bytes),
        fmt_bytes(m.cached_bytes),  # None ("-") for upstream segments
        fmt_limit(m), fmt_ratio(m.waste_ratio), fmt_pages(m),
    ]


# -- show and frag ---------------------------------------------------------------------

def pressure_fields(m: ModelSnapshot, models: Sequence[ModelSnapshot] = ()) -> list[tuple[str, str]]:
    """``kvctl show``'s policy and reclaim lines (``models``: the others, to name the one a donor gave to)."""
    from kvtop.frames.events import asker_name

    p = m.pressure
    if m.legacy:
        return []
    if p is None:
        return [("policy", "unknown (its pressure words cannot be true)")]
    rows = [("policy", f"min {fmt_bytes(p.min_bytes) if p.min_bytes else 'none'}, priority {p.priority}"
                       + (f" (revision {p.policy_revision})" if p.policy_revision else ""))]
    if p.wanted_bytes and m.status == "live":
        rows.append(("pressure", f"waiting for {fmt_bytes(p.wanted_bytes)}: the budget refused its growth, "
                                 "it asks the other models"))
    gave = f"{fmt_bytes(p.gave_total)} in {p.gave_count} reclaims"
    if p.gave_count:
        gave += (f"; last {fmt_bytes(p.given_bytes)} to {asker_name(p.given_to, models)} (cached "
                 f"{fmt_bytes(p.given_cached)}, reserved {fmt_bytes(p.given_reserved)}) in {p.given_took_s * 1000:.0f} ms")
    took = f"{fmt_bytes(p.took_total)} in {p.took_count} reclaims, {p.asked_count} requests asked"
    if p.took_count:
        took += f"; last {p.latency_s * 1000:.0f} ms from its ask to the bytes given"
    return [*rows, ("gave", gave), ("took", took)]


def group_fields(m: ModelSnapshot) -> list[tuple[str, str]]:
    """One line per KV cache group its engine publishes (none when it publishes none): shape, layers, and the
    blocks and pages of the group."""
    out = []
    for i, g in enumerate(m.groups or ()):
        out.append((f"group {i}", f"{g.label}, {g.layers} layers: {g.blocks_active} active + {g.blocks_cached} cached "
                                  f"blocks on {g.pages} pages"))
    return out


def show_lines(m: ModelSnapshot, frag: Fragmentation, models: Sequence[ModelSnapshot] = ()) -> list[str]:
    """The text of ``kvctl show`` above the page map (``models``: every model read, to name reclaim partners)."""
    lines = [f"{m.name}  (model {m.model}, engine {m.engine}, backend {m.backend}, pid {m.pid or '-'}, device {fmt_device(m)})"]

    def field(label: str, text: str) -> None:
        lines.append(f"  {label:<12} {text}")

    field("status", m.display_status)
    if not m.legacy:
        field("pages", f"{m.pages_inuse} in use, {m.pages_reserved} reserved, {m.pages_free} free, {m.pages_total} total "
                       f"(page {fmt_bytes(m.page_size)}, bundle {fmt_bytes(m.bundle_bytes)} "
                       f"= {m.num_layers} layers x {m.num_kv_buffers} buffers"
                       + (f" x {m.tp_world} ranks)" if m.tp_world > 1 else ")"))
        field("blocks", f"{m.blocks_used} used ({m.blocks_cached} cached) of {m.num_blocks}, "
                        f"{m.blocks_per_page} per page, {fmt_bytes(m.block_bytes)} each per layer and buffer")
    field("memory", f"mapped {fmt_bytes(m.mapped_bytes)}, held {fmt_bytes(m.held_bytes)}, "
                    f"pinned {fmt_bytes(m.pinned_bytes)}, reserved {fmt_bytes(m.reserved_bytes)}"
                    + ("" if m.legacy else f", cached {fmt_bytes(m.cached_bytes)}"))
    limit = fmt_limit(m)
    if m.limit_revision:
        limit += f" (revision {m.limit_revision}, applied {m.applied_revision})"
    if m.legacy and m.limit_status == "pending":
        limit += f"; {fmt_bytes(m.held_bytes)} in use: the engine applies it only as pages free"
    if m.requested_limit is not None and m.limit_status == "deferred":
        limit += f"; waiting for {m.pages_inuse - (m.limit_bytes or 0) // max(1, m.bundle_bytes)} pages to empty"
    field("limit", limit)
    if m.device_capacity:
        field("capacity", f"{fmt_bytes(m.device_capacity)} on the device" + ("s" if len(m.devices) > 1 else ""))
    for label, text in pressure_fields(m, models):
        field(label, text)
    for label, text in group_fields(m):
        field(label, text)
    if not m.legacy:
        field("waste", f"{fmt_ratio(frag.waste_ratio)} pinned/held; packed floor {frag.packed_floor_pages} pages "
                       f"({fmt_bytes(frag.packed_floor_bytes)}), pinned {fmt_ratio(frag.pinned_over_floor)} of it")
        field("reclaimable", f"{fmt_bytes(frag.reclaimable_trim_bytes)} now by trim, "
                             f"{fmt_bytes(frag.reclaimable_evict_bytes)} by evicting cached blocks")
        field("activity", f"{m.alloc_count} allocs ({m.alloc_blocks} blocks), {m.free_count} frees "
                          f"({m.free_blocks} blocks), {m.evicted_blocks} evicted, trimmed {fmt_bytes(m.trimmed_total)}, "
                          f"idle returned {fmt_bytes(m.idle_returned)}")
        if m.heartbeat_ns:
            field("heartbeat", f"{max(0.0, (time.time_ns() - m.heartbeat_ns) / 1e9):.1f} s ago")
    for r in m.ranks:
        field(f"rank {r.rank}", f"device {r.device}, pid {r.pid}, mapped {fmt_bytes(r.mapped_bytes)}"
                                f"{'' if r.alive else ' (dead)'}")
    return lines


FRAG_COLUMNS = (
    Column("NAME"), Column("HELD", True), Column("PINNED", True), Column("WASTE", True),
    Column("FLOOR", True), Column("OVER-FLOOR", True), Column("TRIM-NOW", True), Column("EVICT", True),
)


def frag_lines(m: ModelSnapshot, f: Fragmentation) -> list[str]:
    """The text of ``kvctl frag MODEL``."""
    lines = [f"{m.name}  ({m.display_status})"]
    rows = [
        ("held", f"{fmt_bytes(f.held_bytes)}  (used blocks x block bundle)"),
        ("pinned", f"{fmt_bytes(f.pinned_bytes)}  (in-use pages x page bundle)"),
        ("waste", f"{fmt_ratio(f.waste_ratio)}  (pinned / held; 1.00x is ideal)"),
        ("packed floor", f"{f.packed_floor_pages} pages = {fmt_bytes(f.packed_floor_bytes)}; "
                         f"pinned is {fmt_ratio(f.pinned_over_floor)} of it"),
        ("trim now", f"{fmt_bytes(f.reclaimable_trim_bytes)}  (reserved pages: kvctl trim {m.name})"),
        ("evict", f"{fmt_bytes(f.reclaimable_evict_bytes)}  (pages holding only cached blocks)"),
        ("idle return", f"{fmt_bytes(f.idle_returned_bytes)}  (given back by the allocator itself when traffic stopped)"),
    ]
    c = f.compaction
    if c is not None:
        how = f"kvctl compact {m.name}" if c.capable else "its engine registered no compact handler"
        rows.append(("compaction", f"unknown (its figures cannot be true)  ({how})" if c.took_s is None else
                     f"{c.compactions} done, {c.blocks_moved} blocks moved: "
                     f"{fmt_bytes(c.bytes_returned)} returned, {fmt_bytes(c.bytes_copied)} copied; "
                     f"last took {c.took_s * 1000:.1f} ms  ({how})"))
    lines += [f"  {label:<13}{text}" for label, text in rows]
    if f.worst_pages:
        lines.append("  emptiest in-use pages:")
        for p in f.worst_pages:
            cached = f", {p.cached} cached" if p.cached else ""
            lines.append(f"    page {p.page:>6}  {p.used}/{p.capacity} blocks used{cached}")
    return lines


def frag_row(m: ModelSnapshot, f: Fragmentation) -> list[str]:
    """One row of ``kvctl frag`` without MODEL."""
    return [m.name, fmt_bytes(f.held_bytes), fmt_bytes(f.pinned_bytes), fmt_ratio(f.waste_ratio),
            f"{f.packed_floor_pages} pages", fmt_ratio(f.pinned_over_floor),
            fmt_bytes(f.reclaimable_trim_bytes), fmt_bytes(f.reclaimable_evict_bytes)]


# -- the page map --------------------------------------------------------------------------

def page_map_lines(m: ModelSnapshot, width: int = 64, max_rows: int = 16) -> list[str]:
    """The page map as a character grid with a row index, a scale line and a legend."""
    entries = m.page_entries()
    if not len(entries):
        return ["page map: none (upstream kvcached segments publish no page map)"
                if m.legacy else "page map: not read"]
    width = max(8, width)
    cells = fold(entries, m.blocks_per_page, width * max(1, max_rows))
    per = cells[0].pages if cells else 1
    scale = "1 page per cell" if per == 1 else f"{per} pages per cell (any page in use makes its cell in use)"
    lines = [f"page map: {len(entries)} pages, {scale}"]
    label = len(str(len(entries) - 1))
    for row, text in enumerate(grid_lines(cells, width)):
        lines.append(f"{row * width * per:>{label}} {text}")
    return lines + legend_lines(max(72, width + label + 1))


def legend_lines(width: int = 80) -> list[str]:
    """The glyph legend, wrapped to ``width`` columns."""
    lines, current = [], ""
    for state, meaning in LEGEND:
        item = f"{GLYPHS[state]} {meaning}"
        if current and len(current) + 2 + len(item) > width:
            lines.append(current)
            current = item
        else:
            current = f"{current}  {item}" if current else item
    return [*lines, current] if current else lines
