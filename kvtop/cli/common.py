"""Helpers shared by kvctl commands: reading models, naming them, writing JSON and warnings."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import click

from kvcached_core import ModelNotFound, ModelSnapshot, Problem, Scan, resolve, scan
from kvcached_core.segment.names import SEGMENT_PREFIX
from kvtop.cli import Failure

SHOWN_BY_DEFAULT = frozenset({"live", "legacy"})


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
    from kvcached_core.config import shm_dir_problem

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
