"""Bad input, one table: each case exits with its documented code, writes exactly one stderr line and
no traceback, and leaves every file in the segment directory as it was.

Live segments change on their own (heartbeat, counters), so for them the bytes a controller could
write are compared: the header and the control block. Every other file is compared whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcached_core.backends.ledger import LOCK_NAME
from kvcached_core.segment import layout as L
from kvtop.cli import ExitCode, main

OK, FAILURE, USAGE = ExitCode.OK, ExitCode.FAILURE, ExitCode.USAGE
OTHER_UID = 4321
LEGACY = f"kvcached_vllm_{os.getpgrp()}"  # an upstream segment of a process group that exists: not stale


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    code: int
    says: str  # a fragment of the one stderr line
    needs: tuple[str, ...] = ("live",)


CASES = [
    Case("unknown-command", ("frobnicate",), USAGE, "No such command 'frobnicate' (see 'kvctl --help')"),
    Case("mistyped-command", ("lsit",), USAGE, "No such command 'lsit'; did you mean list"),
    Case("command-prefix", ("sl",), USAGE, "No such command 'sl'; did you mean sleep?"),
    Case("misspelled-command", ("wkae", "m1"), USAGE, "No such command 'wkae'; did you mean wake?"),
    Case("unknown-option", ("list", "--bogus"), USAGE, "No such option"),
    Case("missing-model", ("show",), USAGE, "Missing argument 'MODEL'"),
    Case("unknown-model", ("show", "nosuch"), FAILURE, "no model named 'nosuch' (known: m1)"),
    Case("unknown-model-frag", ("frag", "nosuch"), FAILURE, "no model named 'nosuch'"),
    Case("unknown-model-watch", ("watch", "--count", "1", "nosuch"), FAILURE, "no model named 'nosuch'"),
    Case("ambiguous-model", ("limit", "m", "1GiB"), FAILURE, "'m' is ambiguous: m1, m2", ("live", "stale")),
    Case("ambiguous-model-trim", ("trim", "m"), FAILURE, "ambiguous", ("live", "stale")),
    Case("negative-size", ("limit", "m1", "-5G"), USAGE, "cannot be negative"),
    Case("negative-size-all", ("limit", "--all", "-1MiB"), USAGE, "cannot be negative"),
    Case("malformed-size-unit", ("limit", "m1", "12parsecs"), USAGE, "unknown unit"),
    Case("malformed-size", ("limit", "m1", "1.2.3G"), USAGE, "is not a size"),
    Case("size-beyond-int64", ("limit", "m1", "8388608TiB"), USAGE, "beyond the largest size a segment holds"),
    Case("bytes-beyond-int64", ("limit", "m1", "9223372036854775808B"), USAGE, "beyond the largest size"),
    Case("size-word", ("limit", "m1", "lots"), USAGE, "'lots' is not a size"),
    Case("percent-150", ("limit", "m1", "150%"), USAGE, "at most 100"),
    Case("percent-0", ("limit", "m1", "0%"), USAGE, "above 0"),
    Case("missing-size", ("limit", "m1"), USAGE, "missing SIZE"),
    Case("bare-number", ("limit", "m1", "4"), USAGE, "4 what? 4GiB, 4MiB; 4B for bytes"),
    Case("bare-zero", ("limit", "m1", "0"), USAGE, "0 what? 0GiB, 0MiB; 0B for bytes"),
    Case("bare-fraction", ("limit", "m1", "1.5"), USAGE, "1.5 what? 1.5GiB, 1.5MiB"),
    Case("all-with-model", ("limit", "--all", "m1", "1G"), USAGE, "with --all give only SIZE"),
    Case("negative-wait", ("limit", "m1", "1G", "--wait", "-1"), USAGE, "--wait"),
    Case("wait-applied-0", ("limit", "m1", "1G", "--wait-applied", "0"), USAGE, "--wait-applied"),
    Case("trim-nothing", ("trim",), USAGE, "give MODEL or --all"),
    Case("trim-both", ("trim", "m1", "--all"), USAGE, "give MODEL or --all"),
    Case("interval-0", ("watch", "--interval", "0"), USAGE, "--interval"),
    Case("interval-negative", ("watch", "--interval", "-2"), USAGE, "--interval"),
    Case("count-minus-1", ("watch", "--count", "-1"), USAGE, "--count"),
    Case("count-0", ("watch", "--count", "0"), USAGE, "--count"),
    Case("bad-format", ("watch", "--format", "xml"), USAGE, "--format"),
    Case("gpu-negative", ("list", "--gpu", "-1"), USAGE, "--gpu"),
    Case("show-width-tiny", ("show", "m1", "--width", "2"), USAGE, "--width"),
    Case("demo-zero-models", ("demo", "--models", "0"), USAGE, "--models"),
    Case("demo-65-models", ("demo", "--models", "65"), USAGE, "--models"),
    Case("demo-duration-0", ("demo", "--duration", "0"), USAGE, "--duration"),
    Case("path-show", ("show", "../x"), USAGE, "'../x' is not a model name"),
    Case("path-limit", ("limit", "a/b", "1G"), USAGE, "'a/b' is not a model name"),
    Case("path-trim", ("trim", "../../etc/passwd"), USAGE, "is not a model name"),
    Case("path-frag", ("frag", "/dev/shm/kvc.m1"), USAGE, "is not a model name"),
    Case("path-watch", ("watch", "./m1"), USAGE, "is not a model name"),
    Case("dotdot", ("show", ".."), USAGE, "is not a model name"),
    Case("dot", ("show", "."), USAGE, "'.' is not a model name: it is a directory"),
    Case("empty-name", ("show", ""), USAGE, "'' is empty: give a model name or a unique prefix"),
    Case("blank-name", ("show", " "), USAGE, "' ' is blank: give a model name or a unique prefix"),
    Case("blank-inside", ("trim", "m 1"), USAGE, "names have no blanks or control characters"),
    Case("size-without-model", ("limit", "64MiB"), USAGE, "'64MiB' is a SIZE: give the MODEL first"),
    Case("garbage-show", ("show", "garbage"), FAILURE, "not a usable segment", ("live", "garbage")),
    Case("garbage-limit", ("limit", "garbage", "1G"), FAILURE, "not a usable segment", ("live", "garbage")),
    Case("garbage-list-all", ("list", "--all"), OK, "kvc.garbage", ("live", "garbage")),
    Case("garbage-list-all-json", ("list", "--all", "--json"), OK, "kvc.garbage", ("live", "garbage")),
    Case("foreign-list-all", ("list", "--all"), OK, "kvc.foreign: foreign", ("live", "foreign")),
    Case("foreign-legacy-size", ("list", "--all"), OK, "kvcached_sglang_9: foreign", ("live", "foreign-legacy")),
    Case("stale-limit", ("limit", "m2", "1G"), FAILURE, "stale", ("stale",)),
    Case("stale-trim", ("trim", "m2"), FAILURE, "stale", ("stale",)),
    Case("nothing-to-limit", ("limit", "--all", "1G"), FAILURE, "no live models", ("stale",)),
    Case("nothing-to-trim", ("trim", "--all"), FAILURE, "no live models", ("legacy",)),
    Case("legacy-trim", ("trim", LEGACY), FAILURE, "cannot be trimmed", ("legacy",)),
    Case("legacy-sleep", ("sleep", LEGACY), FAILURE, "upstream kvcached segment: it cannot sleep", ("legacy",)),
    Case("sleep-incapable", ("sleep", "m1"), FAILURE, "registered no sleep handler"),
    Case("wake-incapable", ("wake", "m1"), FAILURE, "registered no sleep handler"),
    Case("stale-sleep", ("sleep", "m2"), FAILURE, "stale", ("stale",)),
    Case("unknown-model-sleep", ("sleep", "nosuch"), FAILURE, "no model named 'nosuch'"),
    Case("sleep-bad-duration", ("sleep", "m1", "--after-idle", "soon"), USAGE, "not a duration"),
    Case("sleep-now-and-policy", ("sleep", "m1", "--now", "--after-idle", "5m"), USAGE, "give one of them"),
    Case("sleep-after-idle-zero", ("sleep", "m1", "--after-idle", "0"), USAGE, "below the shortest, 100ms"),
    Case("sleep-after-idle-rounds-to-zero", ("sleep", "m1", "--after-idle", "0.0001ms"), USAGE,
         "below the shortest, 100ms"),
    Case("sleep-after-idle-beyond-int64-ms", ("sleep", "m1", "--after-idle", "9223372036854775808ms"), USAGE,
         "beyond the longest, 8784h"),
    Case("sleep-after-idle-beyond-a-year", ("sleep", "m1", "--after-idle", "8785h"), USAGE, "beyond the longest"),
    Case("legacy-compact", ("compact", LEGACY), FAILURE, "upstream kvcached segment: it cannot be compacted",
         ("legacy",)),
    Case("compact-incapable", ("compact", "m1"), FAILURE, "registered no compact handler"),
    Case("stale-compact", ("compact", "m2"), FAILURE, "stale", ("stale",)),
    Case("unknown-model-compact", ("compact", "nosuch"), FAILURE, "no model named 'nosuch'"),
    Case("compact-bad-timeout", ("compact", "m1", "--timeout", "-1"), USAGE, "'-1' is out of range: it must be 0 or more"),
    Case("compact-bad-wait", ("compact", "m1", "--wait", "soon"), USAGE, "'soon' is not a number"),
    Case("sleep-timeout-nan", ("sleep", "m1", "--timeout", "nan"), USAGE, "'nan' is not a number"),
    Case("policy-wait-word", ("policy", "m1", "--priority", "1", "--wait", "soon"), USAGE, "'soon' is not a number"),
    Case("legacy-frag", ("frag", "kvcached"), FAILURE, "publishes no page map", ("legacy",)),
    Case("theirs-limit", ("limit", "theirs", "1G"), FAILURE, f"uid {OTHER_UID}", ("live", "theirs")),
    Case("theirs-trim", ("trim", "theirs"), FAILURE, f"uid {OTHER_UID}", ("theirs",)),
    Case("theirs-legacy-limit", ("limit", LEGACY, "1G"), FAILURE, f"uid {OTHER_UID}",
         ("theirs-legacy",)),
    Case("theirs-clean", ("clean",), OK, f"belongs to uid {OTHER_UID}", ("live", "theirs-stale")),
    # numbers read alike in every option: not click's "not a valid float range" / "not in the range x>0"
    Case("wait-applied-word", ("limit", "m1", "1G", "--wait-applied", "abc"), USAGE,
         "Invalid value for '--wait-applied': 'abc' is not a number (see 'kvctl limit --help')"),
    Case("wait-applied-nan", ("limit", "m1", "1G", "--wait-applied", "nan"), USAGE, "'nan' is not a number"),
    Case("wait-applied-0-words", ("limit", "m1", "1G", "--wait-applied", "0"), USAGE,
         "'0' is out of range: it must be above 0"),
    Case("interval-word", ("watch", "--interval", "soon"), USAGE, "'soon' is not a number"),
    Case("count-fraction", ("watch", "--count", "1.5"), USAGE, "'1.5' is not a whole number"),
    Case("demo-99-models", ("demo", "--models", "99"), USAGE, "'99' is out of range: it must be from 1 to 64"),
    Case("demo-seed-word", ("demo", "--seed", "x"), USAGE, "'x' is not a whole number"),
    Case("show-width-words", ("show", "m1", "--width", "2"), USAGE, "'2' is out of range: it must be from 8 to 512"),
]


def make(need: str, spawn_allocator, shm_dir: Path) -> str | None:
    """Create what a case needs; return the name of a live segment (compared header + control only)."""
    if need == "live":
        spawn_allocator("m1", script="b = m.alloc(6)")
        return "kvc.m1"
    if need in ("stale", "theirs-stale"):
        proc = spawn_allocator("m2" if need == "stale" else "gone")
        proc.kill()
        proc.wait()
        if need == "theirs-stale":
            os.chown(shm_dir / "kvc.gone", OTHER_UID, OTHER_UID)
        return None
    if need == "theirs":
        spawn_allocator("theirs")
        os.chown(shm_dir / "kvc.theirs", OTHER_UID, OTHER_UID)
        return "kvc.theirs"
    if need in ("legacy", "theirs-legacy"):
        path = shm_dir / LEGACY
        path.write_bytes(L.LEGACY.pack(0, 1 << 20, 1 << 19))
        if need == "theirs-legacy":
            os.chown(path, OTHER_UID, OTHER_UID)
        return None
    if need == "garbage":
        (shm_dir / "kvc.garbage").write_bytes(bytes(range(256)) * 16)
    elif need == "foreign":
        (shm_dir / "kvc.foreign").write_text("some other program's shared memory\n")
    elif need == "foreign-legacy":
        (shm_dir / "kvcached_sglang_9").write_bytes(b"0123456789")
    return None


def state(directory: Path, live: set[str]) -> dict[str, tuple]:
    out = {}
    for path in sorted(directory.iterdir()):
        if path.name == LOCK_NAME:
            continue  # exists only while an allocator claims capacity
        try:
            st = path.lstat()
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        out[path.name] = (st.st_mode, st.st_uid, data[:L.LIVENESS_OFF] if path.name in live else data)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, spawn_allocator, shm_dir: Path):
    if any(n.startswith("theirs") for n in case.needs) and os.getuid() != 0:
        pytest.skip("needs root to give a segment to another user (os.chown)")
    live = {name for need in case.needs if (name := make(need, spawn_allocator, shm_dir))}
    before = state(shm_dir, live)

    result = CliRunner().invoke(main, list(case.args))

    assert result.exit_code == case.code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and result.stderr.endswith("\n"), result.stderr
    assert case.says in lines[0]
    assert lines[0].startswith("kvctl")
    if case.code != OK:
        assert result.stdout == ""
    assert state(shm_dir, live) == before


KVTOP_CASES = [
    (("--interval", "abc"), "kvtop: Invalid value for '--interval': 'abc' is not a number (see 'kvtop --help')"),
    (("--interval", "100"), "kvtop: Invalid value for '--interval': '100' is out of range: it must be from 0.05 "
                            "to 60 (see 'kvtop --help')"),
    (("--demo-models", "0"), "kvtop: Invalid value for '--demo-models': '0' is out of range: it must be from 1 "
                             "to 6 (see 'kvtop --help')"),
    (("--gpu", "x"), "kvtop: Invalid value for --gpu: 'x' is not a list of GPU indices (try 0 or 0,2) "
                     "(see 'kvtop --help')"),
    (("--bogus",), "kvtop: No such option '--bogus'. Did you mean '--gpu'? (see 'kvtop --help')"),
]


@pytest.mark.parametrize("args, says", KVTOP_CASES, ids=[a[0] for a, _ in KVTOP_CASES])
def test_kvtop_usage_errors_read_like_kvctls(args: tuple[str, ...], says: str, shm_dir: Path) -> None:
    """kvtop's own options: one line, exit 2, the same words as kvctl's and where the options are."""
    before = state(shm_dir, set())
    done = subprocess.run([sys.executable, "-m", "kvtop.app", *args], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (USAGE, "", says + "\n")
    assert state(shm_dir, set()) == before
