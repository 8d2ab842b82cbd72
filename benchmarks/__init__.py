"""Benchmarks: every figure the project claims, from one command (``python -m benchmarks``).

Each module here (names starting with ``_`` are helpers) exposes ``run(quick: bool) ->
list[dict]`` with keys ``name``, ``value``, ``unit`` and ``note``, and may expose
``report(rows) -> str`` (extra markdown for BENCHMARKS.md). A module that needs a GPU sets
``REQUIRES = "gpu"`` or raises :class:`Skip` from ``run``; results recorded on a GPU machine
live in ``benchmarks/results/`` and are copied into BENCHMARKS.md as they are.
"""


class Skip(Exception):  # a benchmark that cannot run here, not an error
    """Raised by ``run`` when the benchmark cannot run on this machine; the message says why."""
