"""The README's section on replay and report ("What happened at 3 a.m.?"): its commands are ones kvctl and kvtop
take as written, the keys it names are the replay's, and its screenshot is the replay's snapshot."""

from __future__ import annotations

import re

import click
from test_docs_readme import README, blocks, section

from kvtop.screen.actions import REPLAY, help_rows

TITLE = "What happened at 3 a.m.?"


def commands() -> list[list[str]]:
    (block,) = blocks(section(TITLE), "sh")
    return [line.split("#")[0].replace(" &", "").split() for line in block.strip().splitlines()]


def test_its_commands_are_taken_as_written() -> None:
    from kvtop.app import cli as kvtop_cli
    from kvtop.cli import main as kvctl_main

    argvs = commands()
    assert [argv[:2] for argv in argvs] == [["kvctl", "record"], ["kvtop", "--replay"], ["kvctl", "report"]]
    recording = {argv[argv.index("--out") + 1] if "--out" in argv else argv[2] for argv in argvs}
    assert len(recording) == 1, f"the three commands name one recording: {recording}"
    for prog, *args in argvs:
        if prog == "kvtop":
            kvtop_cli.make_context("kvtop", args)  # an option it lacks, or a bad value: click.UsageError
        else:
            command = kvctl_main.get_command(click.Context(kvctl_main), args[0])
            assert command is not None, args[0]
            command.make_context(args[0], args[1:])


def test_the_keys_it_names_are_the_replays() -> None:
    text = section(TITLE)
    keys = {k for row in help_rows(REPLAY) for k in row.key_text.split()}
    named = re.findall(r"\b(space|n / N|e): ", text) + ["n", "N"]
    for key in (k for name in named for k in name.split(" / ")):
        assert key in keys, f"the README names {key!r}, which a replay does not have"


def test_it_shows_the_replay_snapshot() -> None:
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section(TITLE))
    assert pictures == ["tests/__snapshots__/test_kvtop_replay/test_replay_screen.svg"]
    assert len(README.read_bytes()) <= 14 * 1024
