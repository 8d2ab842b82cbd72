"""``kvctl --version``; with ``--verbose``, which native paths this environment would use and why not."""

from __future__ import annotations

from typing import Any

import click

from kvcached_core import __version__

VERBOSE_KEY = "kvctl.verbose"


class _VersionOption(click.Option):
    """Sees every parsed option, so ``--verbose`` counts on either side of ``--version``."""

    def handle_parse_result(self, ctx: click.Context, opts: Any, args: list[str]) -> Any:
        ctx.meta[VERBOSE_KEY] = bool(opts.get("verbose"))
        return super().handle_parse_result(ctx, opts, args)


def _show(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"kvctl {__version__}")
    if ctx.meta.get(VERBOSE_KEY):
        from kvcached_core import native_report  # only here: plain kvctl never needs it

        for what, active, why in native_report():
            click.echo(f"{what}: {'active' if active else f'off ({why})'}")
    ctx.exit()


version_option = click.option("-V", "--version", cls=_VersionOption, is_flag=True, expose_value=False, is_eager=True,
                              callback=_show, help="Show the version and exit (with --verbose: the native paths).")
verbose_option = click.option("--verbose", is_flag=True, expose_value=False,
                              help="With --version: which native paths are active, and why not.")

__all__ = ["verbose_option", "version_option"]
