"""``kvtop --once``: one rich snapshot on stdout, then exit (also what kvtop does when stdout is no terminal)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvcached_core import ModelNotFound, ModelSnapshot, resolve
from kvtop.frames.history import History
from kvtop.frames.source import Frame, Source
from kvtop.screen.view import (
    COLUMNS,
    RATE_COLUMNS,
    cells_text,
    device_bars,
    device_lines,
    fit_per_cell,
    frag_table,
    legend_text,
    model_cells,
    sort_models,
)
from kvtop.text.pagemap import fold

MAP_ROWS = 8


def models_table(models: Sequence, history: History | None = None, width: int = 200) -> Table:
    """The model rows; columns that do not fit ``width`` are left out from the right, never squeezed.

    One read has no history: the sparkline and the allocation rate are left out.
    """
    names = [m.name for m in models]
    rows = [model_cells(m, history, names) for m in models]
    columns: list[tuple[str, str, bool]] = []
    used = 0
    for key, header, _width, right in COLUMNS:
        if key in RATE_COLUMNS:
            continue
        need = max([len(header)] + [row[key].cell_len for row in rows]) + (2 if columns else 0)
        if columns and used + need > width:
            break
        columns.append((key, header, right))
        used += need
    table = Table(box=None, pad_edge=False, header_style="bold", expand=False, padding=(0, 1))
    for _key, header, right in columns:
        table.add_column(header, justify="right" if right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(row[key] for key, _h, _r in columns))
    return table


def page_map(m: ModelSnapshot, width: int, rows: int = MAP_ROWS) -> RenderableType:
    """The whole page map folded into ``rows`` lines of ``width`` cells."""
    if m.legacy or m.pages is None:
        return Text("upstream kvcached segment: no page map", style="cyan")
    per = fit_per_cell(len(m.pages), width * rows)
    cells = fold(m.pages, m.blocks_per_page, width * rows, pages_per_cell=per)
    lines = [cells_text(cells[i:i + width]) for i in range(0, len(cells), width)]
    caption = Text(f"{len(m.pages):,} pages ({m.pages_inuse:,} in use, {m.pages_reserved:,} reserved, "
                   f"{m.pages_free:,} free), {per} page{'s' if per > 1 else ''}/cell", style="grey50")
    return Group(*lines, legend_text(), caption)


def render(frame: Frame, *, width: int, model: str | None = None, gpus: Sequence[int] | None = None,
           history: History | None = None) -> list[RenderableType]:
    """The snapshot as renderables: header, devices, models, and the chosen model's page map."""
    models = [m for m in frame.models if gpus is None or any(d in gpus for d in m.devices)]
    live = sum(1 for m in models if m.status == "live")
    out: list[RenderableType] = [Text.assemble(
        ("kvtop ", "bold"), f"{frame.host} · ", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(frame.taken_at)),
        f" · {len(models)} models, {live} live")]
    for bar in device_bars(frame):
        out.extend(device_lines(bar, width))
    if not frame.gpus and frame.gpu_note:
        out.append(Text(frame.gpu_note, style="grey50"))
    out.append(Text(""))
    out.append(models_table(sort_models(models, "name"), history, width) if models else Text("no models running"))
    for p in frame.problems:
        out.append(Text(f"{p.path}: {p.status}: {p.reason}", style="yellow"))
    if model is not None and frame.detail is not None:
        m = frame.detail
        out.append(Text(""))
        out.append(Panel(page_map(m, max(10, width - 4)), title=f"page map · {m.name}", title_align="left",
                         expand=False))
        out.append(Panel(frag_table(m), title="fragmentation", title_align="left", expand=False))
    return out


def print_once(source: Source, *, model: str | None = None, gpus: Sequence[int] | None = None,
               console: Console | None = None) -> int:
    """Read one frame and print it; a ``model`` that matches nothing is one line on stderr and exit 1."""
    console = console or Console(soft_wrap=False)
    name = None
    first = source.read(None)
    if first.directory_problem:
        print(f"kvtop: {first.directory_problem}", file=sys.stderr)
        return 1
    if model is not None:
        try:
            name = resolve(model, list(first.models)).name
        except ModelNotFound as exc:
            print(f"kvtop: {exc}", file=sys.stderr)
            return 1
    frame = source.read(name) if name is not None else first
    if not console.is_terminal and not os.environ.get("COLUMNS"):  # a file or a pipe: no width to fit
        console = Console(soft_wrap=False, file=console.file, width=max(console.width, full_width(frame, console)))
    for renderable in render(frame, width=console.width, model=name, gpus=gpus):
        console.print(renderable)
    return 0


def full_width(frame: Frame, console: Console) -> int:
    """Columns the model table needs to show every column (what a file gets instead of 80)."""
    table = models_table(sort_models(list(frame.models), "name"), None, width=1 << 16)
    return Measurement.get(console, console.options.update_width(1 << 16), table).maximum
