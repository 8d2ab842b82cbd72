"""``kvctl``: list, inspect, limit, trim and watch the models that kvcached_core allocators publish.

stdout carries data only; every error is one plain line on stderr; exit codes are
:class:`ExitCode`. Commands live in one module per family and are imported only when used,
so ``kvctl list --json`` costs little more than ``import click`` plus reading the segments.
This package must never import textual; rich is imported only to draw tables for a terminal.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import click

from .version import verbose_option, version_option

# Registering a command is one line here: "name": "module:attribute" of a click.Command.
# Modules are imported lazily (only the command that runs, or all of them for --help).
COMMANDS: dict[str, str] = {
    "list": "kvtop.cli.listing:list_cmd",
    "show": "kvtop.cli.listing:show_cmd",
    "frag": "kvtop.cli.listing:frag_cmd",
    "limit": "kvtop.cli.control:limit_cmd",
    "trim": "kvtop.cli.control:trim_cmd",
    "compact": "kvtop.cli.compact:compact_cmd",
    "policy": "kvtop.cli.policy:policy_cmd",
    "sleep": "kvtop.cli.sleep:sleep_cmd",
    "wake": "kvtop.cli.sleep:wake_cmd",
    "watch": "kvtop.cli.watch:watch_cmd",
    "clean": "kvtop.cli.clean:clean_cmd",
    "demo": "kvtop.cli.demo:demo_cmd",
    "export": "kvtop.cli.export:export_cmd",
    "route": "kvtop.cli.route:route_cmd",
    "record": "kvtop.cli.record:record_cmd",
    "report": "kvtop.cli.report:report_cmd",
}

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class ExitCode(enum.IntEnum):
    """Process exit codes of every kvctl command."""

    OK = 0
    FAILURE = 1  # unknown model, not acknowledged in time, refused, nothing to act on
    USAGE = 2  # bad arguments
    NOT_APPLIED = 3  # kvctl limit --wait-applied: acknowledged, but not applied in time
    INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report it


class Failure(click.ClickException):
    """A command that could not do its job: one line on stderr, exit 1."""

    exit_code = ExitCode.FAILURE


# -- sizes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class SizeSpec:
    """A size as typed: absolute bytes, a percentage (of a capacity known later), or none."""

    text: str
    value: int | None  # bytes; None lifts the limit; for a percentage, parts per 10**6
    percent: bool = False

    @property
    def is_none(self) -> bool:
        return self.value is None

    def resolve(self, capacity: int | None) -> int | None:
        """Bytes for this size; a percentage needs ``capacity`` (raises Failure when unknown)."""
        from kvcached_core import parse_size

        if not self.percent:
            return self.value
        if not capacity:
            raise Failure(f"{self.text!r} needs a known capacity, and this model's is unknown: give bytes instead")
        return parse_size(self.text, percent_of=capacity)


class SizeParamType(click.ParamType):
    """``512MiB``, ``4G``, ``1.5GiB`` and, when allowed, ``30%`` (of a capacity known later) and ``none``; bad input
    is a usage error, which suggests only what the option takes."""

    name = "size"

    def __init__(self, allow_none: bool = True, allow_percent: bool = True) -> None:
        self.allow_none = allow_none
        self.allow_percent = allow_percent

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> SizeSpec:
        if isinstance(value, SizeSpec):
            return value
        from kvcached_core import SizeError, parse_size

        text = str(value)
        try:  # a percentage is kept as parts per 10**6 until its capacity is known
            parsed = parse_size(text, percent_of=10**6 if self.allow_percent else None, allow_none=self.allow_none)
        except SizeError as exc:
            self.fail(str(exc), param, ctx)
        return SizeSpec(text.strip(), parsed, text.strip().endswith("%"))


SIZE = SizeParamType()


# -- model names ---------------------------------------------------------------------------

def check_model_name(name: str) -> str:
    """Refuse what no model can be called (a path, blanks, an empty string), saying why; a usage error."""
    if not name.strip():
        raise click.BadParameter(f"{name!r} is {'blank' if name else 'empty'}: give a model name or a unique "
                                 "prefix (kvctl list shows them)")
    if "/" in name:
        raise click.BadParameter(f"{name!r} is not a model name: names never contain '/'")
    if name in (".", ".."):
        raise click.BadParameter(f"{name!r} is not a model name: it is a directory")
    if any(ch.isspace() or not ch.isprintable() for ch in name):
        raise click.BadParameter(f"{name!r} is not a model name: names have no blanks or control characters")
    return name


def _model_callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(check_model_name(v) for v in value)
    return check_model_name(value)


def complete_models(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion: names of the models in the segment directory."""
    from click.shell_completion import CompletionItem

    from kvcached_core import scan

    try:
        models = scan().models
    except Exception:  # noqa: BLE001 - completion must never fail the shell
        return []
    return [CompletionItem(m.name, help=f"{m.engine} {m.status}") for m in models if m.name.startswith(incomplete)]


def model_argument(*decls: str, **kwargs: Any):  # a click decorator
    """A MODEL argument: name or unique prefix, path-like names refused, names completed."""
    kwargs.setdefault("metavar", "MODEL" if kwargs.get("required", True) else "[MODEL]")
    return click.argument(*(decls or ("model",)), callback=_model_callback, shell_complete=complete_models, **kwargs)


# -- the group -----------------------------------------------------------------------------

def _one_line(text: str) -> str:
    return " ".join(text.split())


def silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (e.g. under CliRunner)


def command_guesses(name: str) -> list[str]:
    """The commands a mistyped ``name`` may mean: those it begins (``li``: list), then the close spellings
    (``lsit``: list), at most three."""
    lowered = name.lower()
    guesses = [c for c in COMMANDS if lowered and c.startswith(lowered)]
    guesses += [c for c in difflib.get_close_matches(lowered, list(COMMANDS), n=3, cutoff=0.6) if c not in guesses]
    return guesses[:3]


class KvctlGroup(click.Group):
    """A group that imports its commands lazily and turns every error into one stderr line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, _, attribute = target.partition(":")
        command: click.Command = getattr(importlib.import_module(module_name), attribute)
        if command.help and "``" in command.help:  # docstrings mark literals the Python way; help shows them plain
            command.help = command.help.replace("``", "")
        return command

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        """As click's, but a name that is no command says which commands it may mean."""
        name = click.utils.make_str(args[0])
        if name in COMMANDS or name.startswith("-") or ctx.resilient_parsing:
            return super().resolve_command(ctx, args)
        guesses = command_guesses(name)
        hint = f"; did you mean {' or '.join(guesses)}?" if guesses else ""
        raise click.UsageError(f"No such command {name!r}{hint}", ctx)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # quiet: no "Aborted!", only a newline after the terminal's ^C
            if sys.stderr.isatty():
                click.echo(err=True)
            raise click.exceptions.Exit(ExitCode.INTERRUPTED) from None
        except BrokenPipeError:  # the reader went away (``kvctl watch | head -n 1``): a normal end
            silence_stdout()
            raise click.exceptions.Exit(ExitCode.OK) from None

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        code = self.run(args, prog_name or "kvctl", complete_var, **extra)
        if standalone_mode:
            sys.exit(code)
        return code

    def run(self, args: Any, prog_name: str, complete_var: str | None, **extra: Any) -> int:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help())
            return ExitCode.OK
        except click.UsageError as exc:
            path = exc.ctx.command_path if exc.ctx else prog_name
            hint = f" (see '{path} --help')" if exc.ctx else ""
            click.echo(f"{path}: {_one_line(exc.format_message())}{hint}", err=True)
            return ExitCode.USAGE
        except click.ClickException as exc:
            click.echo(f"{prog_name}: {_one_line(exc.format_message())}", err=True)
            return exc.exit_code
        except (click.Abort, KeyboardInterrupt):
            return ExitCode.INTERRUPTED
        except BrokenPipeError:
            silence_stdout()
            return ExitCode.OK
        except Exception as exc:  # a bug still ends in one line, unless debugging
            from kvcached_core.settings import settings

            if settings().kvctl_debug:
                raise
            click.echo(f"{prog_name}: internal error: {type(exc).__name__}: {_one_line(str(exc))} "
                       "(set KVCTL_DEBUG=1 for the traceback)", err=True)
            return ExitCode.FAILURE
        return rv if isinstance(rv, int) else ExitCode.OK


@click.group("kvctl", cls=KvctlGroup, context_settings=CONTEXT_SETTINGS, no_args_is_help=True)
@version_option
@verbose_option
def main() -> None:
    """Inspect and steer the KV-cache allocators (kvcached_core) running on this machine.

    \b
    Examples:
      kvctl list                   every running model, one row each
      kvctl show demo-llama        one model and its page map (name or unique prefix)
      kvctl limit demo-llama 64MiB cap a model's mapped memory, live
      kvctl trim --all             return every model's reserved pages now
      kvctl watch --format json    one JSON object per tick, for scripts
      kvctl demo                   simulated models to look at (Ctrl-C ends it)

    \b
    Exit codes: 0 ok, 1 failure, 2 usage error, 130 interrupted (Ctrl-C);
                3 kvctl limit --wait-applied: acknowledged, not applied in time.
    """


__all__ = ["COMMANDS", "ExitCode", "Failure", "SIZE", "SizeParamType", "SizeSpec", "check_model_name",
           "complete_models", "main", "model_argument", "silence_stdout"]
