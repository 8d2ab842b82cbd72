"""Control commands: ``kvctl limit`` and ``kvctl trim``, with the models' acknowledgements."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

import click

from kvcached_core import Ack, AckTimeout, ControlError, ModelSnapshot, request_limit, request_trim
from kvtop.cli import SIZE, ExitCode, Failure, SizeSpec, check_model_name, model_argument
from kvtop.cli.common import Number, emit_json, pick, read, warn
from kvtop.text import textfmt as T

WAIT_HELP = "Seconds to wait for each model's acknowledgement (0: do not wait)."
REFUSED = (ControlError, AckTimeout, OSError, ValueError)


def capacity_of(m: ModelSnapshot) -> int | None:
    """What a percentage is taken of (the core's ``limit_percent_base``); its note, when it has one, on stderr."""
    from kvcached_core.control import NoDeviceTotal, limit_percent_base

    try:
        total, note = limit_percent_base(m)
    except NoDeviceTotal as exc:
        raise ControlError(f"{m.name}: {exc}") from None
    if note:
        warn(f"{m.name}: a percentage {note}")
    return total


def ack_dict(ack: Ack, requested: int | None = None) -> dict:
    return {"name": ack.name, "kind": ack.kind, "status": ack.status, "revision": ack.revision,
            "requested_bytes": requested, "effective_limit": ack.effective_limit,
            "bytes_returned": ack.bytes_returned, "latency_s": round(ack.latency_s, 6), "in_use_bytes": ack.in_use,
            "superseded_by": ack.superseded_by or None}


def limit_text(ack: Ack) -> str:
    took = f"{ack.latency_s * 1000:.0f} ms"
    effective = T.fmt_bytes(ack.effective_limit)
    if ack.status == "applied":
        return f"{ack.name}: limit {effective} applied (revision {ack.revision}, {took})"
    if ack.status == "deferred":
        return (f"{ack.name}: limit {effective} deferred: more pages are in use than it allows; "
                f"it takes effect as they empty (revision {ack.revision}, {took})")
    if ack.status == "none":
        return f"{ack.name}: limit lifted (revision {ack.revision}, {took})"
    if ack.status == "legacy":
        text = f"{ack.name}: limit {effective} written (upstream kvcached segment: its watcher applies it, without acknowledging)"
        if ack.in_use is not None and ack.effective_limit is not None and ack.in_use > ack.effective_limit:
            text += (f"; pending: {T.fmt_bytes(ack.in_use)} is in use, so it applies only as pages free "
                     "(kvctl list shows it pending until then)")
        return text
    if ack.status == "superseded":
        now = "no limit" if ack.effective_limit is None else f"limit {effective} {ack.superseding_status}"
        return (f"{ack.name}: limit request (revision {ack.revision}) superseded by revision {ack.superseded_by} "
                f"from another controller, which holds now: {now}")
    if ack.status == "pending":
        what = "lift" if ack.effective_limit is None else f"{effective}"
        return f"{ack.name}: limit {what} requested (revision {ack.revision}), not waiting for the acknowledgement"
    return f"{ack.name}: limit {effective} {ack.status} (revision {ack.revision})"


def targets(model: str | None, all_models: bool, *, legacy: bool) -> list[ModelSnapshot]:
    """The models a control command acts on: one by name, or every live (and legacy) one."""
    if not all_models:
        assert model is not None
        return [pick(model, read())]
    kinds = {"live", "legacy"} if legacy else {"live"}
    found = [m for m in read().models if m.status in kinds]
    if not found:
        raise Failure("no live models to act on" + ("" if legacy else " (legacy segments cannot be trimmed)"))
    return found


class StillDeferred(Exception):
    """``--wait-applied`` ran out: the limit was acknowledged but is not applied yet."""

    def __init__(self, message: str, ack: Ack, requested: int | None):
        super().__init__(message)
        self.ack, self.requested = ack, requested


def run_all(models: list[ModelSnapshot], act: Callable[[ModelSnapshot], tuple[Ack, int | None]],
            as_json: bool, text: Callable[[Ack], str]) -> None:
    """Act on each model; report every answer; one stderr line per refusal or wait that ran out.

    Exit 1 when a model refused; else exit 3 (NOT_APPLIED) when a limit did not apply in time.
    """
    answers: list[dict] = []
    failed = late = 0
    for m in models:
        try:
            ack, requested = act(m)
        except StillDeferred as exc:
            late += 1
            click.echo(f"kvctl: {' '.join(str(exc).split())}", err=True)
            ack, requested = exc.ack, exc.requested
        except REFUSED as exc:
            failed += 1
            message = str(exc) or type(exc).__name__
            if len(models) == 1:
                raise Failure(message if m.name in message else f"{m.name}: {message}") from None
            click.echo(f"kvctl: {m.name}: {' '.join(message.split())}", err=True)
            continue
        if ack.status == "conflict":
            failed += 1
            click.echo(f"kvctl: {m.name}: the model answered conflict to revision {ack.revision}", err=True)
        if ack.status == "superseded":  # the request did not take: another controller's later one holds
            failed += 1
            click.echo(f"kvctl: {m.name}: revision {ack.revision} was superseded by revision {ack.superseded_by}",
                       err=True)
        if as_json:
            answers.append(ack_dict(ack, requested))
        else:
            click.echo(text(ack))
    if as_json:
        emit_json(answers)
    if failed:
        raise click.exceptions.Exit(ExitCode.FAILURE)
    if late:
        raise click.exceptions.Exit(ExitCode.NOT_APPLIED)


def wait_until_applied(ack: Ack, requested: int | None, timeout: float) -> Ack:
    """Wait for a deferred limit to apply (a live line on a terminal's stderr, nothing in a pipe)."""
    from kvcached_core.control import NotApplied, wait_applied

    started = time.monotonic()
    live = sys.stderr.isatty()

    def progress(m: ModelSnapshot, left: float) -> None:
        sys.stderr.write(f"\r{m.name}: {T.fmt_bytes(m.pinned_bytes)} in use, {T.fmt_bytes(m.mapped_bytes)} mapped, "
                         f"limit {T.fmt_bytes(ack.effective_limit)}: waiting for pages to empty, "
                         f"{left:.0f} s left\x1b[K")
        sys.stderr.flush()

    try:
        m = wait_applied(ack, timeout, progress=progress if live else None)
    except NotApplied as exc:
        m = exc.model
        raise StillDeferred(f"{m.name}: limit {T.fmt_bytes(ack.effective_limit)} not applied within {timeout:g} s: "
                            f"{T.fmt_bytes(m.pinned_bytes)} of pages still in use", ack, requested) from None
    finally:
        if live:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
    if m.legacy:  # upstream never acknowledges: the answer stays "written", with what is in use now
        return replace(ack, in_use=m.held_bytes, latency_s=ack.latency_s + time.monotonic() - started)
    return replace(ack, status=m.limit_status, effective_limit=m.limit_bytes,
                   latency_s=ack.latency_s + time.monotonic() - started)


def _looks_like_size(text: str) -> bool:
    from kvcached_core import SizeError, parse_size

    try:
        parse_size(text, percent_of=100, allow_none=True)
    except SizeError:
        return text.strip()[:1].isdigit()  # 4, 1.5: a size with its unit forgotten too
    return True


@click.command("limit", context_settings={"ignore_unknown_options": True})  # so -5G reaches SIZE
@model_argument(required=False)
@click.argument("size", required=False, metavar="SIZE")
@click.option("--all", "all_models", is_flag=True, help="Every live and legacy model; then give only SIZE.")
@click.option("--wait", type=Number(min=0), default=2.0, show_default=True, metavar="SEC", help=WAIT_HELP)
@click.option("--wait-applied", type=Number(min=0, min_open=True), metavar="SEC",
              help="Also wait up to SEC seconds until the limit is applied (the memory is back under it), "
                   "not only acknowledged; exit 3 if it is not.")
@click.option("--json", "as_json", is_flag=True, help="Print the acknowledgements as a JSON array.")
@click.pass_context
def limit_cmd(ctx: click.Context, model: str | None, size: str | None, all_models: bool, wait: float,
              wait_applied: float | None, as_json: bool) -> None:
    """Cap a model's mapped memory, live; SIZE none lifts the cap.

    SIZE is 512MiB, 4G (binary), 4GB (decimal), 1.5GiB, 30% (of the model's device memory;
    the host capacity on the host backend) or none. The model rounds the limit down to whole
    page bundles. Below what it has in use, the limit is "deferred": the model takes no new
    pages and the limit applies as pages empty. Works on upstream kvcached (legacy) segments too.

    --wait-applied SEC waits past the acknowledgement until the limit is applied, with a live
    line on a terminal (nothing extra in a pipe); the answer then says "applied". If SEC runs
    out first it prints the deferred answer and one stderr line, and exits 3.

    \b
    Examples:
      kvctl limit llama-3-8b 4GiB
      kvctl limit llama 30% --wait 5
      kvctl limit llama 2GiB --wait-applied 60 && echo "memory is back"
      kvctl limit --all none

    \b
    Exit codes:
      0  acknowledged (with --wait-applied: applied)
      1  refused, or not acknowledged within --wait
      2  usage error
      3  acknowledged, but not applied within --wait-applied
    """
    if all_models:
        if size is not None:
            raise click.UsageError("with --all give only SIZE", ctx)
        model, size = None, model
    if model is None and not all_models:
        raise click.UsageError("give MODEL and SIZE, or --all SIZE", ctx)
    if size is None:
        if model is not None and _looks_like_size(model):
            raise click.UsageError(f"{model!r} is a SIZE: give the MODEL first (kvctl limit MODEL {model}), "
                                   f"or --all {model}", ctx)
        raise click.UsageError("missing SIZE (e.g. 4GiB, 30% or none)", ctx)
    size_param = next(p for p in ctx.command.params if p.name == "size")
    spec: SizeSpec = SIZE.convert(size, size_param, ctx)
    if model is not None:
        check_model_name(model)

    def act(m: ModelSnapshot) -> tuple[Ack, int | None]:
        limit = spec.resolve(capacity_of(m) if spec.percent else None)
        if limit and m.status != "legacy" and limit < m.bundle_bytes:
            warn(f"{m.name}: {T.fmt_bytes(limit)} is less than one page bundle ({T.fmt_bytes(m.bundle_bytes)}): "
                 "the limit rounds down to 0 and the model can take no pages")
        ack = request_limit(m, limit, wait=wait)
        if wait_applied is not None and ack.status in ("deferred", "pending", "legacy"):
            ack = wait_until_applied(ack, limit, wait_applied)
        return ack, limit

    run_all(targets(model, all_models, legacy=True), act, as_json, limit_text)


@click.command("trim")
@model_argument(required=False)
@click.option("--all", "all_models", is_flag=True, help="Every live model (legacy segments cannot be trimmed).")
@click.option("--wait", type=Number(min=0), default=2.0, show_default=True, metavar="SEC", help=WAIT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the acknowledgements as a JSON array.")
@click.pass_context
def trim_cmd(ctx: click.Context, model: str | None, all_models: bool, wait: float, as_json: bool) -> None:
    """Unmap a model's reserved pages now and print the bytes it returned.

    A model with traffic maps pages again as it allocates (its warm pool refills within
    moments); to keep its memory down, set a limit (kvctl limit).

    \b
    Examples:
      kvctl trim llama-3-8b
      kvctl trim --all --json | jq 'map(.bytes_returned) | add'
    """
    if all_models == (model is not None):
        raise click.UsageError("give MODEL or --all (not both)", ctx)

    def act(m: ModelSnapshot) -> tuple[Ack, int | None]:
        return request_trim(m, wait=wait), None

    def text(ack: Ack) -> str:
        if ack.status == "pending":
            return f"{ack.name}: trim requested, not waiting for the acknowledgement"
        note = f"; {T.REFILL_NOTE}" if ack.bytes_returned else ""
        return f"{ack.name}: returned {T.fmt_bytes(ack.bytes_returned)} ({ack.bytes_returned} bytes){note}"

    run_all(targets(model, all_models, legacy=False), act, as_json, text)
