"""``kvctl demo``: simulated serving models on the host backend, to have something real to look at."""

from __future__ import annotations

import os
import signal
import time

import click

from kvtop.cli import Failure
from kvtop.cli.common import Number, Whole, read


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the fleet's cleanup below


@click.command("demo")
@click.option("--models", type=Whole(1, 64), default=3, show_default=True, metavar="N",
              help="How many simulated models.")
@click.option("--duration", type=Number(min=0, min_open=True), metavar="S",
              help="Stop after S seconds (default: run until Ctrl-C).")
@click.option("--seed", type=Whole(), default=0, show_default=True, metavar="N", help="Seed of the simulated traffic.")
def demo_cmd(models: int, duration: float | None, seed: int) -> None:
    """Start N simulated serving models, in child processes, with realistic traffic.

    Each model allocates real memory on the host backend: staggered prefill and
    one-block-at-a-time decode, requests ending at different moments, shared hot prefixes in
    the prefix cache, bursts and idle phases. Look at them with kvtop or kvctl in another
    terminal. Ctrl-C (exit 130) or the end of --duration (exit 0) stops every model and
    removes its segment.

    \b
    Examples:
      kvctl demo
      kvctl demo --models 6 --duration 60 --seed 7
    """
    from kvcached_core.settings import shm_dir_problem
    from kvtop.demo.fleet import DemoFleet

    problem = shm_dir_problem(writable=True)
    if problem:
        raise Failure(problem)
    fleet = DemoFleet(models, seed, duration)
    existing = {m.name: m for m in read().models}
    for name in fleet.names():
        m = existing.get(name)
        if m is not None and (m.status != "stale" or m.uid != os.getuid()):
            raise Failure(f"segment {name} already exists ({m.status}, pid {m.pid}): is a demo running already?")
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        fleet.start()
        if not fleet.wait_ready(timeout=30):
            raise Failure(fleet.failure or "the demo models did not start")
        click.echo(f"demo: {models} simulated model{'s' if models > 1 else ''} running: {', '.join(fleet.names())}")
        until = f"for {duration:g} s" if duration else "forever"
        click.echo(f"look at them with 'kvtop' or 'kvctl watch'; running {until}, Ctrl-C stops them")
        while fleet.alive():
            time.sleep(0.2)
    finally:
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        try:
            fleet.stop()
        finally:
            signal.signal(signal.SIGINT, interrupt)
            signal.signal(signal.SIGTERM, previous)
