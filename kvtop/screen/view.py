"""What the screen says, as rich renderables: shared by the dashboard widgets and ``--once``.

Pure functions of a :class:`~kvtop.frames.source.Frame` (and the history): no textual here, so the
non-interactive snapshot does not pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rich.table import Table
from rich.text import Text

from kvcached_core import ModelSnapshot, format_bytes, fragmentation, pagemap, percent
from kvtop.frames.history import History
from kvtop.frames.source import Frame
from kvtop.text.pagemap import GLYPHS, Cell
from kvtop.text.textfmt import STATUS_STYLES, fmt_device

SORT_KEYS = ("name", "mapped", "waste", "alloc/s", "held")
MODEL_COLOURS = ("dodger_blue1", "dark_orange", "medium_purple1", "spring_green2", "gold1", "hot_pink",
                 "turquoise2", "salmon1", "chartreuse2", "orchid1", "sky_blue1", "light_goldenrod2")
STATE_STYLES = {"free": "grey35", "reserved": "steel_blue1", "cached": "magenta", "low": "yellow",
                "mid": "chartreuse3", "high": "green3", "full": "bold green1"}
RESERVED_STYLE, OTHERS_STYLE, FREE_STYLE = "steel_blue1", "grey50", "grey27"
WORKING_STYLE, HEADROOM_STYLE = "khaki3", "grey42"  # free memory kept from KV (DeviceBar.kept)
SPARK = "▁▂▃▄▅▆▇█"

# (key, header, width, right-aligned): the width a column's values take (a size: "1023.9 MiB"), so the
# columns chosen to fit the screen still fit as the figures change; a wider value widens its column.
COLUMNS = (
    ("name", "model", 12, False), ("status", "status", 9, False), ("mapped", "mapped", 10, True),
    ("limit", "limit", 10, True), ("held", "held", 10, True), ("reserved", "reserved", 10, True),
    ("cached", "cached", 10, True), ("waste", "waste", 6, True), ("rate", "alloc/s", 12, True),
    ("spark", "mapped history", 16, False), ("toks", "tok/s", 7, True), ("reqs", "req/s", 6, True),
    ("waiting", "wait", 5, True), ("preempt", "preempt", 7, True), ("idle", "idle", 6, True),
    ("tokspark", "tok/s history", 16, False), ("engine", "engine", 7, False), ("pid", "pid", 7, True),
    ("device", "dev", 3, True), ("min", "min", 8, True), ("prio", "prio", 4, True),
)
RATE_COLUMNS = ("rate", "spark", "toks", "reqs", "tokspark")  # need two reads: not in a one-shot table
TRAFFIC_COLUMNS = ("toks", "reqs", "waiting", "preempt", "idle", "tokspark")  # the engine's traffic words
POLICY_COLUMNS = ("min", "prio")  # the memory policy (PRESSURE words)
SPARK_WIDTH = 16
MAX_PER_CELL = 1 << 20


def unpublished_columns(models: Sequence[ModelSnapshot]) -> frozenset[str]:
    """The columns none of ``models`` can fill, whatever the frame: traffic when no engine publishes its traffic,
    the policy when no model publishes one (upstream segments). A property of the models, not of a frame's values."""
    hidden: set[str] = set()
    if all(m.traffic is None for m in models):
        hidden.update(TRAFFIC_COLUMNS)
    if all(m.pressure is None for m in models):
        hidden.update(POLICY_COLUMNS)
    return frozenset(hidden)


def size(n: int | None) -> str:
    return format_bytes(n) if n is not None else "-"


def model_colour(name: str, names: Sequence[str]) -> str:
    ordered = sorted(names)
    index = ordered.index(name) if name in ordered else 0
    return MODEL_COLOURS[index % len(MODEL_COLOURS)]


def waste_style(ratio: float | None) -> str:
    if ratio is None:
        return "grey50"
    return "green" if ratio < 1.25 else "yellow" if ratio < 2.0 else "bold red"


def filter_models(models: Sequence[ModelSnapshot], text: str) -> list[ModelSnapshot]:
    """Models whose name, model, engine or status (asleep and draining too) contains ``text`` (case-insensitive)."""
    needle = text.strip().lower()
    if not needle:
        return list(models)
    return [m for m in models
            if any(needle in v.lower() for v in (m.name, m.model, m.engine, m.display_status))]


def sort_models(models: Sequence[ModelSnapshot], key: str, history: History | None = None) -> list[ModelSnapshot]:
    """By name ascending, or by the figure descending (ties by name)."""
    if key == "name":
        return sorted(models, key=lambda m: m.name)
    figure = {
        "mapped": lambda m: m.mapped_bytes,
        "waste": lambda m: m.waste_ratio or 0.0,
        "alloc/s": lambda m: (history.rate(m.name) if history else None) or 0.0,
        "held": lambda m: m.held_bytes,
    }[key]
    return sorted(models, key=lambda m: (-figure(m), m.name))


def sparkline(values: Sequence[int], width: int = SPARK_WIDTH) -> str:
    """The last ``width`` values as block characters, scaled from 0 to the window's maximum."""
    window = list(values)[-width:]
    if not window:
        return ""
    top = max(window)
    if top <= 0:
        return SPARK[0] * len(window)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in window)


def limit_cell(m: ModelSnapshot) -> Text:
    if m.display_status == "shrinking" and m.requested_limit is not None:
        return Text(f"↓{format_bytes(m.requested_limit)}", style="bold yellow")
    if m.legacy and m.limit_status == "pending":  # written below what is in use: applies as pages free
        return Text(f"↓{format_bytes(m.limit_bytes)}", style="bold yellow")
    if m.limit_bytes is None:
        return Text("-", style="grey50")
    style = "bold red" if m.limit_status == "conflict" else ""
    return Text(format_bytes(m.limit_bytes), style=style)


PRESSURE_MARK = "↑"  # after the status: the model waits for memory (a refused growth asked the others)


def under_pressure(m: ModelSnapshot) -> bool:
    """The model waits for memory: the budget refused its growth and it asked the other models."""
    return m.pressure is not None and m.pressure.wanted_bytes > 0 and m.status == "live"


def status_cell(m: ModelSnapshot) -> Text:
    """The model's status; a late model whose process stays inside a publish also says how old its figures are."""
    status = m.display_status
    text = Text(status, style=STATUS_STYLES.get(status, ""))
    age = m.figures_age_s
    if age is not None:
        text.append(f" {age:.0f}s" if age < 100 else f" {age / 60:.0f}m" if age < 6000 else f" {age / 3600:.0f}h",
                    style="yellow")
    if under_pressure(m):
        text.append(f" {PRESSURE_MARK}", style="bold yellow")
    return text


def policy_cells(m: ModelSnapshot) -> dict[str, Text]:
    """The min and priority columns; '-' where the model publishes no policy (upstream, older allocators)."""
    p = m.pressure
    if p is None:
        return {"min": Text("-", style="grey50"), "prio": Text("-", style="grey50")}
    return {"min": Text(format_bytes(p.min_bytes)) if p.min_bytes else Text("-", style="grey50"),
            "prio": Text(str(p.priority), style="" if p.priority else "grey50")}


def mapped_cell(m: ModelSnapshot) -> Text:
    use = percent(m.mapped_bytes, m.limit_bytes)  # of the limit; None without one
    style = "" if use is None else "bold red" if use >= 95 else "yellow" if use >= 80 else ""
    return Text(format_bytes(m.mapped_bytes), style=style)


def model_cells(m: ModelSnapshot, history: History | None = None, names: Sequence[str] = ()) -> dict[str, Text]:
    """One table row, keyed like :data:`COLUMNS`; ``names`` (every model) picks the colour swatch."""
    legacy = m.legacy
    rate = history.rate(m.name) if history else None
    status = m.display_status
    return {
        "name": Text.assemble(("■ ", model_colour(m.name, names) if names else "grey50"),
                              (m.name, "bold" if status == "live" else "")),
        "status": status_cell(m),
        "mapped": mapped_cell(m),
        "limit": limit_cell(m),
        **policy_cells(m),
        "held": Text(format_bytes(m.held_bytes)),
        "reserved": Text(format_bytes(m.reserved_bytes)),
        "cached": Text(format_bytes(m.cached_bytes), style="magenta" if m.blocks_cached else ""),
        "waste": Text("-" if m.waste_ratio is None or legacy else f"{m.waste_ratio:.2f}×",
                      style=waste_style(None if legacy else m.waste_ratio)),
        "rate": Text("-" if rate is None else f"{format_bytes(rate)}/s", style="grey50" if not rate else ""),
        "spark": Text(sparkline(history.mapped(m.name)) if history else "", style="cyan"),
        **traffic_cells(m, history),
        "engine": Text(m.engine),
        "pid": Text(str(m.pid) if m.pid else "-"),
        "device": Text(fmt_device(m)),
    }


def rate_text(rate: float | None, unit: str = "") -> Text:
    if rate is None:
        return Text("-", style="grey50")
    text = f"{rate:.0f}" if rate >= 10 else f"{rate:.1f}"
    return Text(text + unit, style="" if rate else "grey50")


def idle_text(seconds: float | None) -> Text:
    if seconds is None:
        return Text("-", style="grey50")
    if seconds < 60:
        return Text(f"{seconds:.0f}s")
    return Text(f"{seconds / 60:.0f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h", style="grey50")


def traffic_cells(m: ModelSnapshot, history: History | None) -> dict[str, Text]:
    """The engine's traffic columns; '-' where it publishes none (the public kvcached, the demo)."""
    t = m.traffic
    if t is None:
        return {key: Text("-", style="grey50") for key in ("toks", "reqs", "waiting", "preempt", "idle", "tokspark")}
    reqs, toks = history.traffic_rates(m.name) if history else (None, None)
    return {
        "toks": rate_text(toks), "reqs": rate_text(reqs),
        "waiting": Text(str(t.waiting), style="bold yellow" if t.waiting else ""),
        "preempt": Text(str(t.preemptions), style="yellow" if t.preemptions else "grey50"),
        "idle": idle_text(t.idle_s),
        "tokspark": Text(sparkline([int(v) for v in history.tokens(m.name)]) if history else "", style="green"),
    }


# -- devices -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    label: str
    nbytes: int
    style: str
    glyph: str = "█"


@dataclass(frozen=True)
class DeviceBar:
    title: str
    total: int  # 0 when unknown
    parts: tuple[Part, ...]  # stacked from the left; what is left over is free
    # Free memory that KV growth leaves alone, after the parts: the working memory the engines registered and do not
    # hold yet, then the headroom (docs/cuda.md#headroom).
    kept: tuple[Part, ...] = ()

    @property
    def taken(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def free(self) -> int:
        """What KV could still grow into."""
        return max(0, self.total - self.taken - sum(p.nbytes for p in self.kept))


def _model_parts(models: Sequence[ModelSnapshot], names: Sequence[str],
                 device: int | None = None) -> tuple[list[Part], int]:
    parts, reserved = [], 0
    for m in sorted(models, key=lambda m: m.name):
        share = 1.0 if device is None else m.device_share(device)  # a tensor-parallel rank's part
        in_use = round(max(0, m.mapped_bytes - m.reserved_bytes) * share)
        reserved += round(m.reserved_bytes * share)
        if in_use:
            parts.append(Part(m.name, in_use, model_colour(m.name, names)))
    return parts, reserved


def device_bars(frame: Frame) -> list[DeviceBar]:
    """One bar per GPU; without one, a host-backend bar against the host capacity."""
    names = [m.name for m in frame.models]
    bars = []
    for gpu in frame.gpus:
        mine = [m for m in frame.models if m.backend != "host" and gpu.index in m.devices and m.status != "stale"]
        parts, reserved = _model_parts(mine, names, gpu.index)
        ours = sum(p.nbytes for p in parts) + reserved
        if reserved:
            parts.append(Part("reserved", reserved, RESERVED_STYLE, "▒"))
        if gpu.used_bytes is not None:
            others = max(0, gpu.used_bytes - ours)
            if others:
                parts.append(Part("others", others, OTHERS_STYLE))
        title = f"GPU {gpu.index}" + (f" {gpu.name}" if gpu.name else "")
        bars.append(DeviceBar(title, gpu.total_bytes or 0, tuple(parts), _kept_parts(mine, gpu.index)))
    if not frame.gpus:
        host = [m for m in frame.models if m.backend == "host" and m.status != "stale"]
        parts, reserved = _model_parts(host, names)
        if reserved:
            parts.append(Part("reserved", reserved, RESERVED_STYLE, "▒"))
        bars.append(DeviceBar("no NVIDIA GPU: host backend", frame.host_capacity, tuple(parts)))
    return bars


def _kept_parts(models: Sequence[ModelSnapshot], device: int) -> tuple[Part, ...]:
    """What a device's KV growth leaves free: the working memory its engines registered and do not hold yet, and the
    largest headroom its allocators keep (each keeps its own ``KVCACHED_DEVICE_HEADROOM``)."""
    working = sum(m.working_outstanding for m in models if m.device == device)
    headroom = max((m.device_headroom for m in models), default=0)
    kept = [Part("working", working, WORKING_STYLE, "░")] if working else []
    if headroom:
        kept.append(Part("headroom", headroom, HEADROOM_STYLE, "░"))
    return tuple(kept)


def bar_text(bar: DeviceBar, width: int) -> Text:
    """The stacked bar itself, ``width`` cells (cumulative rounding keeps it exact)."""
    text = Text()
    if width <= 0:
        return text
    total = max(bar.total, bar.taken, 1)
    done = acc = 0
    for part in (*bar.parts, *bar.kept):
        acc += part.nbytes
        end = min(width, round(acc / total * width))
        if end > done:
            text.append(part.glyph * (end - done), style=part.style)
            done = end
    text.append("·" * (width - done), style=FREE_STYLE)
    return text


def device_lines(bar: DeviceBar, width: int) -> list[Text]:
    """Two lines: title, bar and percentage; then the legend: what KV growth leaves free, what the bar holds."""
    share = percent(bar.taken, bar.total)
    pct = " capacity N/A" if share is None else f" {share:3.0f}% of {format_bytes(bar.total)}"
    title = Text(bar.title, style="bold")
    room = width - title.cell_len - len(pct) - 2
    line = title + Text(" ")
    if room >= 8:
        line += bar_text(bar, room) + Text(" ")
    line += Text(pct.strip(), style="bold")
    legend = Text()
    for part in bar.kept:  # first: the device's own figures, never cut off by a long list of models
        legend.append(f"{part.glyph} ", style=part.style)
        legend.append(f"{part.label} {format_bytes(part.nbytes)}  ")
    for part in bar.parts:
        legend.append("■ ", style=part.style)
        legend.append(f"{part.label} {format_bytes(part.nbytes)}  ")
    legend.append("■ ", style=FREE_STYLE)
    legend.append(f"free {format_bytes(bar.free) if bar.total else 'N/A'}")
    for t in (line, legend):
        t.no_wrap = True
        t.truncate(width, overflow="ellipsis")
    return [line, legend]


# -- selected model -------------------------------------------------------------------------------

def fit_per_cell(pages: int, cells: int) -> int:
    """The smallest power of two of pages per cell that fits ``pages`` into ``cells``."""
    per = 1
    while per * max(1, cells) < pages and per < MAX_PER_CELL:
        per *= 2
    return per


def legend_text() -> Text:
    """One short line: free, reserved, cached, then the occupancy ramp of in-use pages."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for state, label in (("free", "free"), ("reserved", "reserved"), ("cached", "cached")):
        text.append(GLYPHS[state], style=STATE_STYLES[state])
        text.append(f" {label} ")
    for state in ("low", "mid", "high", "full"):
        text.append(GLYPHS[state], style=STATE_STYLES[state])
    text.append(" in use: low→full")
    return text


def cells_text(cells: Sequence[Cell]) -> Text:
    text = Text(no_wrap=True)
    for cell in cells:
        text.append(GLYPHS[cell.state], style=STATE_STYLES[cell.state])
    return text


def evictable_pages(m: ModelSnapshot) -> int:
    """In-use pages whose used blocks are all cached (evicting them empties the page)."""
    return pagemap.evictable_pages(m.pages)


def frag_table(m: ModelSnapshot | None) -> Table | Text:
    """Fragmentation summary: held vs pinned, waste, packed floor, what trim and eviction return."""
    if m is None:
        return Text("no model selected", style="grey50")
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="grey70", no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    if m.legacy:
        grid.add_row("mapped", format_bytes(m.mapped_bytes))
        grid.add_row("reserved", format_bytes(m.reserved_bytes))
        grid.add_row("held", format_bytes(m.held_bytes))
        grid.add_row("limit", size(m.limit_bytes))
        if m.limit_status == "pending":
            grid.add_row("limit is", Text("pending (in use above it)", style="bold yellow"))
        grid.add_row(Text("upstream segment:", style="cyan"), "")
        grid.add_row(Text("no page map", style="cyan"), "")
        return grid
    f = fragmentation(replace(m, pages=None))  # counters only; the page walk is evictable_pages()
    grid.add_row("held", format_bytes(f.held_bytes))
    grid.add_row("pinned", format_bytes(f.pinned_bytes))
    waste = "-" if f.waste_ratio is None else f"{f.waste_ratio:.2f}×"
    grid.add_row("waste", Text(waste, style=waste_style(f.waste_ratio)))
    grid.add_row("floor", f"{f.packed_floor_pages:,} pages")
    grid.add_row("trim frees", Text(format_bytes(f.reclaimable_trim_bytes), style=RESERVED_STYLE))
    if m.pages is not None:
        grid.add_row("evict frees", Text(format_bytes(evictable_pages(m) * m.bundle_bytes), style="magenta"))
    if f.idle_returned_bytes:
        grid.add_row("idle returned", Text(format_bytes(f.idle_returned_bytes), style="green"))
    if m.sleep is not None and (m.sleep.state != "awake" or m.sleep.after_idle_s is not None):
        grid.add_row("sleep", Text(m.sleep.state, style=STATUS_STYLES.get(m.sleep.state, "")))
        if m.sleep.after_idle_s is not None:
            grid.add_row("after idle", f"{m.sleep.after_idle_s:g} s")
        if m.sleep.state == "asleep":
            grid.add_row("released", Text(format_bytes(m.sleep.slept_bytes), style="green"))
    c = f.compaction
    if c is not None and c.compactions and c.took_s is not None:
        grid.add_row("compacted", Text(f"{format_bytes(c.bytes_returned)} ({c.compactions}×)", style="green"))
        grid.add_row("copied", f"{format_bytes(c.bytes_copied)}, last {c.took_s * 1000:.1f} ms")
    if m.limit_status in ("deferred", "conflict"):
        grid.add_row("limit", Text(f"↓{size(m.requested_limit)}", style="bold yellow"))
        grid.add_row("limit is", Text(m.limit_status, style="bold yellow"))
    else:
        grid.add_row("limit", size(m.limit_bytes))
    _pressure_rows(grid, m)
    over = "-" if f.pinned_over_floor is None else f"{f.pinned_over_floor:.2f}×"
    grid.add_row("pinned÷floor", over)
    grid.add_row("page bundle", format_bytes(m.bundle_bytes))
    return grid


def _pressure_rows(grid: Table, m: ModelSnapshot) -> None:
    """The memory policy (min, priority) and, once there were any, the reclaim figures."""
    p = m.pressure
    if p is None:
        return
    grid.add_row("min", format_bytes(p.min_bytes) if p.min_bytes else "none")
    grid.add_row("priority", str(p.priority))
    if p.wanted_bytes and m.status == "live":
        grid.add_row(f"wants {PRESSURE_MARK}", Text(format_bytes(p.wanted_bytes), style="bold yellow"))
    if p.gave_count:
        grid.add_row("gave", f"{format_bytes(p.gave_total)} ({p.gave_count}×)")
    if p.took_count:
        grid.add_row("took", f"{format_bytes(p.took_total)} ({p.took_count}×)")
        grid.add_row("last reclaim", f"{p.latency_s * 1000:.0f} ms")
