"""``kvctl export``: serve every model's figures as Prometheus metrics."""

from __future__ import annotations

import os
import signal
import threading

import click

from kvtop.cli import Failure
from kvtop.cli.common import Number, Whole


@click.command("export")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 or :: to let a Prometheus server on another host scrape).")
@click.option("--port", type=Whole(0, 65535), default=9400, show_default=True,
              help="TCP port (0 picks a free one and prints it).")
@click.option("--interval", type=Number(min=0, min_open=True), default=None, metavar="S",
              help="Read the segments every S seconds in the background and serve that copy "
                   "(default: read on every scrape).")
def export_cmd(host: str, port: int, interval: float | None) -> None:
    """Serve Prometheus metrics for every model on this host at http://HOST:PORT/metrics.

    Per model (labels model, engine, device, pid, host): mapped, held, pinned, reserved and
    cached bytes, limit and its status, waste ratio, pages by state, allocation and free
    rates, heartbeat age and staleness; per GPU: NVML memory. Models that go away drop out.
    Runs until Ctrl-C or SIGTERM.

    \b
    Examples:
      kvctl export                          # http://127.0.0.1:9400/metrics
      kvctl export --host 0.0.0.0 --interval 5
    """
    from kvcached_core.settings import shm_dir_problem
    from kvtop.serve.exporter import Exporter

    problem = shm_dir_problem()
    if problem:
        raise Failure(problem)
    try:
        exporter = Exporter(host, port, interval)
    except OSError as exc:
        # asyncio rewords a bind error around its strerror; name resolution errors have negative codes
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        raise Failure(f"cannot serve on {host}:{port}: {reason}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    click.echo(f"kvctl export: serving {exporter.url} (Ctrl-C stops)", err=True)
    try:
        stop.wait()
    finally:
        exporter.close()
