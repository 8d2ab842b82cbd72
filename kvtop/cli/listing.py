"""Read commands: ``kvctl list``, ``kvctl show``, ``kvctl frag``."""

from __future__ import annotations

import sys
import time

import click

from kvcached_core import ModelSnapshot, fragmentation
from kvcached_core import layout as L
from kvcached_core.frag import Fragmentation
from kvtop import textfmt as T
from kvtop.cli import model_argument
from kvtop.cli.common import emit_json, pick, read

JSON_HELP = "Print JSON (the schema is documented in the README) instead of text."


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--gpu", type=click.IntRange(min=0), metavar="N", help="Only models on GPU (device) N.")
@click.option("--all", "show_all", is_flag=True,
              help="Also show stale segments (dead processes) and warn about unusable files.")
def list_cmd(as_json: bool, gpu: int | None, show_all: bool) -> None:
    """One row per model: memory, limit, waste and pages.

    Shows live and legacy (upstream kvcached) models; --all adds stale ones and prints one
    warning line on stderr for each file in the segment directory that is not a usable segment.

    \b
    Examples:
      kvctl list
      kvctl list --json | jq '.[] | {name, mapped_bytes, waste_ratio}'
      kvctl list --all --gpu 1
    """
    found = read(include_stale=show_all, warn_problems=show_all, gpu=gpu)
    if as_json:
        emit_json([m.to_dict() for m in found.models])
        return
    if not found.models:
        click.echo("no models" + ("" if show_all else " (kvctl list --all also shows stale ones)"))
        return
    T.print_table(T.LIST_COLUMNS, [T.list_row(m) for m in found.models])


@click.command("show")
@model_argument()
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--width", type=click.IntRange(8, 512), default=64, show_default=True,
              help="Cells per row of the page map.")
@click.option("--rows", type=click.IntRange(1, 1024), default=16, show_default=True,
              help="Most rows of the page map; a larger map folds several pages into a cell.")
def show_cmd(model: str, as_json: bool, width: int, rows: int) -> None:
    """Everything about one model, with its page map drawn as a character grid.

    MODEL is a name or a unique prefix of one (see kvctl list --all).

    \b
    Examples:
      kvctl show llama-3-8b
      kvctl show llama --width 100 --rows 8
      kvctl show llama --json | jq '.fragmentation.waste_ratio'
    """
    snap = pick(model, read(with_pages=True))
    frag = fragmentation(snap)
    if as_json:
        out = snap.to_dict()
        out["fragmentation"] = frag.to_dict()
        out["pages"] = [[int(mapped), used, cached] for mapped, used, cached in map(L.decode_page, snap.page_entries())]
        emit_json(out)
        return
    for line in describe(snap, frag):
        click.echo(line)
    click.echo()
    for line in T.page_map_lines(snap, width, rows):
        click.echo(line)


def describe(m: ModelSnapshot, frag: Fragmentation) -> list[str]:
    """The text of ``kvctl show`` above the page map."""
    lines = [f"{m.name}  (model {m.model}, engine {m.engine}, backend {m.backend}, pid {m.pid}, device {T.fmt_device(m)})"]

    def field(label: str, text: str) -> None:
        lines.append(f"  {label:<12} {text}")

    field("status", m.display_status)
    if m.status != "legacy":
        free = m.pages_total - m.pages_inuse - m.pages_reserved
        field("pages", f"{m.pages_inuse} in use, {m.pages_reserved} reserved, {free} free, {m.pages_total} total "
                       f"(page {T.fmt_bytes(m.page_size)}, bundle {T.fmt_bytes(m.bundle_bytes)} "
                       f"= {m.num_layers} layers x {m.num_kv_buffers} buffers"
                       + (f" x {m.tp_world} ranks)" if m.tp_world > 1 else ")"))
        field("blocks", f"{m.blocks_used} used ({m.blocks_cached} cached) of {m.num_blocks}, "
                        f"{m.blocks_per_page} per page, {T.fmt_bytes(m.block_bytes)} each per layer and buffer")
    field("memory", f"mapped {T.fmt_bytes(m.mapped_bytes)}, held {T.fmt_bytes(m.held_bytes)}, "
                    f"pinned {T.fmt_bytes(m.pinned_bytes)}, reserved {T.fmt_bytes(m.reserved_bytes)}"
                    + ("" if m.status == "legacy" else f", cached {T.fmt_bytes(m.cached_bytes)}"))
    limit = T.fmt_limit(m)
    if m.limit_revision:
        limit += f" (revision {m.limit_revision}, applied {m.applied_revision})"
    if m.requested_limit is not None and m.limit_status == "deferred":
        limit += f"; waiting for {m.pages_inuse - (m.limit_bytes or 0) // max(1, m.bundle_bytes)} pages to empty"
    field("limit", limit)
    if m.device_capacity:
        field("capacity", f"{T.fmt_bytes(m.device_capacity)} on the device" + ("s" if len(m.devices) > 1 else ""))
    field("waste", f"{T.fmt_ratio(frag.waste_ratio)} pinned/held; packed floor {frag.packed_floor_pages} pages "
                   f"({T.fmt_bytes(frag.packed_floor_bytes)}), pinned {T.fmt_ratio(frag.pinned_over_floor)} of it")
    field("reclaimable", f"{T.fmt_bytes(frag.reclaimable_trim_bytes)} now by trim, "
                         f"{T.fmt_bytes(frag.reclaimable_evict_bytes)} by evicting cached blocks")
    if m.status != "legacy":
        field("activity", f"{m.alloc_count} allocs ({m.alloc_blocks} blocks), {m.free_count} frees "
                          f"({m.free_blocks} blocks), {m.evicted_blocks} evicted, trimmed {T.fmt_bytes(m.trimmed_total)}, "
                          f"idle returned {T.fmt_bytes(m.idle_returned)}")
        if m.heartbeat_ns:
            field("heartbeat", f"{max(0.0, (time.time_ns() - m.heartbeat_ns) / 1e9):.1f} s ago")
    for r in m.ranks:
        field(f"rank {r.rank}", f"device {r.device}, pid {r.pid}, mapped {T.fmt_bytes(r.mapped_bytes)}"
                                f"{'' if r.alive else ' (dead)'}")
    return lines


FRAG_COLUMNS = (
    T.Column("NAME"), T.Column("HELD", True), T.Column("PINNED", True), T.Column("WASTE", True),
    T.Column("FLOOR", True), T.Column("OVER-FLOOR", True), T.Column("TRIM-NOW", True), T.Column("EVICT", True),
)


@click.command("frag")
@model_argument(required=False)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--worst", type=click.IntRange(0, 1000), default=8, show_default=True,
              help="How many of the emptiest in-use pages to list.")
def frag_cmd(model: str | None, as_json: bool, worst: int) -> None:
    """The fragmentation report: held vs pinned, waste, packed floor, what trim or eviction would return.

    Without MODEL, one row per live or legacy model; with MODEL, the full report including the
    emptiest in-use pages. --json prints an object for one model, an array otherwise.

    \b
    Examples:
      kvctl frag
      kvctl frag llama
      kvctl frag llama --json | jq '.reclaimable_trim_bytes'
    """
    if model is not None:
        snap = pick(model, read(with_pages=True))
        frag = fragmentation(snap, worst)
        if as_json:
            emit_json({"name": snap.name, "status": snap.status, **frag.to_dict()})
            return
        report(snap, frag)
        return
    found = read(with_pages=True, include_stale=False)
    reports = [(m, fragmentation(m, worst)) for m in found.models]
    if as_json:
        emit_json([{"name": m.name, "status": m.status, **f.to_dict()} for m, f in reports])
        return
    if not reports:
        click.echo("no models")
        return
    T.print_table(FRAG_COLUMNS, [
        [m.name, T.fmt_bytes(f.held_bytes), T.fmt_bytes(f.pinned_bytes), T.fmt_ratio(f.waste_ratio),
         f"{f.packed_floor_pages} pages", T.fmt_ratio(f.pinned_over_floor),
         T.fmt_bytes(f.reclaimable_trim_bytes), T.fmt_bytes(f.reclaimable_evict_bytes)]
        for m, f in reports
    ])


def report(m: ModelSnapshot, f: Fragmentation) -> None:
    out = sys.stdout
    out.write(f"{m.name}  ({m.display_status})\n")
    rows = [
        ("held", f"{T.fmt_bytes(f.held_bytes)}  (used blocks x block bundle)"),
        ("pinned", f"{T.fmt_bytes(f.pinned_bytes)}  (in-use pages x page bundle)"),
        ("waste", f"{T.fmt_ratio(f.waste_ratio)}  (pinned / held; 1.00x is ideal)"),
        ("packed floor", f"{f.packed_floor_pages} pages = {T.fmt_bytes(f.packed_floor_bytes)}; "
                         f"pinned is {T.fmt_ratio(f.pinned_over_floor)} of it"),
        ("trim now", f"{T.fmt_bytes(f.reclaimable_trim_bytes)}  (reserved pages: kvctl trim {m.name})"),
        ("evict", f"{T.fmt_bytes(f.reclaimable_evict_bytes)}  (pages holding only cached blocks)"),
    ]
    for label, text in rows:
        out.write(f"  {label:<13}{text}\n")
    if f.worst_pages:
        out.write("  emptiest in-use pages:\n")
        for p in f.worst_pages:
            cached = f", {p.cached} cached" if p.cached else ""
            out.write(f"    page {p.page:>6}  {p.used}/{p.capacity} blocks used{cached}\n")
    out.flush()
