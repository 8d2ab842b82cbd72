"""``kvctl clean``: remove your own segments whose processes are gone."""

from __future__ import annotations

import click

from kvcached_core.control import leftovers
from kvtop.cli import ExitCode
from kvtop.cli.common import read, warn
from kvtop.text import textfmt as T


def _router_pid(filename: str) -> int | None:
    from kvtop.serve.router.published import PREFIX

    pid_text = filename[len(PREFIX):].removesuffix(".tmp") if filename.startswith(PREFIX) else ""
    return int(pid_text) if pid_text.isdigit() else None


@click.command("clean")
@click.option("--dry-run", is_flag=True, help="Say what would be removed, remove nothing.")
def clean_cmd(dry_run: bool) -> None:
    """Remove stale segments of dead processes that belong to you, and say what was removed.

    Also removes your half-created segments, the hidden file an allocator builds before naming
    it, left behind when that process was killed mid-creation:

    \b
      .kvc-new.<name>.<pid>

    Also removes the figure files of your kvctl route processes that were killed (one that
    stops removes its own):

    \b
      .kvroute.<pid>

    Also removes your upstream kvcached segments (``kvcached_<engine>_<pgid>``) whose process
    group is gone or was reused after the file was last written.

    Never touches a live segment, a segment whose process still runs (even with a late
    heartbeat), a segment whose heartbeat is fresh (its process just ended: clean again later), another user's segment (one warning line each), an upstream segment whose
    name carries no process group (``KVCACHED_IPC_NAME``) or whose group may live in another
    pid namespace, or any file that is not a valid segment. Exit 0 also when there is
    nothing to clean.

    \b
    Examples:
      kvctl clean --dry-run
      kvctl clean
    """
    found = leftovers(read().models, owners=[(_router_pid, "kvctl route figures")])
    for line in found.kept:
        warn(line)
    failed = False
    for leftover in found.leftovers:
        what = f"{leftover.path} ({leftover.detail}, {T.fmt_bytes(leftover.stat.st_size)})"
        if dry_run:
            click.echo(f"would remove {what}")
            continue
        try:
            if not leftover.remove():
                continue  # replaced meanwhile: not ours to remove any more (left as it was)
        except OSError as exc:
            failed = True
            click.echo(f"kvctl: cannot remove {leftover.path}: {exc.strerror}", err=True)
            continue
        click.echo(f"removed {what}")
    if not found.leftovers:
        click.echo("nothing to clean")
    if failed:
        raise click.exceptions.Exit(ExitCode.FAILURE)
