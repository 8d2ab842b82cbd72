"""Next to the public kvcached: its segments built byte for byte as it writes them, each point of its use.

The public struct is three little-endian int64 (total, used, prealloc) in a 24-byte file that
its engines create mode 0666 and write under flock; its kvctl writes a limit into ``total``
by reading the 24 bytes and writing all three back. The helpers below do exactly that, with
nothing from this project, so every test reads what a real upstream engine leaves behind.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import child_env, kvctl, wait_for
from prometheus_client.parser import text_string_to_metric_families

import kvcached_core as kc
from kvcached_core.backends import nvml
from kvcached_core.interop.legacy import parse_name
from kvcached_core.segment.pgroups import GroupJudge
from kvtop.screen.view import model_cells
from kvtop.serve.exporter import Exporter

GiB = 1 << 30
MiB = 1 << 20
OTHER_UID = 4343
LIVE = os.getpgrp()  # this test's own process group: it exists and is older than any file written here


def struct_bytes(total: int, used: int, prealloc: int) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in (total, used, prealloc))


def upstream_segment(directory: Path, name: str, total: int, used: int = 0, prealloc: int = 0) -> Path:
    """Create a segment as an upstream engine does: O_CREAT 0666, sized to 24 bytes, written under flock."""
    path = directory / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.ftruncate(fd, 24)
        fcntl.flock(fd, fcntl.LOCK_EX)
        with mmap.mmap(fd, 24) as mm:
            mm[:] = struct_bytes(total, used, prealloc)
    finally:
        os.close(fd)  # releases the flock
    return path


def upstream_rewrite(path: Path, *, total: int | None = None, used: int | None = None,
                     prealloc: int | None = None) -> None:
    """Read the first 24 bytes and write all three fields back, changed, as upstream's kvctl and engines do."""
    with open(path, "r+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        with mmap.mmap(fh.fileno(), 24) as mm:
            old = [int.from_bytes(mm[i:i + 8], "little", signed=True) for i in (0, 8, 16)]
            new = [old[0] if total is None else total, old[1] if used is None else used,
                   old[2] if prealloc is None else prealloc]
            mm[:24] = struct_bytes(*new)


def fields(path: Path) -> tuple[int, ...]:
    raw = path.read_bytes()
    return tuple(int.from_bytes(raw[i:i + 8], "little", signed=True) for i in (0, 8, 16))


def rows() -> dict[str, kc.ModelSnapshot]:
    return {m.name: m for m in kc.list_models()}


def new_group() -> subprocess.Popen:
    """A process that leads a process group of its own (its pgid is its pid)."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def dead_group() -> int:
    proc = new_group()
    proc.kill()
    proc.wait()
    return proc.pid


# -- finding them ---------------------------------------------------------------------------

def test_segments_named_with_kvcached_ipc_name_are_found_by_their_struct(shm_dir):
    vllm = upstream_segment(shm_dir, "VLLM", 40 * GiB, 6 * GiB, 2 * GiB)  # the Docker images' names
    upstream_segment(shm_dir, "SGLANG", 30 * GiB, 0, 0)
    upstream_segment(shm_dir, "SGLANG_g1", 10 * GiB, GiB, 0)
    found = rows()
    assert set(found) == {"VLLM", "SGLANG", "SGLANG_g1"}
    assert (found["VLLM"].status, found["VLLM"].legacy, found["VLLM"].mapped_bytes) == ("legacy", True, 8 * GiB)
    listed = kvctl("list")
    assert listed.exit_code == 0 and "VLLM" in listed.stdout and "SGLANG_g1" in listed.stdout
    header, *lines = listed.stdout.splitlines()
    vllm_line = next(line for line in lines if line.startswith("VLLM "))
    assert vllm_line[:header.index("PID") + 3].split()[-1] == "-"  # its name carries no process group
    assert "pid -," in kvctl("show", "VLLM").stdout
    done = kvctl("limit", "VLLM", "20GiB")
    assert done.exit_code == 0, done.stderr
    assert "VLLM: limit 20.0 GiB written" in done.stdout
    assert fields(vllm) == (20 * GiB, 6 * GiB, 2 * GiB)


def test_files_that_merely_look_like_the_struct_are_never_taken_for_one(shm_dir):
    upstream_segment(shm_dir, "VLLM", 8 * GiB, GiB, 0)
    doubtful = {
        "ascii24": b"some other program: 24B\n",
        "negative": struct_bytes(8 * GiB, -1, 0),
        "huge": struct_bytes(1 << 62, 0, 0),
        "zero_total": struct_bytes(0, 0, 0),  # the public kvctl skips these too
        "random24": bytes.fromhex("9f3c1be07d52aa11c4e8f9a0b1d2e3f4a5b6c7d8e9fa0b1c"),
    }
    for name, data in doubtful.items():
        (shm_dir / name).write_bytes(data)
    (shm_dir / "kvcached_vLLM_1_g1").write_bytes(struct_bytes(GiB, -5, 0))  # upstream's name, not its figures
    (shm_dir / "other25").write_bytes(b"x" * 25)  # not the struct's size: not a candidate at all
    (shm_dir / "link24").symlink_to(shm_dir / "VLLM")  # never followed
    (shm_dir / ".hidden").write_bytes(struct_bytes(GiB, 0, 0))  # hidden names are never candidates
    found = kc.scan()
    assert [m.name for m in found.models] == ["VLLM"]
    problems = {Path(p.path).name: p for p in found.problems}
    assert set(problems) == set(doubtful) | {"kvcached_vLLM_1_g1"}
    assert {p.status for p in problems.values()} == {"foreign"}
    assert "not taken for one" in problems["negative"].reason and "used field -1" in problems["negative"].reason
    assert "total field is 0" in problems["zero_total"].reason
    plain = kvctl("list")
    assert plain.exit_code == 0 and plain.stderr == ""
    everything = kvctl("list", "--all")
    assert everything.exit_code == 0
    assert sorted(line.split(": ")[2].rsplit("/", 1)[1] for line in everything.stderr.splitlines()) == sorted(problems)
    for name in ("negative", "zero_total"):  # never steered or cleaned either
        refused = kvctl("limit", name, "1GiB")
        assert refused.exit_code == 1 and f"{name!r} is not a usable segment" in refused.stderr
    assert kvctl("clean").exit_code == 0
    assert {p.name for p in shm_dir.iterdir()} >= set(doubtful) | {"kvcached_vLLM_1_g1"}
    assert fields(shm_dir / "negative") == (8 * GiB, -1, 0)  # nothing was written anywhere
    assert fields(shm_dir / "zero_total") == (0, 0, 0)


def test_names_give_the_engine_and_the_process_group():
    assert parse_name("kvcached_proc_21579_g1") == ("proc", 21579)
    assert parse_name("kvcached_vLLM_4242_1") == ("vLLM", 4242)
    assert parse_name("kvcached_SGLang_77_3_g2") == ("SGLang", 77)
    assert parse_name("kvcached_vLLM_4242") == ("vLLM", 4242)
    assert parse_name("kvcached_mem_info") == ("kvcached", 0)  # an older default name: no group
    assert parse_name("VLLM") == ("kvcached", 0)
    assert parse_name("kvcached_vLLM_4242_x") == ("kvcached", 0)


def test_rows_show_the_engine_and_group_their_name_carries(shm_dir):
    upstream_segment(shm_dir, f"kvcached_proc_{LIVE}_g1", GiB)
    upstream_segment(shm_dir, f"kvcached_vLLM_{LIVE}_1", GiB)
    found = rows()
    assert (found[f"kvcached_proc_{LIVE}_g1"].engine, found[f"kvcached_proc_{LIVE}_g1"].pid) == ("proc", LIVE)
    assert (found[f"kvcached_vLLM_{LIVE}_1"].engine, found[f"kvcached_vLLM_{LIVE}_1"].pid) == ("vLLM", LIVE)


# -- only what they publish -----------------------------------------------------------------

def test_waste_is_unknown_and_no_trim_figures_are_invented(shm_dir):
    name = f"kvcached_vLLM_{LIVE}"
    upstream_segment(shm_dir, name, 8 * GiB, 3 * GiB, GiB)
    row = kc.snapshot(name)
    assert (row.waste_ratio, row.cached_bytes) == (None, None)  # upstream publishes no block counts
    header, line = kvctl("list").stdout.splitlines()[:2]
    for column in ("WASTE", "CACHED"):
        assert line[:header.index(column) + len(column)].split()[-1] == "-"  # right-aligned columns
    listed = json.loads(kvctl("list", "--json").stdout)[0]
    assert (listed["waste_ratio"], listed["cached_bytes"]) == (None, None)
    csv_header, csv_row = kvctl("watch", "--format", "csv", "--count", "1").stdout.splitlines()
    assert dict(zip(csv_header.split(","), csv_row.split(","), strict=True))["cached_bytes"] == ""
    shown = json.loads(kvctl("show", name, "--json").stdout)
    assert (shown["fragmentation"], shown["pages"], shown["legacy"]) == (None, [], True)
    with Exporter("127.0.0.1", 0) as exporter, urllib.request.urlopen(exporter.url, timeout=10) as response:
        text = response.read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.labels.get("model") == name]
    names = {s.name for s in samples}
    assert "kvcached_mapped_bytes" in names and "kvcached_waste_ratio" not in names
    assert "kvcached_cached_bytes" not in names
    status = {s.labels["status"]: s.value for s in samples if s.name == "kvcached_limit_status"}
    assert status["written"] == 1 and status["applied"] == 0


def test_a_limit_below_what_is_in_use_is_pending_never_applied(shm_dir):
    name = f"kvcached_vLLM_{LIVE}"
    path = upstream_segment(shm_dir, name, 8 * GiB, 3 * GiB, GiB)
    done = kvctl("limit", name, "1GiB")
    assert done.exit_code == 0, done.stderr
    assert "1.0 GiB written" in done.stdout and "pending: 3.0 GiB is in use" in done.stdout
    assert "applied" not in done.stdout
    assert json.loads(kvctl("limit", name, "1GiB", "--json").stdout)[0]["in_use_bytes"] == 3 * GiB
    assert fields(path) == (GiB, 3 * GiB, GiB)
    row = json.loads(kvctl("list", "--json").stdout)[0]
    assert (row["limit_bytes"], row["limit_status"], row["held_bytes"]) == (GiB, "pending", 3 * GiB)
    assert "1.0 GiB pending" in kvctl("list").stdout
    assert "3.0 GiB in use: the engine applies it only as pages free" in kvctl("show", name).stdout
    assert model_cells(kc.snapshot(name))["limit"].plain == "↓1.0 GiB"  # kvtop marks it as waiting
    upstream_rewrite(path, used=GiB // 2, prealloc=0)  # the engine freed pages and shrank
    assert kc.snapshot(name).limit_status == "written"
    assert "applied" not in kvctl("list").stdout


def test_wait_applied_on_an_upstream_segment_waits_until_its_memory_is_under_the_limit(shm_dir):
    name = f"kvcached_vLLM_{LIVE}"
    path = upstream_segment(shm_dir, name, 8 * GiB, 3 * GiB, GiB)
    quick = kvctl("limit", name, "2GiB", "--wait-applied", "0.2")  # nothing frees a page: it runs out
    assert quick.exit_code == 3 and "not applied within 0.2 s" in quick.stderr
    engine = threading.Timer(0.3, upstream_rewrite, (path,), {"used": GiB, "prealloc": GiB // 2})
    engine.start()  # the engine frees pages and drops its pool under the limit
    try:
        done = kvctl("limit", name, "2GiB", "--wait-applied", "30")
    finally:
        engine.join()
    assert done.exit_code == 0, done.stderr
    assert fields(path) == (2 * GiB, GiB, GiB // 2)
    assert "applied" not in done.stdout and "pending" not in done.stdout
    assert f"{name}: limit 2.0 GiB written" in done.stdout


@pytest.mark.parametrize("size", ["0B", "0GiB", "0%"])
def test_a_limit_of_zero_is_refused_like_none(shm_dir, size):
    name = f"kvcached_vLLM_{LIVE}"
    path = upstream_segment(shm_dir, name, 8 * GiB, GiB, 0)
    done = kvctl("limit", name, size)
    assert done.exit_code in (1, 2) and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert fields(path) == (8 * GiB, GiB, 0)
    with pytest.raises(kc.ControlError, match="a limit of 0 would empty its KV cache"):
        kc.request_limit(name, 0)
    assert fields(path) == (8 * GiB, GiB, 0)


def test_a_percentage_is_of_device_0_by_nvml_and_says_so(shm_dir):
    """With NVML (a GPU host): 30% of device 0's memory, said in one line. Without: refused, saying why."""
    name = f"kvcached_vLLM_{LIVE}"
    path = upstream_segment(shm_dir, name, 8 * GiB, GiB, 0)
    gpus = nvml.probe([0])
    done = kvctl("limit", name, "30%")
    assert done.stderr.count("\n") == 1
    if gpus and gpus[0].total_bytes:
        assert done.exit_code == 0, done.stderr
        assert "device 0's" in done.stderr and "device 0 is assumed" in done.stderr
        assert abs(fields(path)[0] - gpus[0].total_bytes * 0.3) <= 1
        assert fields(path)[1:] == (GiB, 0)
    else:
        assert done.exit_code == 1 and done.stdout == ""
        assert "a percentage needs the device's memory total, and NVML cannot tell it" in done.stderr
        assert nvml.unavailable_reason() in done.stderr
        assert fields(path) == (8 * GiB, GiB, 0)


def test_kvtops_limit_dialog_takes_a_percentage_of_device_0_by_nvml(shm_dir):
    """As kvctl does: 30% of device 0's NVML total, the dialog saying so; without NVML refused, saying why."""
    from test_operator_first_hour import drive, until

    from kvtop.frames.source import LiveSource
    from kvtop.screen.dashboard import KvtopApp
    from kvtop.screen.widgets import LimitScreen

    name = f"kvcached_vLLM_{LIVE}"
    path = upstream_segment(shm_dir, name, 8 * GiB, GiB, 0)
    gpus = nvml.probe([0])
    total = gpus[0].total_bytes if gpus else None
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot):
        await until(pilot, lambda: app.frame and app.frame.model(name), "the upstream row on screen")
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LimitScreen), "the limit dialog")
        detail = " ".join(str(app.screen.query_one("#detail").render()).split())
        await pilot.press(*"30%", "enter")
        await pilot.pause(0.2)
        if total:
            assert "of device 0's" in detail and "device 0 is assumed" in detail, detail
            await until(pilot, lambda: fields(path)[0] != 8 * GiB, "the limit written")
        else:
            assert isinstance(app.screen, LimitScreen), "a percentage was taken of nothing"
            error = " ".join(str(app.screen.query_one("#error").render()).split())
            assert "a percentage needs the device's memory total, and NVML cannot tell it" in error, error
            assert nvml.unavailable_reason() in error
            await pilot.press("escape")

    drive(app, script)
    if total:
        assert abs(fields(path)[0] - total * 0.3) <= 1 and fields(path)[1:] == (GiB, 0)
    else:
        assert fields(path) == (8 * GiB, GiB, 0)


def test_kvtops_limit_dialog_refuses_none_and_0_and_says_pending(shm_dir):
    """As kvctl: no 'no limit' and no 0 for an upstream segment (said under the input as it is typed, nothing written);
    a limit below what is in use is previewed as pending, never applied."""
    from test_operator_first_hour import drive, until

    from kvtop.frames.source import LiveSource
    from kvtop.screen.dashboard import KvtopApp
    from kvtop.screen.widgets import LimitScreen

    name = f"kvcached_vLLM_{LIVE}"
    path = upstream_segment(shm_dir, name, 8 * GiB, 3 * GiB, GiB)
    app = KvtopApp(LiveSource(), interval=0.2)

    def said(widget: str) -> str:
        return " ".join(str(app.screen.query_one(widget).render()).split())

    async def script(pilot):
        await until(pilot, lambda: app.frame and app.frame.model(name), "the upstream row on screen")
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LimitScreen), "the limit dialog")
        for typed, refusal in (("none", "which has no 'no limit'"), ("0B", "a limit of 0 would empty its KV cache")):
            await pilot.press(*typed)
            await pilot.pause(0.1)
            assert refusal in said("#error") and not said("#preview"), said("#preview")  # said as it is typed
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert isinstance(app.screen, LimitScreen), f"{typed} was accepted"
            assert refusal in said("#error"), said("#error")
            await pilot.press(*["backspace"] * len(typed))
        await pilot.press(*"1GiB")
        await pilot.pause(0.1)
        assert "below the 3.0 GiB in use: pending until the engine frees pages" in said("#preview"), said("#preview")
        await pilot.press("enter")
        await until(pilot, lambda: fields(path)[0] == GiB, "the limit written")
        pending = "limit 1.0 GiB written to the upstream total field; pending: 3.0 GiB is in use"
        await until(pilot, lambda: any(pending in line for line in app.event_log.lines_text), "the event log")
        assert not any("applied" in line for line in app.event_log.lines_text)

    drive(app, script)
    assert fields(path) == (GiB, 3 * GiB, GiB)
    assert kc.snapshot(name).limit_status == "pending"


# -- liveness and cleaning ------------------------------------------------------------------

def test_dead_or_reused_process_groups_are_stale_and_clean_removes_them(shm_dir):
    gone = upstream_segment(shm_dir, f"kvcached_vLLM_{dead_group()}", 8 * GiB, GiB, 0)
    newer = new_group()  # a group that exists, but was created after its file was last written
    try:
        reused = upstream_segment(shm_dir, f"kvcached_SGLang_{newer.pid}_g1", 8 * GiB, 0, 0)
        past = time.time_ns() - 60 * 10**9
        os.utime(reused, ns=(past, past))
        live = upstream_segment(shm_dir, f"kvcached_vLLM_{LIVE}", 8 * GiB, GiB, 0)
        named = upstream_segment(shm_dir, "VLLM", 8 * GiB, 0, 0)  # no group in its name: liveness unknown
        found = rows()
        assert {n: (m.status, m.limit_status) for n, m in found.items()} == {
            gone.name: ("stale", "stale"), reused.name: ("stale", "stale"),
            live.name: ("legacy", "written"), named.name: ("legacy", "written")}
        assert {r["name"] for r in json.loads(kvctl("list", "--json").stdout)} == {live.name, named.name}
        assert gone.name in kvctl("list", "--all").stdout
        refused = kvctl("limit", gone.name, "1GiB")
        assert refused.exit_code == 1 and "is stale" in refused.stderr
        assert fields(gone)[0] == 8 * GiB

        dry = kvctl("clean", "--dry-run")
        assert dry.exit_code == 0 and gone.exists() and reused.exists()
        assert sorted(line.split()[2] for line in dry.stdout.splitlines()) == sorted([str(gone), str(reused)])
        done = kvctl("clean")
        assert done.exit_code == 0, done.stderr
        assert "upstream kvcached segment" in done.stdout
        assert not gone.exists() and not reused.exists()
        assert live.exists() and named.exists()
        assert [p.name for p in shm_dir.iterdir() if p.name.startswith(".")] == []
    finally:
        newer.kill()
        newer.wait()


def test_clean_never_removes_another_users_file_or_one_that_does_not_parse(shm_dir):
    theirs = upstream_segment(shm_dir, f"kvcached_vLLM_{dead_group()}", 8 * GiB, 0, 0)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    short = shm_dir / f"kvcached_vLLM_{dead_group()}"
    short.write_bytes(struct_bytes(GiB, 0, 0)[:23])
    insane = shm_dir / f"kvcached_vLLM_{dead_group()}_1"
    insane.write_bytes(struct_bytes(GiB, -7, 0))
    assert {m.name: m.status for m in kc.list_models()} == {theirs.name: "stale"}
    done = kvctl("clean")
    assert done.exit_code == 0
    assert f"kept {theirs}: it belongs to uid {OTHER_UID}" in done.stderr
    assert theirs.exists() and short.exists() and insane.exists()
    assert fields(insane) == (GiB, -7, 0)


def test_a_group_in_a_nested_pid_namespace_is_never_called_gone(shm_dir):
    """A container's engine names its file by a group id of its own namespace: we may not judge it."""
    script = 'setsid sh -c "echo \\$\\$; exec sleep 60" & wait'
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", script],
                             stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(inner.stdout.readline())
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)  # no such group out here: only the nested namespace has it
        path = upstream_segment(shm_dir, f"kvcached_vLLM_{pgid}", 8 * GiB, GiB, 0)
        assert rows()[path.name].status == "legacy"
        done = kvctl("clean")
        assert done.exit_code == 0 and path.exists()
    finally:
        inner.kill()
        inner.wait()


def test_a_group_id_a_nested_namespace_holds_is_never_called_reused(shm_dir):
    """Inside its namespace a container's first process leads group 1; out here group 1 is init's
    (created after this file's last write, set to 1970) or none: still not ours to judge."""
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "setsid", "sleep", "60"])
    try:
        wait_for(lambda: 1 in GroupJudge().nested_pgids(), 10, "the nested namespace's group 1")
        path = upstream_segment(shm_dir, "kvcached_vLLM_1", 8 * GiB, GiB, 0)
        os.utime(path, ns=(0, 0))
        assert rows()[path.name].status == "legacy"
        assert kvctl("clean").exit_code == 0 and path.exists()
    finally:
        inner.kill()
        inner.wait()
    os.utime(path, ns=(0, 0))
    wait_for(lambda: 1 not in GroupJudge().nested_pgids(), 10, "the nested namespace to end")
    assert rows()[path.name].status == "stale"  # with no container holding group 1: reused, or gone


# -- our segments next to the public kvctl ----------------------------------------------------

ALLOCATOR = textwrap.dedent("""
    import sys
    from kvcached_core import KVCacheManager
    m = KVCacheManager("ours", name="ours", num_blocks=64, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)
    print("READY", flush=True)
    sys.stdin.read()
    m.close()
""")


def test_the_public_kvctl_limit_on_our_segment_is_reported_and_repaired(shm_dir):
    proc = subprocess.Popen([sys.executable, "-c", ALLOCATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=child_env(), text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        path = shm_dir / "kvc.ours"
        original = path.read_bytes()[:24]
        os.kill(proc.pid, signal.SIGSTOP)  # so that the damage stays while we read it
        upstream_rewrite(path, total=4 * GiB)  # what `kvctl limit kvc.ours 4G` of the public kvcached does
        assert path.read_bytes()[:8] == (4 * GiB).to_bytes(8, "little")
        found = kc.scan()
        assert found.models == ()
        (problem,) = found.problems
        assert (problem.status, problem.writer_alive) == ("corrupt", True)
        assert "header overwritten" in problem.reason and str(4 * GiB) in problem.reason
        plain = kvctl("list")  # a live model that cannot be read is never dropped silently
        assert plain.exit_code == 0 and plain.stderr.count("\n") == 1
        assert "kvc.ours: corrupt: header overwritten" in plain.stderr
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: "ours" in rows() and rows()["ours"].status == "live", 5, "the header restored")
        assert path.read_bytes()[:24] == original
        assert kvctl("list").stderr == ""
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.close()
        proc.wait(10)
    log = proc.stderr.read()
    assert log.count("\n") == 1, log
    assert "its first 8 bytes were overwritten with 4294967296" in log and "header restored" in log


def test_an_overwritten_segment_of_a_dead_allocator_is_reported_only_under_all(shm_dir):
    proc = subprocess.Popen([sys.executable, "-c", ALLOCATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=child_env(), text=True)
    assert proc.stdout.readline().strip() == "READY"
    proc.kill()
    proc.wait()
    upstream_rewrite(shm_dir / "kvc.ours", total=GiB)
    (problem,) = kc.scan().problems
    assert (problem.status, problem.writer_alive) == ("corrupt", False)
    assert "is gone" in problem.reason
    assert kvctl("list").stderr == ""
    assert "kvc.ours: corrupt: header overwritten" in kvctl("list", "--all").stderr
    assert kvctl("clean").exit_code == 0 and (shm_dir / "kvc.ours").exists()  # damaged: never deleted
