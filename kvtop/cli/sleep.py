"""``kvctl sleep`` and ``kvctl wake``: a model gives back its whole KV memory, and takes it again."""

from __future__ import annotations

import re

import click

from kvcached_core import ControlError, ModelNotFound, ModelSnapshot, resolve
from kvcached_core.control import AckTimeout
from kvtop.cli import Failure, check_model_name, model_argument
from kvtop.cli.common import Number, emit_json, read
from kvtop.text import textfmt as T

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
TIMEOUT_HELP = "The most seconds --wait waits (the older spelling of --wait SEC)."
WAIT_DEFAULT_S = 60.0  # what --wait alone waits at most, unless --timeout says otherwise


class WaitSeconds(Number):
    """``--wait SEC``, the seconds, as limit, trim and compact take them, or ``--wait`` alone (True: wait for
    --timeout's seconds). A word that is not a number after it is the model, as in the older ``kvctl sleep --wait
    MODEL``: kept in ``ctx.meta`` for :func:`_model_and_wait`."""

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float | bool:
        if value is True or value == "":
            return True
        if isinstance(value, str) and not re.match(r"^\s*[-+]?\.?\d", value) and ctx is not None:
            ctx.meta[_MODEL_AFTER_WAIT] = value
            return True
        return float(super().convert(value, param, ctx))


_MODEL_AFTER_WAIT = "kvctl.model_after_wait"


def wait_option(what: str):  # a click decorator
    """``--wait [SEC]``: seconds, as limit, trim and compact take them; alone, it waits --timeout's seconds."""
    return click.option("--wait", "wait", type=WaitSeconds(min=0), is_flag=False, flag_value="", default=None,
                        metavar="[SEC]", help=f"Wait until the model is {what}, at most SEC seconds "
                        f"(--wait alone: --timeout's, {WAIT_DEFAULT_S:g} by default).")


def _model_and_wait(ctx: click.Context, model: str | None, wait: float | bool | None,
                    timeout: float | None) -> tuple[str, bool, float]:
    """The model, whether to wait until done, and for how long at most: ``--wait SEC``, else ``--timeout``, else
    the default. ``kvctl sleep --wait MODEL`` (the older spelling) names the model after the option."""
    after_wait = ctx.meta.get(_MODEL_AFTER_WAIT)
    if after_wait is not None:
        if model is not None:
            raise click.BadParameter(f"takes seconds, not {after_wait!r}", ctx, param_hint="'--wait'")
        model = check_model_name(after_wait)
    if model is None:
        raise click.MissingParameter(ctx=ctx, param_type="argument", param_hint="'MODEL'")
    if wait is None:
        return model, False, timeout if timeout is not None else WAIT_DEFAULT_S
    if wait is True:  # --wait alone
        return model, True, timeout if timeout is not None else WAIT_DEFAULT_S
    if timeout is not None:
        raise click.UsageError("--wait SEC and --timeout SEC both say how long to wait: give one of them", ctx)
    return model, True, float(wait)


class DurationType(click.ParamType):
    """``250ms``, ``30s``, ``5m``, ``1h``, a plain number of seconds, or ``off``."""

    name = "duration"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float | None:
        text = str(value).strip().lower()
        if text == "off":
            return None
        match = _DURATION.match(text)
        if match is None:
            self.fail(f"{value!r} is not a duration (like 30s, 5m, 1h, or off)", param, ctx)
        seconds = float(match.group(1)) * _UNIT_S[match.group(2) or "s"]
        from kvcached_core.control import after_idle_ms

        try:
            after_idle_ms(seconds)  # one a model can hold, or a usage error now
        except ControlError as exc:
            self.fail(f"{value!r}: {exc}", param, ctx)
        return seconds


def _model(name: str) -> ModelSnapshot:
    try:
        return resolve(name, list(read().models))
    except ModelNotFound as exc:
        raise Failure(str(exc)) from None


def _answer(ack_dict: dict, text: str, as_json: bool) -> None:
    if as_json:
        emit_json(ack_dict)
    else:
        click.echo(text)


def _run(m: ModelSnapshot, action: str, after_idle: float | None | bool, wait: bool, timeout: float) -> dict:
    from kvcached_core.control import request_sleep

    try:
        ack = request_sleep(m, action, after_idle_s=after_idle, wait=timeout if wait else 2.0, until_done=wait)
    except (ControlError, AckTimeout, OSError) as exc:
        raise Failure(str(exc)) from None
    out = {"name": ack.name, "action": action, "state": ack.status, "revision": ack.revision,
           "slept_bytes": ack.bytes_returned, "took_s": round(ack.latency_s, 6)}
    if action == "policy":
        out["after_idle_s"] = ack.after_idle_s  # what the model holds now
    if ack.status == "superseded":
        out["superseded_by"] = ack.superseded_by
        out["state"] = ack.superseding_status
        out["superseded"] = True
    elif ack.status == "woken":  # it slept, then a request woke it
        out["state"] = "awake"
        out["woken"] = True
    return out


def _still_asleep(name: str, out: dict) -> None:
    """An ``asleep`` answer read once more just before it is printed, so kvctl never says asleep of a model that is
    awake again: one a request woke since (its acknowledged revision still ours) is marked woken, as when the
    model is read awake at once; one a later controller's request moved is marked superseded."""
    from kvcached_core import snapshot

    if out["state"] != "asleep" or out.get("superseded"):
        return
    try:
        info = snapshot(name, with_pages=False).sleep
    except (ModelNotFound, OSError, ValueError):
        return  # gone meanwhile: the answer stands as the model gave it
    if info is None or info.state == "asleep":
        return
    if info.acked_revision > out["revision"]:
        out.update(superseded=True, superseded_by=info.acked_revision, state=info.state)
    else:
        out.update(state="awake", woken=True)


def _already(m: ModelSnapshot, out: dict, state: str) -> bool:
    """Whether the request found the model ``state`` already and changed nothing (marks ``out``): it was so when
    read, no other controller's request was pending or came since (the model took ours as the next revision),
    and it answered with that state (asleep: with the same last sleep). A request is always written, so a
    later request wins over one another controller left pending."""
    before = m.sleep
    if before is None or before.state != state or out["state"] != state or out.get("superseded") or out.get("woken"):
        return False
    if out["revision"] != before.acked_revision + 1:
        return False
    if state == "asleep" and (out["slept_bytes"], out["took_s"]) != (before.slept_bytes, round(before.took_s, 6)):
        return False
    out["already"] = True
    return True


def _policy_text(name: str, out: dict) -> str:
    """The after-idle policy the model holds now, in the milliseconds it holds."""
    held = out["after_idle_s"]
    policy = "none" if held is None else f"sleep after {round(held * 1000)} ms ({held:g} s) without a request"
    if out.get("superseded"):
        return (f"{name}: a later request (revision {out['superseded_by']}) replaced this one; "
                f"the model's after-idle policy: {policy}")
    return f"{name}: after-idle policy removed" if held is None else f"{name}: after-idle policy set: {policy}"


@click.command("sleep")
@model_argument(required=False, metavar="MODEL")
@click.option("--now", is_flag=True, help="Preempt running requests instead of letting them finish (they run again after waking).")
@click.option("--after-idle", "after_idle", type=DurationType(), default=None, metavar="DURATION|off",
              help="Set the policy instead of sleeping now: sleep after this long without a request, "
                   "from 100ms to 8784h (366 days); off removes it.")
@wait_option("asleep (every page unmapped)")
@click.option("--timeout", type=Number(min=0), default=None, metavar="SEC", help=TIMEOUT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.pass_context
def sleep_cmd(ctx: click.Context, model: str | None, now: bool, after_idle: float | None, wait: float | bool | None,
              timeout: float | None, as_json: bool) -> None:
    """Put a model's KV cache to sleep (weights stay): every KV page is unmapped, its memory returned.

    New requests wait in the engine's own queue (none rejected, none lost); running requests
    finish first (--now preempts them, to be recomputed after waking); the prefix cache is
    dropped. Sleep applies to the KV cache only: the weights stay where they are. The first
    request after the sleep, or kvctl wake, wakes the model.

    \b
    Examples:
      kvctl sleep llama-3-8b --wait
      kvctl sleep llama-3-8b --wait 30
      kvctl sleep llama-3-8b --after-idle 5m
      kvctl sleep llama-3-8b --after-idle off
    """
    policy = ctx.get_parameter_source("after_idle") is not click.core.ParameterSource.DEFAULT
    name, until_done, seconds = _model_and_wait(ctx, model, wait, timeout)
    m = _model(name)
    if policy:
        if now:
            raise click.UsageError("--now sleeps at once; --after-idle sets a policy: give one of them", ctx)
        out = _run(m, "policy", after_idle, False, seconds)
        _answer(out, _policy_text(m.name, out), as_json)
        return
    out = _run(m, "sleep_now" if now else "sleep", False, until_done, seconds)
    _still_asleep(m.name, out)
    if _already(m, out, "asleep"):
        text = f"{m.name}: already asleep (nothing changed)"
    elif out.get("superseded"):
        text = f"{m.name}: a later request (revision {out['superseded_by']}) replaced this one; the model is {out['state']}"
    elif out["state"] == "asleep":
        text = f"{m.name}: asleep, released {T.fmt_bytes(out['slept_bytes'])} in {out['took_s'] * 1000:.1f} ms"
    elif out.get("woken"):
        text = (f"{m.name}: slept (released {T.fmt_bytes(out['slept_bytes'])} in {out['took_s'] * 1000:.1f} ms), "
                "then woken by a request")
    elif out["state"] == "awake":
        text = f"{m.name}: awake: a request woke it before it slept (nothing released)"
    elif out["state"] == "pending":
        text = _pending_text(m.name, "asleep")
    else:
        text = f"{m.name}: {out['state']} (running requests finish first; kvctl sleep --wait waits for it)"
    _answer(out, text, as_json)


def _pending_text(name: str, target: str) -> str:
    """The answer to ``--wait 0``: the request is written and the model has not taken it yet."""
    return f"{name}: pending: not {target} yet; --wait N waits up to N seconds"


@click.command("wake")
@model_argument(required=False, metavar="MODEL")
@wait_option("awake")
@click.option("--timeout", type=Number(min=0), default=None, metavar="SEC", help=TIMEOUT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.pass_context
def wake_cmd(ctx: click.Context, model: str | None, wait: float | bool | None, timeout: float | None,
             as_json: bool) -> None:
    """Wake a sleeping model: its engine schedules again and maps pages as requests need them.

    \b
    Examples:
      kvctl wake llama-3-8b --wait
      kvctl wake llama-3-8b --wait 30
    """
    name, until_done, seconds = _model_and_wait(ctx, model, wait, timeout)
    m = _model(name)
    out = _run(m, "wake", False, until_done, seconds)
    if _already(m, out, "awake"):
        text = f"{m.name}: already awake (nothing changed)"
    elif out.get("superseded"):
        text = f"{m.name}: a later request (revision {out['superseded_by']}) replaced this one; the model is {out['state']}"
    elif out["state"] == "pending":
        text = _pending_text(m.name, "awake")
    else:
        text = f"{m.name}: {out['state']}"
    _answer(out, text, as_json)
