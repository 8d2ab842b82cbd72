"""``kvctl compact``: move a model's cached blocks out of sparse pages and return the pages emptied."""

from __future__ import annotations

import click

from kvcached_core import ControlError
from kvcached_core.control import AckTimeout
from kvtop.cli import Failure, model_argument
from kvtop.cli.common import Number, emit_json, pick, read
from kvtop.text import textfmt as T


@click.command("compact")
@model_argument()
@click.option("--wait", "--timeout", "wait", type=Number(min=0), default=10.0, show_default=True,
              metavar="SEC", help="Seconds to wait for the model's answer (0: do not wait), as limit and trim's "
                                  "--wait (--timeout: the same).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def compact_cmd(model: str, wait: float, as_json: bool) -> None:
    """Compact a model's prefix cache: its engine copies cached blocks into holes of denser pages, and the
    pages emptied are unmapped. Prints the bytes returned and the bytes copied by the compaction that
    answered this request (requests made together are answered by one compaction: each says so).

    Only cached blocks no running request holds move, and only out of pages that empty; the
    engine confirms each move before its source is freed. The model must be live and its engine
    able to compact (the vLLM plugin, through the scheduler's block copies; the transformers
    plugin's GreedyEngine with prefix_cache=True; see docs/engines.md).

    \b
    Examples:
      kvctl compact llama-3-8b
      kvctl compact llama-3-8b --json | jq .bytes_returned
    """
    from kvcached_core.control import request_compact

    m = pick(model, read())
    try:
        ack = request_compact(m, wait=wait)
    except (ControlError, AckTimeout, OSError) as exc:
        raise Failure(str(exc)) from None
    folded = ack.answered_range is not None and ack.answered_range != (ack.revision, ack.revision)
    if as_json:
        known = ack.status != "answered"
        emit_json({"name": ack.name, "status": ack.status, "revision": ack.revision,
                   "bytes_returned": ack.bytes_returned if known else None,
                   "bytes_copied": ack.bytes_copied if known else None,
                   "answered_with": list(ack.answered_range) if ack.answered_range else None,
                   "latency_s": round(ack.latency_s, 6)})
        return
    if ack.status == "pending":
        click.echo(f"{ack.name}: compaction requested, not waiting for the answer")
        return
    if ack.status == "answered":
        click.echo(f"{ack.name}: compaction request {ack.revision} was answered, but its figures are no longer "
                   f"recorded (more compactions answered since); returned and copied unknown")
        return
    line = (f"{ack.name}: returned {T.fmt_bytes(ack.bytes_returned)} ({ack.bytes_returned} bytes), "
            f"copied {T.fmt_bytes(ack.bytes_copied)} ({ack.bytes_copied} bytes) in {ack.latency_s * 1000:.0f} ms")
    if folded and ack.answered_range is not None:
        first, last = ack.answered_range
        line += f" (one compaction answered requests {first}-{last} together, this one included; figures are that compaction's)"
    click.echo(line)
