"""The reference tables in docs/ against the code they mirror: each test fails when the two drift.

Tables are read from the markdown itself (the first column's backticked names); the other side
is the code's own constants, a live ``to_dict()`` of a real allocator's segment, or a live HTTP
scrape of the exporter next to one.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.request
from pathlib import Path

from conftest import ROOT, send

import kvcached_core as kc
from kvcached_core.segment import layout as L
from kvcached_core.segment.snapshot import RankInfo

DOCS = ROOT / "docs"
CODE_DIRS = ("kvcached_core", "kvtop", "plugins")
ENV_NAME = re.compile(r"\b(?:KVCACHED_[A-Z0-9_]*[A-Z0-9]|KVCTL_[A-Z0-9_]*[A-Z0-9]|ENABLE_KVCACHED)\b")


def table(path: Path, first_header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table in ``path`` whose header starts with ``first_header``."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        cells = split_row(line)
        if cells and cells[0] == first_header and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: "):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(split_row(row))
            return rows
    raise AssertionError(f"{path.name}: no table whose first column is {first_header!r}")


def split_row(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def names(cell: str) -> list[str]:
    """The backticked names in one cell: `a`, `b` -> ['a', 'b']."""
    return re.findall(r"`([^`]+)`", cell)


# -- kvctl list --json: docs/json.md against a live to_dict() -------------------------------------

def flatten(obj: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in obj.items():
        out[prefix + key] = value
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out.update(flatten(value[0], f"{prefix}{key}[]."))
    return out


TYPES = {"int": int, "str": str, "bool": bool, "float": float, "list": list, "object": dict, "null": type(None)}


def test_json_key_table_is_what_to_dict_produces(spawn_allocator):
    spawn_allocator("docs", engine="vllm", script="b = m.alloc(9); m.mark_cached(b[:3])")
    kc.request_limit("docs", 64 << 20, wait=5)
    proc = spawn_allocator("traffic", engine="vllm")
    send(proc, "m.publish_traffic(2, 1, 5, 700, 300, 1, __import__('time').time_ns())")
    send(proc, "m.publish_groups([('sliding window', 256, 1, 3, 1, 1), ('full attention', None, 1, 2, 0, 1)])")
    live = {m.name: m for m in kc.list_models()}
    snap = dataclasses.replace(live["traffic"], tp_world=2, ranks=(  # the rank objects a tensor-parallel manager publishes
        RankInfo(0, 0, 1, 4096, True), RankInfo(1, 1, 2, 4096, True)))
    produced = {**flatten(live["docs"].to_dict()), **flatten(snap.to_dict())}

    rows = table(DOCS / "json.md", "key")
    documented = {name: row[1] for row in rows for name in names(row[0])}
    assert set(documented) == set(produced), (
        f"keys to_dict() produces without a row in docs/json.md: {sorted(set(produced) - set(documented))}; "
        f"rows to_dict() does not produce: {sorted(set(documented) - set(produced))}")
    for key, value in produced.items():
        allowed = tuple(TYPES[t.strip()] for t in documented[key].split("|"))
        assert type(value) in allowed, f"{key}: documented {documented[key]!r}, to_dict() gives {value!r}"


# -- kvctl export: docs/metrics.md against a live scrape -----------------------------------------

def test_metric_table_is_what_the_exporter_serves(spawn_allocator):
    from kvtop.serve.exporter import Exporter

    proc = spawn_allocator("scraped", engine="vllm", script="b = m.alloc(4)")
    send(proc, "m.publish_traffic(1, 0, 2, 10, 20, 0, __import__('time').time_ns())")
    kc.request_limit("scraped", 64 << 20, wait=5)
    with Exporter("127.0.0.1", 0) as exporter, urllib.request.urlopen(exporter.url, timeout=10) as response:
        text = response.read().decode()
    served = {}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        served[family + "_total" if kind == "counter" and not family.endswith("_total") else family] = kind
    assert "kvcached_requests_running" in served and "kvcached_rank_up" in served

    documented = {name: row[1] for row in table(DOCS / "metrics.md", "metric") for name in names(row[0])}
    assert set(documented) == set(served), (
        f"served without a row in docs/metrics.md: {sorted(set(served) - set(documented))}; "
        f"rows the exporter does not serve: {sorted(set(documented) - set(served))}")
    assert {n: documented[n] for n in served} == served


# -- environment variables: docs/environment.md against the sources -------------------------------

def variables_in_code() -> set[str]:
    found: set[str] = set()
    for top in CODE_DIRS:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".c") and "build" not in path.parts:
                found.update(ENV_NAME.findall(path.read_text(errors="replace")))
    return found


def effective_defaults() -> dict[str, str]:
    """What the code does with each variable unset, as the table writes it."""
    from kvcached_core.allocator import fastpath, placement
    from kvcached_core.backends import cuda_native
    from kvcached_core.settings import MiB, settings
    from kvcached_core.tp import broadcast

    bounds = settings().reserve
    return {
        "KVCACHED_SHM_DIR": str(settings().shm_dir),
        "KVCACHED_PAGE_SIZE_MB": f"{settings().page_size_bytes // MiB}",
        "KVCACHED_MIN_RESERVED_PAGES": f"{bounds.min_pages}",
        "KVCACHED_MAX_RESERVED_PAGES": f"{bounds.max_pages}",
        "KVCACHED_MAX_CACHED_TOKENS": f"{settings().cached_blocks(1)}",
        "KVCACHED_POLICY": placement.DEFAULT_POLICY,
        "KVCACHED_IDLE_RETURN_S": f"{settings().idle_return_s:g}",
        "KVCACHED_CUDA_LAYOUT": settings().cuda_layout,
        "KVCACHED_CUDA_ASYNC_UNMAP": "1" if settings().cuda_async_unmap else "0",
        "KVCACHED_CUDA_UNMAP_DELAY_MS": f"{settings().cuda_unmap_delay_s * 1000:g}",
        "KVCACHED_CUDA_NATIVE": settings().mode(cuda_native.NATIVE_ENV),
        "KVCACHED_FASTPATH": settings().mode(fastpath.FASTPATH_ENV),
        "KVCACHED_TP_STRATEGY": broadcast.default_strategy(),
        "KVCACHED_TP_TIMEOUT_S": f"{broadcast.default_timeout():g}",
    }


def test_environment_table_names_every_variable_the_code_reads(monkeypatch):
    rows = table(DOCS / "environment.md", "variable")
    documented = {name: row[1] for row in rows for name in names(row[0])}
    in_code = variables_in_code()
    assert set(documented) == in_code, (
        f"read by the code, missing from docs/environment.md: {sorted(in_code - set(documented))}; "
        f"documented, read nowhere: {sorted(set(documented) - in_code)}")
    for name in in_code:
        monkeypatch.delenv(name, raising=False)
    for name, default in effective_defaults().items():
        assert documented[name] == f"`{default}`", f"{name}: documented {documented[name]}, the code uses {default!r}"


# -- exit codes: docs/kvctl.md against ExitCode ---------------------------------------------------

def test_exit_code_table_is_the_exit_code_enum():
    from kvtop.cli import ExitCode

    documented = [int(row[0]) for row in table(DOCS / "kvctl.md", "code")]
    assert documented == sorted(int(code) for code in ExitCode)


# -- the segment: docs/segment.md and layout.py's docstring against layout's offsets ---------------

REGIONS = {  # region -> (offset, size) from the constants readers and writers use
    "header": (L.HEADER_OFF, L.HEADER_SIZE),
    "endpoint": (L.ENDPOINT_OFF, L.SEAL_BYTES + L.ENDPOINT.size),
    "control": (L.CONTROL_OFF, L.LIVENESS_OFF - L.CONTROL_OFF),
    "liveness": (L.LIVENESS_OFF, L.SEQ_OFF - L.LIVENESS_OFF),
    "seq": (L.SEQ_OFF, L.COUNTERS_OFF - L.SEQ_OFF),
    "counters": (L.COUNTERS_OFF, L.CHECKSUM_OFF + 8 - L.COUNTERS_OFF),
    "compact": (L.COMPACT_OFF, L.SEAL_BYTES + L.COMPACT_PAYLOAD.size),
    "traffic": (L.TRAFFIC_OFF, L.SEAL_BYTES + L.TRAFFIC.size),
    "sleep": (L.SLEEP_OFF, L.SEAL_BYTES + L.SLEEP.size),
    "pressure": (L.PRESSURE_OFF, L.SEAL_BYTES + L.PRESSURE.size),
    "control2": (L.CONTROL2_OFF, L.CONTROL2_SIZE),
    "refused": (L.SLEEP_REFUSED_OFF, 8),
    "groups": (L.GROUPS_OFF, L.SEAL_BYTES + L.GROUPS.size),
}


def test_segment_tables_match_the_layout_module():
    rows = {row[2]: row for row in table(DOCS / "segment.md", "offset")}
    assert set(rows) == {*REGIONS, "page map", "ranks"}
    for region, (offset, size) in REGIONS.items():
        assert (rows[region][0], rows[region][1]) == (str(offset), str(size)), region
    assert (rows["page map"][0], rows["page map"][1]) == (str(L.PAGE_MAP_OFF), "4 × pages")
    assert rows["ranks"][1] == f"{L.RANK.size} × ranks"

    doc = L.__doc__ or ""
    for region, (offset, size) in REGIONS.items():
        assert re.search(rf"^\s+{offset}\s+{size}\s+{region.upper()}\b", doc, re.M), f"layout.py docstring: {region}"
    assert re.search(rf"^\s+{L.PAGE_MAP_OFF}\s+4\*N\s+PAGE MAP\b", doc, re.M)
    assert re.search(rf"^\s+\.\.\.\s+R\*{L.RANK.size}\s+RANKS\b", doc, re.M)


# -- kvtop's keys: docs/kvtop.md against the app's bindings ---------------------------------------

def test_every_kvtop_binding_is_in_the_key_table():
    from kvtop.screen.actions import KEY_NAMES
    from kvtop.screen.dashboard import KvtopApp

    documented = {part for row in table(DOCS / "kvtop.md", "key") for name in names(row[0])
                  for part in re.split(r"\s*/\s*", name)}
    arrows = {"left": "←", "right": "→"}
    shown = {KEY_NAMES.get(key, arrows.get(key, key))
             for binding in KvtopApp.BINDINGS for key in binding.key.split(",")}  # type: ignore[union-attr]
    assert shown <= documented, f"kvtop keys without a row in docs/kvtop.md: {sorted(shown - documented)}"


# -- kvctl's commands and kvtop's options: docs/kvctl.md and docs/kvtop.md against click -----------

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def long_options(command) -> set[str]:  # a click.Command
    import click

    return {opt for p in command.params if isinstance(p, click.Option)
            for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--") and opt != "--help"}


def test_the_command_table_has_every_kvctl_command_and_option():
    import click

    from kvtop.cli import COMMANDS, main

    documented: dict[str, set[str]] = {}
    for row in table(DOCS / "kvctl.md", "command"):
        for usage in names(row[0]):
            words = usage.split()
            assert words[0] == "kvctl", f"docs/kvctl.md: {usage!r} is not a kvctl command line"
            documented.setdefault(words[1], set()).update(OPTION.findall(usage.removeprefix("kvctl " + words[1])))
    group = documented.pop("--version", None)
    assert group is not None and {"--version", *group} == long_options(main), "kvctl --version [--verbose]: a row"
    assert set(documented) == set(COMMANDS), (
        f"commands without a row in docs/kvctl.md: {sorted(set(COMMANDS) - set(documented))}; "
        f"rows for no command: {sorted(set(documented) - set(COMMANDS))}")
    ctx = click.Context(main)
    for name in COMMANDS:
        command = main.get_command(ctx, name)
        assert documented[name] == long_options(command), (
            f"kvctl {name}: options {sorted(long_options(command))}, its row names {sorted(documented[name])}")


def test_the_options_table_has_every_kvtop_option():
    from kvtop.app import cli

    documented = {opt for row in table(DOCS / "kvtop.md", "mode or option") for usage in names(row[0])
                  for opt in OPTION.findall(usage)}
    assert documented == long_options(cli), (
        f"kvtop options without a row: {sorted(long_options(cli) - documented)}; "
        f"documented, not an option: {sorted(documented - long_options(cli))}")


# -- kvctl frag / limit / trim --json: docs/json.md's tables against live kvctl output -------------

def key_table(heading: str) -> dict[str, str]:
    """key -> documented type, from the table under ``heading`` in docs/json.md."""
    text = (DOCS / "json.md").read_text()
    section = text[text.index(f"\n## {heading}"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    rows = []
    for line in section.split("| key |", 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(split_row(line))
    return {name: row[1] for row in rows for name in names(row[0])}


def assert_documented(produced: dict[str, object], documented: dict[str, str], what: str) -> None:
    assert set(documented) == set(produced), (
        f"{what}: keys without a row in docs/json.md: {sorted(set(produced) - set(documented))}; "
        f"rows it does not produce: {sorted(set(documented) - set(produced))}")
    for key, value in produced.items():
        allowed = tuple(TYPES[t.strip()] for t in documented[key].split("|"))
        assert type(value) in allowed, f"{what} {key}: documented {documented[key]!r}, it gives {value!r}"


def test_frag_and_acknowledgement_tables_are_what_kvctl_prints(spawn_allocator):
    import json

    from conftest import kvctl

    spawn_allocator("docs", engine="vllm", script="b = m.alloc(9); m.mark_cached(b[:3])")
    frag = kvctl("frag", "docs", "--json")
    assert frag.exit_code == 0, frag.stderr
    produced = flatten(json.loads(frag.stdout))
    assert produced["worst_pages"], "a page in use: worst_pages has an object to check"
    assert_documented(produced, key_table("Fragmentation"), "kvctl frag --json")

    documented = key_table("Acknowledgements")
    for args in (("limit", "docs", "64MiB"), ("limit", "docs", "none"), ("trim", "docs")):
        done = kvctl(*args, "--json")
        assert done.exit_code == 0, done.stderr
        [ack] = json.loads(done.stdout)
        assert_documented(ack, documented, f"kvctl {args[0]} --json")


def test_every_command_that_takes_json_is_in_json_md():
    import click

    from kvtop.cli import COMMANDS, main

    text = (DOCS / "json.md").read_text()
    ctx = click.Context(main)
    for name in COMMANDS:
        if "--json" in long_options(main.get_command(ctx, name)):
            assert re.search(rf"`(?:kvctl )?{name}(?: MODEL)? --json`", text), f"kvctl {name} --json: not in docs/json.md"


SLEEPY = """
def handler(action):
    if action.startswith("sleep"):
        m.free(held)
        held.clear()
        m.sleep.ready()
    else:
        held.extend(m.alloc(4))
held = m.alloc(4)
m.set_sleep_handler(handler)
"""


def test_sleep_and_wake_table_is_what_kvctl_prints(spawn_allocator):
    import json

    from conftest import kvctl

    spawn_allocator("sleepy", engine="vllm", script=SLEEPY)
    produced: dict[str, list[object]] = {}
    for args in (("sleep", "--wait"), ("sleep",), ("wake", "--wait"), ("wake",), ("sleep", "--now", "--wait"),
                 ("wake", "--wait"), ("sleep", "--after-idle", "5m"), ("sleep", "--after-idle", "off")):
        done = kvctl(args[0], "sleepy", *args[1:], "--json")
        assert done.exit_code == 0, (args, done.stderr)
        for key, value in json.loads(done.stdout).items():
            produced.setdefault(key, []).append(value)
    documented = key_table("Sleep and wake")
    # A later request replacing this one (two controllers racing); a request waking the model before the
    # answer is read (tests/test_control_waits.py): neither happens here.
    racing = {"superseded", "superseded_by", "woken"}
    assert set(documented) - racing == set(produced), (
        f"kvctl sleep/wake --json: keys without a row in docs/json.md: {sorted(set(produced) - set(documented))}; "
        f"rows it does not produce: {sorted(set(documented) - racing - set(produced))}")
    for key, values in produced.items():
        allowed = tuple(TYPES[t.strip()] for t in documented[key].split("|"))
        assert all(type(v) in allowed for v in values), f"{key}: documented {documented[key]!r}, it gives {values!r}"
    assert produced["already"] == [True, True] and None in produced["after_idle_s"]
    source = (ROOT / "kvtop" / "cli" / "sleep.py").read_text()
    assert all(f'out["{key}"]' in source for key in racing), "the racing keys are still what kvctl sets"
