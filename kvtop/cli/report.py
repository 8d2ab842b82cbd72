"""``kvctl report``: what each model of a recording did over a window (figures in kvtop/record/report.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from kvcached_core import ModelNotFound
from kvtop.cli import ExitCode, Failure, check_model_name
from kvtop.cli.common import emit_json, warn

JSON_HELP = "Print JSON (every key is documented in docs/json.md) instead of text."


class Unplottable(click.ClickException):
    """--plot without matplotlib: a usage error (exit 2), one line saying what to install."""

    exit_code = ExitCode.USAGE


class MomentType(click.ParamType):
    """A moment as typed (ISO, ``HH:MM``, ``-2h``, ``+30m``): checked now, placed once the recording is open."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from kvtop.record.report import moment_problem

        problem = moment_problem(str(value))
        if problem:
            self.fail(problem, param, ctx)
        return str(value).strip()


def _model_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else check_model_name(value)


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


@click.command("report")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--from", "start", type=MomentType(), metavar="TIME",
              help="Start of the window (default: the recording's start): 2026-12-06T03:10, 03:10 (that day of "
                   "the recording), -2h (before its end), +30m (after its start).")
@click.option("--to", "end", type=MomentType(), metavar="TIME", help="End of the window (default: the recording's "
              "end), as --from.")
@click.option("--model", callback=_model_option, metavar="NAME",
              help="Only this model: a name or a unique prefix of one, among the recording's models.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), metavar="OUT.png",
              help="Also draw mapped bytes per model over time, events marked, to OUT.png (the plot extra).")
def report_cmd(file: Path, start: str | None, end: str | None, model: str | None, as_json: bool,
               plot: Path | None) -> None:
    """Per model over a window of a recording (kvctl record): peak and mean mapped; each limit set (value, when,
    deferred for how long, applied when); trims (count, bytes); sleeps and wakes (count, time asleep, what woke
    it); reclaims given and taken (bytes, count, latency p50/p99); waste; requests waiting. A figure a model
    cannot have is n/a, with why.

    FILE is what kvctl record wrote. A damaged or half-written recording is reported as far as it reads,
    with one line on stderr naming what was skipped, and exit 1.

    \b
    Examples:
      kvctl report /var/lib/kvtop/recording --from 02:30 --to 03:30
      kvctl report rec --from -2h --model llama --json | jq '.models[0].taken'
      kvctl report rec --plot night.png
    """
    from kvtop.record.report import model_reports, moment, pick_model, with_events

    if plot is not None:
        from kvtop.record.report_plot import matplotlib_problem

        missing = matplotlib_problem()
        if missing:
            raise Unplottable(missing)
    from kvtop.record.reading import Recording, RecordingError

    try:
        recording = Recording.open(file)
    except RecordingError as exc:
        raise Failure(str(exc)) from None
    try:
        t0 = recording.start if start is None else moment(start, recording.start, recording.end)
        t1 = recording.end if end is None else moment(end, recording.start, recording.end)
        if t0 > t1:
            raise click.UsageError(f"the window is empty: --from ({_when(t0)}) is after --to ({_when(t1)})")
        if t1 < recording.start or t0 > recording.end:
            raise Failure(f"{file}: the window {_when(t0)} to {_when(t1)} is outside the recording "
                          f"({_when(recording.start)} to {_when(recording.end)})")
        names = list(recording.models())
        if model is not None:
            try:
                names = [pick_model(model, names)]
            except ModelNotFound as exc:
                raise Failure(str(exc)) from None
        reports = model_reports(names, recording.samples(t0, t1, set(names)), keep_series=plot is not None)
        reports = with_events(reports, recording.events(t0, t1))
        problems = list(recording.problems)
    finally:
        recording.close()
    if as_json:
        emit_json({"file": str(file), "recording_start": recording.start, "recording_end": recording.end,
                   "from": t0, "to": t1, "skipped": [str(p) for p in problems],
                   "models": [r.to_dict() for r in reports]})
    else:
        _print_table(reports, t0, t1)
    if plot is not None:
        from kvtop.record.report_plot import draw

        try:
            draw(reports, plot, f"{file.name}: {_when(t0)} to {_when(t1)}")
        except OSError as exc:
            raise Failure(f"{plot}: cannot write the plot: {exc.strerror or exc}") from None
    for problem in problems:
        warn(problem)
    if problems:
        raise click.exceptions.Exit(ExitCode.FAILURE)


def _print_table(reports: list, t0: float, t1: float) -> None:
    from kvtop.record.report_text import COLUMNS, LEGEND, duration, story_lines, table_rows
    from kvtop.text import textfmt as T

    title = f"{_when(t0)} to {_when(t1)} ({duration(t1 - t0)})"
    if not reports:
        click.echo(f"{title}: no samples")
        return
    T.print_table(COLUMNS, table_rows(reports), title=title)
    click.echo("\n".join(LEGEND))
    dated = time.localtime(t0)[:3] != time.localtime(t1)[:3]  # a window over midnight: dates with the times
    for report in reports:
        click.echo("\n" + "\n".join(story_lines(report, dated)))
