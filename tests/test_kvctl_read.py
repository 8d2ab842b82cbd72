"""kvctl list / show / frag against real allocators in child processes, plus help, version, completion."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import ROOT, child_env, kvctl, send, wait_for

from kvtop.cli import COMMANDS, main

MiB = 1024 * 1024
REQUIRED_KEYS = {
    "name", "engine", "pid", "device", "status", "page_size", "pages_total", "pages_inuse", "pages_reserved",
    "blocks_per_page", "blocks_used", "blocks_cached", "mapped_bytes", "held_bytes", "reserved_bytes",
    "limit_bytes", "limit_status", "waste_ratio",
}


def stale(spawn_allocator, name: str) -> None:
    """A segment whose process died without cleaning up."""
    proc = spawn_allocator(name)
    proc.kill()
    proc.wait()


def test_list_json_matches_the_live_allocator(spawn_allocator):
    # 4 blocks per page, 1 MiB per page bundle: 10 blocks over 3 pages, 2 of them cached.
    proc = spawn_allocator("m1", script="b = m.alloc(10); m.mark_cached(b[:2])")
    result = kvctl("list", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == ["m1"]
    row = rows[0]
    assert row.keys() >= REQUIRED_KEYS
    assert row["pid"] == proc.pid and row["status"] == "live" and row["engine"] == "custom"
    assert row["blocks_used"] == 10 and row["blocks_cached"] == 2 and row["pages_inuse"] == 3
    assert row["blocks_per_page"] == 4 and row["page_size"] == 256 * 1024 and row["bundle_bytes"] == MiB
    assert row["held_bytes"] == 10 * 256 * 1024 and row["pinned_bytes"] == 3 * MiB
    assert row["waste_ratio"] == pytest.approx(3 * MiB / (10 * 256 * 1024), abs=1e-4)
    assert row["limit_bytes"] is None and row["limit_status"] == "none"
    assert row["mapped_bytes"] == (row["pages_inuse"] + row["pages_reserved"]) * MiB

    send(proc, "m.free(b[2:])")
    after = json.loads(kvctl("list", "--json").stdout)[0]
    assert after["blocks_used"] == 2 and after["pages_inuse"] == 1


def test_list_table_hides_stale_rows_unless_all(spawn_allocator, shm_dir: Path):
    spawn_allocator("alive")
    stale(spawn_allocator, "dead")
    (shm_dir / "kvc.junk").write_bytes(b"not a segment at all" * 10)

    plain = kvctl("list")
    assert plain.exit_code == 0 and plain.stderr == ""
    lines = plain.stdout.splitlines()
    assert lines[0].split()[:5] == ["NAME", "ENGINE", "PID", "DEV", "STATUS"]
    assert [line.split()[0] for line in lines[1:]] == ["alive"]

    everything = kvctl("list", "--all")
    assert everything.exit_code == 0
    rows = {line.split()[0]: line.split()[4] for line in everything.stdout.splitlines()[1:]}
    assert rows == {"alive": "live", "dead": "stale"}
    warnings = everything.stderr.splitlines()
    assert len(warnings) == 1 and "kvc.junk" in warnings[0] and warnings[0].startswith("kvctl: warning:")

    as_json = json.loads(kvctl("list", "--all", "--json").stdout)
    assert {r["name"]: r["status"] for r in as_json} == {"alive": "live", "dead": "stale"}


def test_list_gpu_filter(spawn_allocator):
    spawn_allocator("m1")
    assert [r["name"] for r in json.loads(kvctl("list", "--json", "--gpu", "0").stdout)] == ["m1"]
    assert json.loads(kvctl("list", "--json", "--gpu", "3").stdout) == []


def test_show_json_and_page_map(spawn_allocator):
    spawn_allocator("model-a", script="b = m.alloc(6); m.free(b[4:5])")
    spawn_allocator("model-b")
    result = kvctl("show", "model-a", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["name"] == "model-a" and len(data["pages"]) == data["pages_total"] == 128
    used = [p for p in data["pages"] if p[1]]
    assert sum(p[1] for p in used) == data["blocks_used"] == 5
    assert all(p[0] == 1 for p in used)
    assert data["fragmentation"]["packed_floor_pages"] == 2
    assert data["fragmentation"]["reclaimable_trim_bytes"] == data["reserved_bytes"]

    text = kvctl("show", "model-a", "--width", "64")  # 128 pages -> two rows of 64
    assert text.exit_code == 0
    out = text.stdout
    assert "page map: 128 pages, 1 page per cell" in out
    grid = [line for line in out.splitlines() if re.match(r"^\s*\d+ [·○c░▒▓█]+$", line)]
    assert len(grid) == 2 and len(grid[0].split()[1]) == 64
    assert grid[0].split()[1][:2] == "█░"  # page 0 full (4/4), page 1 1/4 used
    assert "· free (unmapped)" in out and "○ reserved" in out
    assert "status       live" in out


PRESSURE_GEOMETRY = dict(num_blocks=256, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)  # 1 MiB bundles
DONOR = "active = m.alloc(8)\ncached = m.alloc(80)\nm.mark_cached(cached)\nm.set_evict_handler(lambda: m.evict_for_limit())\n"
ASKER = "import time\ngot = []\nwhile len(got) < 40:\n    ids = m.alloc(4)\n    got += ids or []\n    time.sleep(0 if ids else 0.01)\n"


def test_show_says_the_policy_and_the_reclaims_between_two_models(spawn_allocator, monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "26MiB")  # one budget: the asker's 40 blocks need the donor's
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    spawn_allocator("idle", script=DONOR, priority=-2, min_bytes=4 * MiB, **PRESSURE_GEOMETRY)
    spawn_allocator("busy", script=ASKER, **PRESSURE_GEOMETRY)  # READY once it holds its 40 blocks

    def lines(name: str) -> dict[str, str]:
        out = kvctl("show", name)
        assert out.exit_code == 0, out.stderr
        return {m[1]: m[2] for m in re.finditer(r"^  (\w+) +(.*)$", out.stdout, re.M)}

    def pressure() -> dict:
        return {m["name"]: m["pressure"] for m in json.loads(kvctl("list", "--json").stdout)}

    def steady() -> tuple[dict, dict, dict] | None:
        """The show lines of both, between two equal JSON reads (a warm pool refilling may still ask for pages)."""
        before, idle, busy = pressure(), lines("idle"), lines("busy")
        return (before, idle, busy) if pressure() == before else None

    data, idle, busy = wait_for(steady, timeout=20, what="two equal reads")
    gave, took = data["idle"], data["busy"]
    assert idle["policy"] == "min 4.0 MiB, priority -2"
    assert busy["policy"] == "min none, priority 0"
    last = gave["last_given"]
    assert gave["gave_count"] >= 1 and took["took_bytes"] > 0
    assert re.fullmatch(rf"[\d.]+ \w+ in {gave['gave_count']} reclaims; last [\d.]+ \w+ to busy "
                        r"\(cached [\d.]+ \w+, reserved [\d.]+ \w?B\) in \d+ ms", idle["gave"]), idle["gave"]
    assert idle["gave"].startswith(f"{kc_bytes(gave['gave_bytes'])} in ")
    assert f"last {kc_bytes(last['bytes'])} to busy (cached {kc_bytes(last['cached_bytes'])}, " in idle["gave"]
    assert busy["took"].startswith(f"{kc_bytes(took['took_bytes'])} in {took['took_count']} reclaims, "
                                   f"{took['asked_count']} requests asked; last ")
    for name, shown in (("idle", idle), ("busy", busy)):  # the line is there exactly while it waits
        wanted = data[name]["wanted_bytes"]
        assert shown.get("pressure", "").startswith(f"waiting for {kc_bytes(wanted)}") if wanted else "pressure" not in shown


def kc_bytes(n: int) -> str:
    from kvcached_core import format_bytes

    return format_bytes(n)


def test_show_folds_a_large_map_and_resolves_prefixes(spawn_allocator):
    spawn_allocator("prefix-model", num_blocks=4096, script="b = m.alloc(8)")  # 1024 pages
    text = kvctl("show", "prefix", "--width", "32", "--rows", "4")
    assert text.exit_code == 0, text.stderr
    assert "1024 pages, 8 pages per cell" in text.stdout
    grid = [line for line in text.stdout.splitlines() if re.match(r"^\s*\d+ [·○c░▒▓█]+$", line)]
    assert len(grid) == 4 and grid[0].split()[1][0] == "█"


def test_frag_report_one_and_all(spawn_allocator):
    spawn_allocator("f1", script="b = m.alloc(8); m.free(b[1:4] + b[5:8])")  # two pages, one block each
    spawn_allocator("f2")
    one = kvctl("frag", "f1", "--json")
    assert one.exit_code == 0
    data = json.loads(one.stdout)
    assert data["name"] == "f1" and data["packed_floor_pages"] == 1 and data["pinned_bytes"] == 2 * MiB
    assert data["waste_ratio"] == pytest.approx(2 * MiB / (2 * 256 * 1024))
    assert [p["used"] for p in data["worst_pages"]] == [1, 1]

    every = json.loads(kvctl("frag", "--json").stdout)
    assert [r["name"] for r in every] == ["f1", "f2"]
    text = kvctl("frag", "f1").stdout
    assert "packed floor 1 pages" in text and "waste        4.00x" in text
    table = kvctl("frag").stdout.splitlines()
    assert table[0].split()[0] == "NAME" and len(table) == 3


def test_unknown_and_ambiguous_names_list_candidates(spawn_allocator):
    spawn_allocator("llama-a")
    spawn_allocator("llama-b")
    ambiguous = kvctl("show", "llama")
    assert ambiguous.exit_code == 1 and ambiguous.stdout == ""
    assert ambiguous.stderr.count("\n") == 1 and "llama-a" in ambiguous.stderr and "llama-b" in ambiguous.stderr
    unknown = kvctl("frag", "mistral")
    assert unknown.exit_code == 1 and "llama-a, llama-b" in unknown.stderr
    assert json.loads(kvctl("show", "llama-b", "--json").stdout)["name"] == "llama-b"


def test_list_json_imports_neither_textual_nor_rich(spawn_allocator):
    spawn_allocator("m1")
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('LOADED=' + ','.join(sorted({m.split('.')[0] for m in sys.modules}"
        " & {'textual', 'rich'})) + '\\n'))\n"
        "from kvtop.cli import main\n"
        "main(['list', '--json'])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=child_env(),
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["name"] == "m1"
    assert "LOADED=\n" in done.stderr


def test_version_and_help_with_examples():
    version = kvctl("--version")
    assert version.exit_code == 0 and re.fullmatch(r"kvctl \d+\.\d+\.\d+\n", version.stdout)
    top = kvctl("-h")
    assert top.exit_code == 0 and "Examples:" in top.stdout
    for name in COMMANDS:
        helped = kvctl(name, "--help")
        assert helped.exit_code == 0, name
        assert "Examples:" in helped.stdout and f"kvctl {name}" in helped.stdout, name
    bare = kvctl()
    assert bare.exit_code == 0 and "Commands:" in bare.stdout


def test_model_name_completion(spawn_allocator):
    spawn_allocator("alpha-1")
    spawn_allocator("beta")
    env = {"_KVCTL_COMPLETE": "bash_complete", "COMP_WORDS": "kvctl show al", "COMP_CWORD": "2"}
    done = CliRunner().invoke(main, [], env=env)
    assert done.exit_code == 0
    assert done.stdout.split() == ["plain,alpha-1"]
    env["COMP_WORDS"], env["COMP_CWORD"] = "kvctl limit ", "2"
    names = CliRunner().invoke(main, [], env=env).stdout.split()
    assert names == ["plain,alpha-1", "plain,beta"]


def test_docs_document_every_list_json_key(spawn_allocator):
    spawn_allocator("m1")
    keys = set(json.loads(kvctl("list", "--json").stdout)[0])
    section = (ROOT / "docs" / "json.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.\[\]]+)`", section, flags=re.M))
    assert keys <= documented, sorted(keys - documented)
    assert {"ranks[].rank", "ranks[].device", "ranks[].pid", "ranks[].mapped_bytes", "ranks[].alive"} <= documented


def test_rich_table_for_a_terminal_never_truncates(capsys, monkeypatch):
    from kvtop.text import textfmt as T

    monkeypatch.setenv("COLUMNS", "30")
    columns = (T.Column("NAME"), T.Column("STATUS"), T.Column("WASTE", True))
    T.print_table(columns, [["a-rather-long-model-name-indeed", "live", "4.50x"]], rich=True)
    out = capsys.readouterr().out
    assert "a-rather-long-model-name-indeed" in out and "…" not in out
    assert T.cell_style("WASTE", "4.50x") == "red" and T.cell_style("STATUS", "stale") == "bold red"  # kvtop's colour too (one STATUS_STYLES)
