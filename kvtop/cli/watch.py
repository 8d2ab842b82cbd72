"""``kvctl watch``: the models every few seconds, as NDJSON, CSV or a refreshed table."""

from __future__ import annotations

import csv
import select
import sys
import time
from typing import TextIO

import click

from kvcached_core import ModelSnapshot
from kvtop.cli import model_argument
from kvtop.cli.common import Number, Whole, pick_many, read
from kvtop.text import textfmt as T

# CSV columns after time and tick: every scalar key of ModelSnapshot.to_dict(), in its order.
CSV_FIELDS = (
    "name", "model", "engine", "backend", "pid", "device", "status", "legacy", "late", "figures_age_s", "page_size",
    "bundle_bytes", "pages_total", "pages_inuse", "pages_reserved", "pages_free", "blocks_per_page", "blocks_used", "blocks_cached",
    "mapped_bytes", "held_bytes", "pinned_bytes", "reserved_bytes", "cached_bytes", "limit_bytes",
    "limit_status", "requested_limit", "limit_revision", "applied_revision", "waste_ratio", "alloc_count",
    "free_count", "trimmed_total", "idle_returned", "heartbeat_ns", "updated_ns", "tp_world", "device_capacity",
    "device_headroom", "working_peak_bytes", "working_now_bytes", "endpoint",
)
# Then the engine's traffic (the "traffic" object of to_dict), empty where the engine publishes none.
TRAFFIC_FIELDS = ("running", "waiting", "finished", "prompt_tokens", "generated_tokens", "preemptions", "idle_s")
# Then the sleep state and policy (the "sleep" object), prefixed; empty where unknown.
SLEEP_FIELDS = ("state", "after_idle_s", "slept_bytes")
# Then the memory policy (the "policy" object) and the reclaim figures (the "pressure" object's scalars).
POLICY_FIELDS = ("min_bytes", "priority")
PRESSURE_FIELDS = ("wanted_bytes", "gave_bytes", "gave_count", "took_bytes", "took_count", "asked_count")
CLEAR = "\x1b[H\x1b[2J"


class Printer:
    """Writes one tick in the chosen format and flushes it."""

    def __init__(self, fmt: str, interval: float) -> None:
        self.fmt, self.interval = fmt, interval
        self.out = sys.stdout
        self.tty = T.want_rich(self.out)
        self.csv = csv.writer(self.out, lineterminator="\n") if fmt == "csv" else None
        if self.csv is not None:
            self.csv.writerow(("time", "tick", *CSV_FIELDS, *TRAFFIC_FIELDS, *(f"sleep_{k}" for k in SLEEP_FIELDS),
                               *POLICY_FIELDS, *PRESSURE_FIELDS))

    def tick(self, tick: int, now: float, models: list[ModelSnapshot]) -> None:
        if self.fmt == "json":
            import json

            line = {"time": round(now, 3), "tick": tick, "models": [m.to_dict() for m in models]}
            self.out.write(json.dumps(line, separators=(",", ":")) + "\n")
        elif self.csv is not None:
            for m in models:
                row = m.to_dict()
                traffic = row["traffic"] or {}
                asleep = row["sleep"] or {}
                policy = row["policy"] or {}
                pressure = row["pressure"] or {}
                self.csv.writerow((f"{now:.3f}", tick, *("" if row[k] is None else row[k] for k in CSV_FIELDS),
                                   *("" if traffic.get(k) is None else traffic[k] for k in TRAFFIC_FIELDS),
                                   *("" if asleep.get(k) is None else asleep[k] for k in SLEEP_FIELDS),
                                   *("" if policy.get(k) is None else policy[k] for k in POLICY_FIELDS),
                                   *("" if pressure.get(k) is None else pressure[k] for k in PRESSURE_FIELDS)))
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
            title = f"kvctl watch  every {self.interval:g} s  {stamp}  tick {tick}"
            if self.tty:
                self.out.write(CLEAR)
            elif tick:
                self.out.write("\n")
            if models:
                T.print_table(T.LIST_COLUMNS, [T.list_row(m) for m in models], rich=self.tty, title=title)
            else:
                self.out.write(f"{title}\nno models\n")
        self.out.flush()


def reader_gone(out: TextIO, seconds: float) -> bool:
    """Sleep ``seconds``, waking at once when the reader of ``out`` (a pipe) goes away: True then.

    ``kvctl watch | head -n 1`` ends when head does, not an interval later at the next write.
    """
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (CliRunner): just sleep
        time.sleep(seconds)
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported: on a pipe, the reader closed it
    return bool(poller.poll(seconds * 1000))


@click.command("watch")
@model_argument("models", nargs=-1, metavar="[MODEL]...")
@click.option("--interval", "-i", type=Number(min=0, min_open=True), default=2.0, show_default=True,
              metavar="S", help="Seconds between ticks.")
@click.option("--count", "-n", type=Whole(min=1), metavar="N", help="Stop after N ticks (default: never).")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True,
              help="table: a refreshed table; json: one JSON object per line per tick; csv: a header, then rows.")
@click.option("--all", "show_all", is_flag=True, help="Also show stale segments.")
def watch_cmd(models: tuple[str, ...], interval: float, count: int | None, fmt: str, show_all: bool) -> None:
    """Print the models every S seconds, for a person or a script; every tick is flushed.

    MODEL names (or unique prefixes) restrict the output to those models; a model that goes
    away simply drops out. Ends after --count ticks (exit 0), on Ctrl-C (exit 130) or when the
    reader of a pipe goes away (exit 0, nothing on stderr).

    \b
    json: {"time": <epoch s>, "tick": <n>, "models": [<the objects of kvctl list --json>]}
    csv:  time,tick,<the scalar keys of kvctl list --json>; one row per model per tick

    \b
    Examples:
      kvctl watch
      kvctl watch --format json --interval 1 | jq -c '.models[] | [.name, .mapped_bytes]'
      kvctl watch llama --format csv --count 60 > llama.csv
    """
    names: set[str] | None = None
    if models:
        names = {m.name for m in pick_many(models, read())}
    printer = Printer(fmt, interval)
    start = time.monotonic()
    tick = 0
    while True:
        found = read(include_stale=show_all or names is not None)
        rows = [m for m in found.models if names is None or m.name in names]
        printer.tick(tick, time.time(), rows)
        tick += 1
        if count is not None and tick >= count:
            return
        delay = start + tick * interval - time.monotonic()
        if delay < 0:  # we fell behind (a suspended terminal): keep the cadence, skip the missed ticks
            start -= delay
            delay = 0
        if reader_gone(sys.stdout, delay):
            raise BrokenPipeError  # ends quietly with exit 0, as a failed write would
