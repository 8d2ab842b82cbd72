"""``kvctl route``: one OpenAI-compatible endpoint in front of every model on the host (:mod:`kvtop.serve.router`)."""

from __future__ import annotations

import ipaddress
import os
import signal
from typing import TYPE_CHECKING, Any

import click

from kvtop.cli import Failure
from kvtop.cli.common import Number

if TYPE_CHECKING:
    from kvtop.serve.router.directory import Directory

KEY_ENV = "KVCTL_ROUTE_API_KEY"


class ListenType(click.ParamType):
    """``HOST:PORT`` (``[::1]:8080`` for an IPv6 address; port 0 picks a free one)."""

    name = "host:port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or not port_text:
            self.fail(f"{value!r} is not HOST:PORT (like 127.0.0.1:8080, or [::1]:8080)", param, ctx)
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                self.fail(f"{value!r}: {host!r} in brackets is not an IPv6 address", param, ctx)
        elif ":" in host:
            self.fail(f"{value!r}: an IPv6 address goes in brackets ([{host}]:{port_text})", param, ctx)
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            self.fail(f"{value!r}: the port {port_text!r} is not a whole number from 0 to 65535", param, ctx)
        return host, int(port_text)


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a loopback address, or localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to may be reached from elsewhere


def api_key_of(given: str | None, path: str | None, no_auth: bool, host: str, from_env: str | None) -> str:
    """The key requests must carry ("" for none), from --api-key, --api-key-file or else the environment
    (``from_env``); a usage error for a key that cannot be one, two options, or a non-loopback address without a
    key or --no-auth."""
    if given is not None and path is not None:
        raise click.UsageError("give the key once: --api-key or --api-key-file, not both")
    key = given if given is not None or path is not None else from_env
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                key = fh.read(4097).strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise click.UsageError(f"--api-key-file {path}: {reason}") from None
    if key is not None:
        if no_auth:
            raise click.UsageError("--no-auth serves without a key: give it or a key, not both")
        if not key or len(key) > 4096 or any(ch.isspace() or not ch.isprintable() for ch in key):
            raise click.UsageError("the API key must be 1 to 4096 printable characters without blanks")
        return key
    if not loopback(host) and not no_auth:
        raise click.UsageError(f"listening on {host} serves other hosts: give a key ({KEY_ENV}=KEY, or "
                               "--api-key-file PATH) or say --no-auth")
    return ""


def startup_report(url: str, directory: Directory, keyed: bool) -> str:
    """What the router says once it listens: the URL, the models it skips with why, and those it serves (last)."""
    lines = [f"kvctl route: serving {url}/v1 (Ctrl-C stops){'; requests need the API key' if keyed else ''}"]
    lines.extend(f"  skipped: {s.name}: {s.why}" for s in directory.skipped)
    served = directory.serving()  # last: a reader of the report knows it is whole
    if served:
        lines.append("  serving: " + ", ".join(f"{e.model_id} ({e.state})" for e in served))
    else:
        lines.append("  serving: no model yet (models are found as their engines start)")
    return "\n".join(lines)


@click.command("route")
@click.option("--listen", type=ListenType(), default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Address to serve on (0.0.0.0:PORT or [::]:PORT for other hosts; port 0 picks a free one).")
@click.option("--rescan", type=Number(min=0.05, max=3600), default=1.0, show_default=True, metavar="SEC",
              help="Read the segments again this often (a name no model answers to rescans at once).")
@click.option("--wake-timeout", "wake_timeout", type=Number(min=0, min_open=True, max=86400), default=60.0,
              show_default=True, metavar="SEC",
              help="The longest a request waits for a sleeping model to wake before it is answered 503.")
@click.option("--max-in-flight", "max_in_flight", type=click.IntRange(min=0), default=0, show_default=True,
              metavar="N", help="At most N requests at a time to the engines of one device (0: no limit); the "
              "others wait, the model of highest `kvctl policy --priority` first.")
@click.option("--api-key", "api_key", metavar="KEY",
              help=f"Answer 401 to a request without 'Authorization: Bearer KEY' (also from {KEY_ENV}; a command "
              "line shows in ps, the environment or --api-key-file does not).")
@click.option("--api-key-file", "api_key_file", type=click.Path(dir_okay=False), metavar="PATH",
              help="Read the key from PATH (its first line).")
@click.option("--no-auth", "no_auth", is_flag=True,
              help="Serve a non-loopback address without a key (anyone who reaches the port may use every model).")
def route_cmd(listen: tuple[str, int], rescan: float, wake_timeout: float, max_in_flight: int,
              api_key: str | None, api_key_file: str | None, no_auth: bool) -> None:
    """Serve every model on this host behind one OpenAI-compatible endpoint.

    Each engine publishes the address it serves on in its segment (the vLLM plugin takes vLLM's
    --host/--port; other servers set KVCACHED_ENDPOINT), so models are found as they start and
    dropped as they stop, without a restart. A request goes to the engine serving its "model" (the
    id the engine lists, or the model's kvctl name):

    \b
      GET  /v1/models               every model served now, with its state: live, asleep, draining
      POST /v1/completions          passed to the model's engine, streamed (SSE) or not
      POST /v1/chat/completions     likewise (and any other POST /v1/... naming a model)
      GET  /kvcached/figures        requests, errors, in flight, TTFT and latency p50/p99 per model
      GET  /health                  200 "ok" once listening (needs no key)

    A model that is asleep is woken by the request, which waits for it (--wake-timeout). An unknown
    model is answered 404, one that publishes no serving address 404 with that reason, a model
    whose engine is gone or unreachable 503, each with an OpenAI-style error body saying why.

    With a key (--api-key, KVCTL_ROUTE_API_KEY or --api-key-file), a request without it is answered
    401 before any model is listed, woken or sent to; the client's Authorization header goes on to
    the engine unchanged, so engines started with their own key (vLLM's --api-key) take the same
    one. Listening on an address other hosts reach needs a key, or --no-auth.

    With --max-in-flight, a request beyond N waits at the router; a freed place goes to the model
    of highest policy priority, then to the request of lowest "priority" field (which goes on to
    the engine: vLLM's --scheduling-policy priority reads it), then to the earliest. Runs until
    Ctrl-C (exit 130) or SIGTERM (exit 0).

    \b
    Examples:
      kvctl route                               # http://127.0.0.1:8080/v1
      KVCTL_ROUTE_API_KEY=$(cat ~/.kvroute-key) kvctl route --listen 0.0.0.0:8000
      kvctl route --max-in-flight 64               # per device; the rest wait, by priority
      curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "llama-3-8b", "prompt": "Hello", "max_tokens": 16}'
    """
    from kvcached_core.settings import settings, shm_dir_problem

    problem = shm_dir_problem()
    if problem:
        raise Failure(problem)
    try:
        from kvtop.serve.router.proxy import serve
    except ImportError as exc:
        raise Failure(f"kvctl route needs aiohttp ({exc}): pip install 'aiohttp>=3.9'") from None
    host, port = listen
    key = api_key_of(api_key, api_key_file, no_auth, host, settings().route_api_key)

    def ready(url: str, directory: Directory) -> None:
        click.echo(startup_report(url, directory, bool(key)), err=True)

    try:
        stopped_by = serve(host, port, rescan_s=rescan, wake_timeout_s=wake_timeout, max_in_flight=max_in_flight,
                           api_key=key, ready=ready)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        raise Failure(f"cannot serve on {host}:{port}: {reason}") from None
    if stopped_by == signal.SIGINT:  # Ctrl-C ends it as it ends every kvctl command (exit 130); SIGTERM: exit 0
        raise KeyboardInterrupt
