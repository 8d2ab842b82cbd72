"""The files under deploy/ against a live exporter: every PromQL expression of the alert rules, the Grafana
dashboard and the queries of docs/metrics.md names only metrics (and label names) the exporter serves.

The exporter runs for real over HTTP next to a real allocator; its ``# TYPE`` lines give every family it can serve
(families without samples included), its samples the label names each family carries.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import yaml
from conftest import ROOT, send
from prometheus_client.parser import text_string_to_metric_families

import kvcached_core as kc

ALERTS = ROOT / "deploy" / "prometheus" / "kvcached-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcached.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                      "offset", "inf", "nan", "atan2"})
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{([^{}]*)\}")
RANGE = re.compile(r"\[[^\[\]]*\]")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)(?:[smhdwy]|ms)?\b")
NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^{}]*)\}")
LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier that is not a function (followed by ``(``),
    a keyword, a label (inside ``{}`` or a grouping clause), a string, a number or a duration."""
    text = re.sub(r"\$\{?\w+\}?", "0", STRING.sub('""', expr))  # Grafana variables outside strings stand for values
    text = MATCHERS.sub(" ", text)
    text = RANGE.sub(" ", text)
    text = GROUPING.sub(" ", text)
    text = NUMBER.sub(" ", text)
    names = set()
    for found in NAME.finditer(text):
        rest = text[found.end():].lstrip()
        if rest.startswith("(") or found.group() in KEYWORDS:
            continue  # a function call or an operator word
        names.add(found.group())
    return names


def matcher_labels(expr: str) -> dict[str, set[str]]:
    """Per metric selected with ``name{...}``, the label names its matchers use."""
    text = STRING.sub('""', expr)
    out: dict[str, set[str]] = {}
    for name, body in SELECTOR.findall(text):
        out.setdefault(name, set()).update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    return out


def alert_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    assert isinstance(rules, dict) and rules.get("groups"), f"{ALERTS.name}: no rule groups"
    found = []
    for group in rules["groups"]:
        assert group.get("name") and group.get("rules"), f"{ALERTS.name}: a group without a name or rules"
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert isinstance(rule.get("alert"), str) and isinstance(rule.get("expr"), str), rule
            found.append((f"{ALERTS.name}: {rule['alert']}", rule["expr"]))
    return found


def dashboard_expressions() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found.append((f"{DASHBOARD.name}: panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"{DASHBOARD.name}: variable {variable['name']}", variable["query"]["query"]))
    return found


def doc_expressions() -> list[tuple[str, str]]:
    """The lines of docs/metrics.md's ``promql`` blocks, comments dropped."""
    found = []
    for block in re.findall(r"```promql\n(.*?)```", METRICS_DOC.read_text(), re.S):
        for line in block.splitlines():
            expr = line.split("  #")[0].strip()
            if expr:
                found.append((f"{METRICS_DOC.name}: {expr}", expr))
    return found


def served() -> tuple[set[str], dict[str, set[str]]]:
    """What a live exporter serves next to a real allocator: the series names PromQL selects (counters with their
    ``_total``) and, for each that has samples, the label names they carry."""
    from kvtop.serve.exporter import Exporter

    with Exporter("127.0.0.1", 0) as exporter, urllib.request.urlopen(exporter.url, timeout=10) as response:
        text = response.read().decode()
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(family + "_total" if kind == "counter" and not family.endswith("_total") else family)
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


@pytest.fixture
def live(spawn_allocator) -> tuple[set[str], dict[str, set[str]]]:
    proc = spawn_allocator("deployed", engine="vllm", script="b = m.alloc(4)")
    send(proc, "m.publish_traffic(1, 0, 2, 10, 20, 0, __import__('time').time_ns())")
    kc.request_limit("deployed", 64 << 20, wait=5)
    return served()


def test_the_parser_finds_the_metric_names_and_nothing_else():
    expr = ('sum by (model, host) (rate(kvcached_router_errors_total{host=~"$host", model="a b"}[$__rate_interval]))'
            ' / on (host) group_left (gpu) kvcached_gpu_memory_total_bytes > 1e9 and bool kvcached_stale offset 5m')
    assert metric_names(expr) == {"kvcached_router_errors_total", "kvcached_gpu_memory_total_bytes", "kvcached_stale"}
    assert matcher_labels(expr) == {"kvcached_router_errors_total": {"host", "model"}}
    assert metric_names("topk(10, kvcached_waste_ratio)") == {"kvcached_waste_ratio"}


def test_alert_rules_are_valid_and_name_only_served_metrics(live):
    check(alert_expressions(), *live)


def test_dashboard_queries_name_only_served_metrics(live):
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "host", "model"}
    check(dashboard_expressions(), *live)


def test_metrics_doc_queries_name_only_served_metrics(live):
    assert "deploy/prometheus/kvcached-alerts.yml" in METRICS_DOC.read_text()
    check(doc_expressions(), *live)


def test_the_dashboard_draws_every_family_of_the_router_and_the_memory_figures():
    drawn = set().union(*(metric_names(e) for _, e in dashboard_expressions()))
    wanted = {"kvcached_mapped_bytes", "kvcached_held_bytes", "kvcached_limit_bytes", "kvcached_waste_ratio",
              "kvcached_wanted_bytes", "kvcached_reclaim_given_bytes_total", "kvcached_requests_running",
              "kvcached_generated_tokens_total", "kvcached_router_requests_total", "kvcached_router_errors_total",
              "kvcached_router_wakes_total", "kvcached_router_in_flight", "kvcached_router_latency_seconds",
              "kvcached_router_ttft_seconds"}
    assert wanted <= drawn, f"not drawn: {sorted(wanted - drawn)}"


def check(expressions: list[tuple[str, str]], names: set[str], labels: dict[str, set[str]]) -> None:
    assert expressions
    wrong = []
    for where, expr in expressions:
        variable = LABEL_VALUES.match(expr)
        selector = variable.group(1) if variable else expr
        used = metric_names(selector)
        if not used:
            wrong.append(f"{where}: no metric found in {expr!r}")
        wrong += [f"{where}: {name} is not a metric the exporter serves" for name in sorted(used - names)]
        wanted = matcher_labels(selector)
        if variable:
            wanted.setdefault(next(iter(used)), set()).add(variable.group(2))
        for name, label_names in wanted.items():
            if name in labels and not label_names <= labels[name]:
                wrong.append(f"{where}: {name} has no label {sorted(label_names - labels[name])}")
    assert not wrong, "\n".join(wrong)


def test_every_deploy_file_is_checked():
    assert sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "deploy").rglob("*") if p.is_file()) == [
        "deploy/grafana/kvcached.json", "deploy/prometheus/kvcached-alerts.yml", "deploy/systemd/kvctl-record.service"]


def test_the_recorder_unit_runs_kvctl_record_with_options_it_takes(tmp_path) -> None:
    """deploy/systemd/kvctl-record.service: a user unit whose ExecStart is a kvctl record that parses, writing to
    the user's state directory; SIGTERM (a clean stop, exit 0) stops it, and it restarts only on a failure."""
    import configparser
    import shlex

    from kvtop.cli.record import record_cmd

    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(ROOT / "deploy" / "systemd" / "kvctl-record.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[:3] == ["/usr/bin/env", "kvctl", "record"]
    args = [a.replace("%S", str(tmp_path)) for a in argv[3:]]
    ctx = record_cmd.make_context("record", args)  # a bad option or value raises here
    assert ctx.params["out"] == tmp_path / "kvtop" / "record"
    assert ctx.params["interval"] == 1.0 and ctx.params["max_size"] is not None
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "default.target"  # a user unit: no multi-user.target
