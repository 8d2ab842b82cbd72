"""``kvctl policy``: a model's memory policy under pressure, ``min`` and ``priority``, set live."""

from __future__ import annotations

import click

from kvcached_core import Ack, ModelSnapshot
from kvcached_core.control import KEEP, PRIORITY_MAX, PRIORITY_MIN, request_policy
from kvtop.cli import SIZE, Failure, SizeSpec, model_argument
from kvtop.cli.common import Number, Whole, emit_json, pick, read
from kvtop.cli.control import REFUSED, ack_dict, capacity_of
from kvtop.text import textfmt as T

WAIT_HELP = "Seconds to wait for the model's acknowledgement (0: do not wait)."


def policy_text(ack: Ack, m: ModelSnapshot, min_bytes: int | None | object, priority: int | object) -> str:
    parts = []
    if min_bytes is not KEEP:
        parts.append(f"min {T.fmt_bytes(min_bytes) if min_bytes else 'none'}")  # type: ignore[arg-type]
    if priority is not KEEP:
        parts.append(f"priority {priority}")
    what = ", ".join(parts)
    took = f"{ack.latency_s * 1000:.0f} ms"
    if ack.status == "applied":
        return f"{ack.name}: policy {what} applied (revision {ack.revision}, {took})"
    if ack.status == "superseded":
        return (f"{ack.name}: policy request (revision {ack.revision}) superseded by revision {ack.superseded_by} "
                "from another controller")
    return f"{ack.name}: policy {what} requested (revision {ack.revision}), not waiting for the acknowledgement"


@click.command("policy")
@model_argument()
@click.option("--min", "min_size", type=SIZE, metavar="SIZE",
              help="Bytes never reclaimed from this model by another one's pressure (512MiB, 30%, none).")
@click.option("--priority", type=Whole(PRIORITY_MIN, PRIORITY_MAX), metavar="N",
              help=f"Who gives first when the device is short: lower gives first ({PRIORITY_MIN}..{PRIORITY_MAX}; "
                   "every model starts at 0 unless KVCACHED_PRIORITY says otherwise).")
@click.option("--wait", type=Number(min=0), default=2.0, show_default=True, metavar="SEC", help=WAIT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the acknowledgement as a JSON object.")
@click.pass_context
def policy_cmd(ctx: click.Context, model: str, min_size: SizeSpec | None, priority: int | None, wait: float,
               as_json: bool) -> None:
    """Set how a model shares its device's KV budget with the others, live.

    When a model's growth is refused by the device's budget (KVCACHED_DEVICE_BUDGET, or
    KVCACHED_HOST_CAPACITY on the host backend), it asks the other models on that device to give
    back memory: their reserved pages first, then whole pages of cached (prefix) blocks, never a
    block a request is using. --min is what is never taken from this model that way (memory.min
    of a cgroup); a limit (kvctl limit) stays the most it may hold. --priority orders the donors:
    the lowest gives first. Give either or both; the other stays as it is. Without options it
    prints the policy.

    \b
    Examples:
      kvctl policy llama --min 4GiB --priority 10   llama keeps 4 GiB and gives last
      kvctl policy batch-model --priority -5        this one gives first
      kvctl policy llama --min none                 no minimum
      kvctl policy llama --json                     the policy now, as JSON
    """
    m = pick(model, read())
    if min_size is None and priority is None:
        show(m, as_json)
        return
    min_bytes: int | None | object = KEEP
    if min_size is not None:
        min_bytes = min_size.resolve(capacity_of(m) if min_size.percent else None)
    try:
        ack = request_policy(m, min_bytes=min_bytes, priority=KEEP if priority is None else priority, wait=wait)
    except REFUSED as exc:
        message = " ".join((str(exc) or type(exc).__name__).split())
        raise Failure(message if m.name in message else f"{m.name}: {message}") from None
    if as_json:
        emit_json(ack_dict(ack))
    else:
        click.echo(policy_text(ack, m, min_bytes, KEEP if priority is None else priority))
    if ack.status == "superseded":
        raise click.exceptions.Exit(1)


def show(m: ModelSnapshot, as_json: bool) -> None:
    """The model's policy as it publishes it."""
    if m.pressure is None:
        raise Failure(f"{m.name} publishes no memory policy" + (" (an upstream kvcached segment)" if m.legacy else ""))
    if as_json:
        emit_json({"name": m.name, "policy": m.pressure.policy_dict()})
        return
    p = m.pressure
    click.echo(f"{m.name}: min {T.fmt_bytes(p.min_bytes) if p.min_bytes else 'none'}, priority {p.priority}")
