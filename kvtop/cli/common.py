"""Helpers shared by kvctl commands (and kvtop's options): reading models, naming them, writing JSON and
warnings, numbers whose bad values are said in words."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

import click

from kvcached_core import SEGMENT_PREFIX, ModelNotFound, ModelSnapshot, Problem, Scan, resolve, scan
from kvtop.cli import Failure

SHOWN_BY_DEFAULT = frozenset({"live", "legacy"})


# -- numeric options: one wording for every bad number -----------------------------------------

def _range_words(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """``from 1 to 64``, ``above 0``, ``0 or more``: the range a number must be in."""
    if low is not None and high is not None:
        return f"from {low:g} to {high:g}" if not (low_open or high_open) else \
            f"{'above' if low_open else 'at least'} {low:g} and {'below' if high_open else 'at most'} {high:g}"
    if low is not None:
        return f"above {low:g}" if low_open else f"{low:g} or more"
    if high is not None:
        return f"below {high:g}" if high_open else f"{high:g} or less"
    return "of any size"


def _bad_number(value: Any, kind: type, noun: str, rng: click.FloatRange | click.IntRange) -> str:
    """Why ``value`` was refused, in the words the other options use."""
    try:
        kind(value)
    except (TypeError, ValueError):
        return f"{value!r} is not a {noun}"
    return f"{value!r} is out of range: it must be {_range_words(rng.min, rng.max, rng.min_open, rng.max_open)}"


class Number(click.FloatRange):
    """A number option: ``'abc' is not a number``, ``'0' is out of range: it must be above 0``
    (click's own words are ``not a valid float range`` and ``not in the range x>0``); ``nan`` is not a number."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            number = super().convert(value, param, ctx)
        except click.BadParameter:
            self.fail(_bad_number(value, float, "number", self), param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


class Whole(click.IntRange):
    """A whole-number option: ``'abc' is not a whole number``, ``'0' is out of range: it must be from 1 to 64``."""

    name = "whole number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            self.fail(_bad_number(value, int, "whole number", self), param, ctx)


def warn(message: str) -> None:
    """One warning line on stderr; never changes the exit code."""
    click.echo(f"kvctl: warning: {' '.join(message.split())}", err=True)


def problem_line(problem: Problem) -> str:
    return f"{problem.path}: {problem.status}: {problem.reason}"


def read(*, with_pages: bool = False, include_stale: bool = True, warn_problems: bool = False,
         gpu: int | None = None) -> Scan:
    """Scan the segment directory; optionally hide stale rows, filter one GPU, and warn about problem files.

    A directory that is missing or unreadable is a Failure (exit 1), not an empty fleet.
    """
    from kvcached_core.settings import shm_dir_problem

    bad_dir = shm_dir_problem()
    if bad_dir:
        raise Failure(bad_dir)
    found = scan(with_pages=with_pages)
    if warn_problems:
        for problem in found.problems:
            warn(problem_line(problem))
    models = tuple(m for m in found.models
                   if (include_stale or m.status in SHOWN_BY_DEFAULT) and (gpu is None or gpu in m.devices))
    return Scan(models, found.problems)


def pick(name: str, found: Scan) -> ModelSnapshot:
    """One model by exact name or unique prefix; Failure (exit 1) lists the candidates."""
    try:
        return resolve(name, list(found.models))
    except ModelNotFound as exc:
        for problem in found.problems:  # a damaged file of that very name explains better
            if os.path.basename(problem.path) in (SEGMENT_PREFIX + name, name):
                raise Failure(f"{name!r} is not a usable segment: {problem_line(problem)}") from None
        raise Failure(str(exc)) from None


def pick_many(names: Iterable[str], found: Scan) -> list[ModelSnapshot]:
    """Resolve several names, each once, keeping their order."""
    out: dict[str, ModelSnapshot] = {}
    for name in names:
        model = pick(name, found)
        out.setdefault(model.name, model)
    return list(out.values())


def emit_json(obj: Any, *, compact: bool = False) -> None:
    """JSON on stdout: indented for the read commands, one line for streams."""
    text = json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2)
    click.echo(text)
