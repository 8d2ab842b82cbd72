"""kvctl watch: NDJSON, CSV and table ticks; a closed pipe and Ctrl-C end it quietly (real subprocesses)."""

from __future__ import annotations

import csv
import io
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, child_env, kvctl, send

from kvcached_core import list_models
from kvtop.cli.watch import CSV_FIELDS, POLICY_FIELDS, PRESSURE_FIELDS, SLEEP_FIELDS, TRAFFIC_FIELDS


def kvctl_command() -> list[str]:
    script = Path(sys.executable).parent / "kvctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtop.cli"]


def test_json_one_object_per_tick(spawn_allocator):
    proc = spawn_allocator("m1", script="b = m.alloc(5)")
    spawn_allocator("other")
    done = kvctl("watch", "--format", "json", "--count", "3", "--interval", "0.05", "m1")
    assert done.exit_code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3
    ticks = [json.loads(line) for line in lines]
    assert [t["tick"] for t in ticks] == [0, 1, 2]
    assert all(t["time"] > 1e9 for t in ticks) and ticks[0]["time"] <= ticks[2]["time"]
    assert [[m["name"] for m in t["models"]] for t in ticks] == [["m1"]] * 3
    assert ticks[0]["models"][0]["blocks_used"] == 5
    send(proc, "m.close()")  # the model goes away: it simply drops out
    gone = kvctl("watch", "--format", "json", "--count", "1", "m1")
    assert gone.exit_code == 1 and "no model named 'm1'" in gone.stderr


def test_csv_header_once_then_rows(spawn_allocator):
    spawn_allocator("a")
    spawn_allocator("b")
    done = kvctl("watch", "--format", "csv", "--count", "2", "--interval", "0.05")
    assert done.exit_code == 0, done.stderr
    rows = list(csv.reader(io.StringIO(done.stdout)))
    assert rows[0] == ["time", "tick", *CSV_FIELDS, *TRAFFIC_FIELDS, *(f"sleep_{k}" for k in SLEEP_FIELDS),
                       *POLICY_FIELDS, *PRESSURE_FIELDS]
    assert [(r[1], r[2]) for r in rows[1:]] == [("0", "a"), ("0", "b"), ("1", "a"), ("1", "b")]
    record = dict(zip(rows[0], rows[1], strict=True))
    assert record["status"] == "live" and record["limit_bytes"] == "" and int(record["pages_total"]) == 128
    assert record["min_bytes"] == "0" and record["priority"] == "0" and record["wanted_bytes"] == "0"


def test_csv_columns_are_the_scalar_list_keys(spawn_allocator):
    spawn_allocator("m1")
    keys = [k for k, v in list_models()[0].to_dict().items() if not isinstance(v, list) and k not in ("traffic", "sleep", "compaction", "policy", "pressure", "groups")]
    assert list(CSV_FIELDS) == keys
    row = list_models()[0].to_dict()
    assert list(POLICY_FIELDS) == list(row["policy"])
    assert set(PRESSURE_FIELDS) == {k for k, v in row["pressure"].items() if isinstance(v, int)}


def test_table_ticks(spawn_allocator):
    spawn_allocator("m1")
    done = kvctl("watch", "--count", "2", "--interval", "0.05")
    assert done.exit_code == 0
    blocks = done.stdout.split("\n\n")
    assert len(blocks) == 2
    for tick, block in enumerate(blocks):
        lines = block.strip().splitlines()
        assert lines[0].startswith("kvctl watch  every 0.05 s") and lines[0].endswith(f"tick {tick}")
        assert lines[1].split()[0] == "NAME" and lines[2].split()[:2] == ["m1", "custom"]


def test_closed_pipe_prints_one_line_and_no_traceback(spawn_allocator, procs):
    spawn_allocator("m1")
    line = shlex.join([*kvctl_command(), "watch", "--format", "json", "--interval", "0.05"]) + " | head -n 1"
    shell = procs.start(["sh", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=child_env(), cwd=ROOT)
    out, err = shell.communicate(timeout=60)
    assert shell.returncode == 0
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["models"][0]["name"] == "m1"


def test_closed_pipe_exit_status_is_0(spawn_allocator, procs):
    spawn_allocator("m1")
    proc = procs.start([*kvctl_command(), "watch", "--format", "csv", "--interval", "0.05"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), cwd=ROOT)
    assert proc.stdout.readline().startswith(b"time,tick,name")
    proc.stdout.close()  # the reader goes away
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


def test_ctrl_c_exits_130_quietly(spawn_allocator, procs):
    """Also when the test run itself ignores SIGINT (a background job): the child starts as from a terminal."""
    spawn_allocator("m1")
    proc = procs.start([*kvctl_command(), "watch", "--format", "json", "--interval", "0.05"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), cwd=ROOT)
    assert json.loads(proc.stdout.readline())["tick"] == 0
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err == b""
    assert all(json.loads(line)["tick"] > 0 for line in out.splitlines())  # whole lines only
