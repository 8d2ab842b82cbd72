"""Engine traffic in the segment: published by one process, read by kvctl, watch and the exporter in others."""

from __future__ import annotations

import csv
import io
import json

from conftest import kvctl, send, wait_for
from test_exporter import scrape, value

from kvcached_core import snapshot
from kvtop.serve.exporter import Exporter

PUBLISH = "m.publish_traffic(3, 2, 7, 1200, 345, 1, time.time_ns() - 2_000_000_000)"


def test_published_traffic_reaches_list_show_watch_and_the_exporter(spawn_allocator) -> None:
    proc = spawn_allocator("busy", engine="vllm", script="import time; " + PUBLISH)
    spawn_allocator("quiet")
    traffic = snapshot("busy").traffic
    assert traffic is not None
    assert (traffic.running, traffic.waiting, traffic.finished, traffic.prompt_tokens, traffic.generated_tokens,
            traffic.preemptions) == (3, 2, 7, 1200, 345, 1)
    assert 1.5 < traffic.idle_s < 60
    rows = {r["name"]: r for r in json.loads(kvctl("list", "--json").stdout)}
    assert rows["quiet"]["traffic"] is None  # an engine that publishes nothing: null, not zeros
    busy = rows["busy"]["traffic"]
    assert {k: busy[k] for k in ("running", "waiting", "finished", "prompt_tokens", "generated_tokens",
                                 "preemptions")} == {"running": 3, "waiting": 2, "finished": 7, "prompt_tokens": 1200,
                                                     "generated_tokens": 345, "preemptions": 1}
    assert json.loads(kvctl("show", "busy", "--json").stdout)["traffic"]["finished"] == 7

    watched = kvctl("watch", "--format", "csv", "--count", "1", "--interval", "0.05")
    records = {r["name"]: r for r in csv.DictReader(io.StringIO(watched.stdout))}
    assert records["busy"]["generated_tokens"] == "345" and records["quiet"]["generated_tokens"] == ""

    with Exporter("127.0.0.1", 0) as exporter:
        samples = scrape(exporter.url)
        assert value(samples, "kvcached_requests_running", model="busy") == 3
        assert value(samples, "kvcached_requests_waiting", model="busy") == 2
        assert value(samples, "kvcached_generated_tokens_total", model="busy") == 345
        assert value(samples, "kvcached_preemptions_total", model="busy") == 1
        assert not any(name.startswith("kvcached_requests_running") and ("model", "quiet") in labels
                       for name, labels in samples)
    send(proc, "m.publish_traffic(0, 0, 10, 1500, 400, 1, time.time_ns())")
    assert wait_for(lambda: snapshot("busy").traffic.finished == 10)


def test_traffic_is_null_until_an_engine_publishes_it(spawn_allocator) -> None:
    proc = spawn_allocator("later")
    assert snapshot("later").traffic is None
    send(proc, "import time; m.publish_traffic(0, 1, 0, 24, 0, 0, time.time_ns())")
    traffic = wait_for(lambda: snapshot("later").traffic)
    assert traffic.waiting == 1 and traffic.idle_s is not None and traffic.idle_s < 30


def test_kvtop_shows_traffic_next_to_memory(spawn_allocator) -> None:
    from dataclasses import replace

    from rich.console import Console

    from kvtop.frames.history import History
    from kvtop.screen.once import models_table
    from kvtop.screen.view import model_cells

    spawn_allocator("busy", engine="vllm", script="import time; " + PUBLISH)
    spawn_allocator("quiet")
    console = Console(record=True, width=240, force_terminal=False)
    console.print(models_table([snapshot("busy"), snapshot("quiet")], width=240))
    out = console.export_text()
    header, *rows = [line for line in out.splitlines() if line.strip()]
    assert "wait" in header and "preempt" in header and "idle" in header
    busy = next(r for r in rows if "busy" in r)
    end = header.index(" wait") + len(" wait")  # a right-aligned column ends under its header
    assert busy[end - 5:end].strip() == "2"  # 2 waiting, as published
    first = snapshot("busy")
    history = History()
    history.update([first])
    later = replace(first, read_ns=first.read_ns + 2_000_000_000,
                    traffic=replace(first.traffic, generated_tokens=first.traffic.generated_tokens + 600,
                                    read_ns=first.read_ns + 2_000_000_000))
    history.update([later])
    cells = model_cells(later, history)
    assert cells["toks"].plain == "300" and cells["tokspark"].plain
    assert model_cells(snapshot("quiet"), history)["toks"].plain == "-"
