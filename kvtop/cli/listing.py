"""Read commands: ``kvctl list``, ``kvctl show``, ``kvctl frag``."""

from __future__ import annotations

import click

from kvcached_core import fragmentation, pagemap
from kvtop.cli import Failure, model_argument
from kvtop.cli.common import Whole, emit_json, pick, problem_line, read, warn

JSON_HELP = "Print JSON (every key is documented in docs/json.md) instead of text."


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--gpu", type=Whole(min=0), metavar="N", help="Only models on GPU (device) N.")
@click.option("--all", "show_all", is_flag=True,
              help="Also show stale segments (dead processes) and warn about unusable files.")
def list_cmd(as_json: bool, gpu: int | None, show_all: bool) -> None:
    """One row per model: memory, limit, waste and pages.

    Shows live and legacy (upstream kvcached) models; --all adds stale ones and prints one
    warning line on stderr for each file in the segment directory that is not a usable segment
    (24-byte files that only look like upstream's struct too). Without --all, a warning line
    still names each segment of a running model that cannot be read (its header overwritten).
    A model whose process stays inside a publish (stopped, or held by a debugger) shows as late
    with its last known figures, and a warning line says how old they are.

    \b
    Examples:
      kvctl list
      kvctl list --json | jq '.[] | {name, mapped_bytes, waste_ratio}'
      kvctl list --all --gpu 1
    """
    found = read(include_stale=show_all, warn_problems=show_all, gpu=gpu)
    if not show_all:  # a live model that cannot be read is never left out silently
        for problem in found.problems:
            if problem.writer_alive:
                warn(problem_line(problem))
    if as_json:
        rows = [m.to_dict() for m in found.models]
        _add_router_figures(rows, warn_untrusted=show_all)
        emit_json(rows)
        return
    if not found.models:
        click.echo("no models" + ("" if show_all else " (kvctl list --all also shows stale ones)"))
        return
    from kvtop.frames.events import stuck_text
    from kvtop.text import textfmt as T  # text only: --json never pays for it

    T.print_table(T.LIST_COLUMNS, [T.list_row(m) for m in found.models])
    for m in found.models:  # a process stopped inside a publish still holds its memory: its figures are its last
        stuck = stuck_text(m)
        if stuck is not None:
            warn(f"{m.name}: {stuck}")


def _router_figures(name: str) -> dict | None:
    from kvcached_core.settings import settings
    from kvtop.serve.router.published import read as read_routers

    return read_routers(settings().shm_dir).models.get(name)


def _add_router_figures(rows: list[dict], *, warn_untrusted: bool) -> None:
    """Each row's ``router`` key: what a running ``kvctl route`` counted for the model (docs/json.md), else null."""
    from kvcached_core.settings import settings
    from kvtop.serve.router.published import read as read_routers

    found = read_routers(settings().shm_dir)
    for row in rows:
        row["router"] = found.models.get(row["name"])
    if warn_untrusted:
        for path, why in found.untrusted:
            warn(f"{path}: router figures not trusted: {why}")


@click.command("show")
@model_argument()
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--width", type=Whole(8, 512), default=64, show_default=True,
              help="Cells per row of the page map.")
@click.option("--rows", type=Whole(1, 1024), default=16, show_default=True,
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
    found = read(with_pages=True)
    snap = pick(model, found)
    frag = fragmentation(snap)
    if as_json:
        out = snap.to_dict()
        out["fragmentation"] = None if snap.legacy else frag.to_dict()  # upstream publishes no page map
        out["pages"] = [[int(mapped), used, cached] for mapped, used, cached in pagemap.decoded(snap.page_entries())]
        _add_router_figures([out], warn_untrusted=False)
        emit_json(out)
        return
    from kvtop.text import textfmt as T

    lines = T.show_lines(snap, frag, found.models)
    if snap.endpoint is not None:
        lines.append(f"  {'endpoint':<12} {snap.endpoint}")
    figures = _router_figures(snap.name)
    if figures is not None:
        from kvtop.serve.router.published import summary

        lines.append(f"  {'router':<12} {summary(figures)}")
    click.echo("\n".join([*lines, "", *T.page_map_lines(snap, width, rows)]))


@click.command("frag")
@model_argument(required=False)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--worst", type=Whole(0, 1000), default=8, show_default=True,
              help="How many of the emptiest in-use pages to list.")
def frag_cmd(model: str | None, as_json: bool, worst: int) -> None:
    """The fragmentation report: held vs pinned, waste, packed floor, what trim or eviction would return.

    Without MODEL, one row per live model; with MODEL (stale ones too), the full report
    including the emptiest in-use pages. Upstream kvcached (legacy) segments publish no page
    map, so they have no report. --json prints an object for one model, an array otherwise.

    \b
    Examples:
      kvctl frag
      kvctl frag llama
      kvctl frag llama --json | jq '.reclaimable_trim_bytes'
    """
    if model is not None:
        snap = pick(model, read(with_pages=True))
        if snap.legacy:
            raise Failure(f"{snap.name} is an upstream kvcached segment: it publishes no page map, "
                          "so its fragmentation is unknown")
        frag = fragmentation(snap, worst)
        if as_json:
            emit_json({"name": snap.name, "status": snap.status, **frag.to_dict()})
            return
        from kvtop.text import textfmt as T

        click.echo("\n".join(T.frag_lines(snap, frag)))
        return
    found = read(with_pages=True, include_stale=False)
    reports = [(m, fragmentation(m, worst)) for m in found.models if not m.legacy]
    if as_json:
        emit_json([{"name": m.name, "status": m.status, **f.to_dict()} for m, f in reports])
        return
    if not reports:
        click.echo("no models")
        return
    from kvtop.text import textfmt as T

    T.print_table(T.FRAG_COLUMNS, [T.frag_row(m, f) for m, f in reports])
