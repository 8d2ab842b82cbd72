"""A refused size suggests only what the same option then takes.

Every kvctl option or argument that takes a SIZE is given a word that is no size; each form its one error
line suggests (``(try 512MiB, 4G, ...)``) is then given to the same option, and none may be refused as a
usage error (exit 2). ``kvctl record --max-size abc`` suggested ``30%``, which it then refused ("a percentage of
nothing")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, kvctl

from kvcached_core import SizeError, parse_size

SUGGESTED = re.compile(r"is not a size \(try ([^)]*)\)")


def suggestions(stderr: str) -> list[str]:
    found = SUGGESTED.search(stderr)
    assert found, stderr
    *first, last = found.group(1).split(", ")
    return [*first, *last.split(" or ")]


def record(tmp_path: Path, size: str) -> subprocess.CompletedProcess[str]:
    """``kvctl record --max-size SIZE`` for a moment, in a child process (it sets signal handlers)."""
    return subprocess.run([sys.executable, "-m", "kvtop.cli", "record", "--out", str(tmp_path / "rec"),
                           "--interval", "50ms", "--duration", "100ms", "--no-gpus", "--max-size", size],
                          env=child_env(), capture_output=True, text=True, timeout=60)


def test_record_max_size_suggests_no_percentage_and_takes_each_suggestion(tmp_path: Path) -> None:
    bad = kvctl("record", "--out", str(tmp_path / "rec"), "--max-size", "abc")
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1, bad.stderr
    offered = suggestions(bad.stderr)
    assert "30%" not in offered and offered
    for size in offered:
        run = record(tmp_path, size)
        assert run.returncode == 0, (size, run.stderr)
    refused = kvctl("record", "--out", str(tmp_path / "rec"), "--max-size", "30%")
    assert refused.exit_code == 2 and "'30%': a percentage needs a known total" in refused.stderr
    assert refused.stderr.count("\n") == 1


@pytest.mark.parametrize("args", [("limit", "nosuch", "{}"), ("limit", "--all", "{}"), ("policy", "nosuch", "--min", "{}")],
                         ids=["limit", "limit-all", "policy-min"])
def test_sizes_that_take_a_percentage_suggest_it_and_take_each_suggestion(args: tuple[str, ...]) -> None:
    bad = kvctl(*(a.format("abc") for a in args))
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1, bad.stderr
    offered = suggestions(bad.stderr)
    assert offered == ["512MiB", "4G", "1.5GiB", "30%", "none"]
    for size in offered:  # taken: what follows is about the model (none here), never the size
        taken = kvctl(*(a.format(size) for a in args))
        assert taken.exit_code == 1, (size, taken.stderr)


@pytest.mark.parametrize(("kwargs", "offered"), [
    ({}, "512MiB, 4G or 1.5GiB"),
    ({"allow_none": True}, "512MiB, 4G, 1.5GiB or none"),
    ({"percent_of": 100}, "512MiB, 4G, 1.5GiB or 30%"),
    ({"percent_of": 100, "allow_none": True}, "512MiB, 4G, 1.5GiB, 30% or none"),
])
def test_parse_size_suggests_only_the_forms_it_accepts(kwargs: dict, offered: str) -> None:
    with pytest.raises(SizeError) as refused:
        parse_size("abc", **kwargs)
    assert str(refused.value) == f"'abc' is not a size (try {offered})"
    for form in re.split(r", | or ", offered):
        parse_size(form, **kwargs)  # each suggestion is taken
