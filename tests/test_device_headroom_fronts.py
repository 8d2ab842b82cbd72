"""The headroom and the engines' working memory in the front ends: kvctl list --json and watch's CSV, the
exporter's scrape, kvtop's device bar. A CUDA allocator on the fake driver (tests/fake_cuda.py) publishes them."""

from __future__ import annotations

import csv
import io
import json
import urllib.request
from dataclasses import replace

import pytest
from click.testing import CliRunner
from fakes import FakeSource, fake_model, fake_pages
from prometheus_client.parser import text_string_to_metric_families

import kvcached_core as kc
from kvcached_core.backends.nvml import GpuInfo
from kvtop.cli import main
from kvtop.screen.view import device_bars, device_lines
from kvtop.serve.exporter import Exporter

MiB, GiB = 1 << 20, 1 << 30
GEOMETRY = dict(num_blocks=64, block_bytes=1 << 16, num_layers=2, page_size=2 * MiB)


@pytest.fixture
def engines(fake_cuda, shm_dir, monkeypatch):
    """A CUDA model (a 64 MiB headroom, a working peak of 3 GiB of which it holds 1 GiB) and a host model."""
    monkeypatch.setenv("KVCACHED_DEVICE_HEADROOM", "64MiB")
    with kc.KVCacheManager("gpu-model", name="gpu-model", backend="cuda", **GEOMETRY) as gpu, \
            kc.KVCacheManager("host-model", name="host-model", **GEOMETRY) as host:
        gpu.register_working_memory(3 * GiB, now_bytes=GiB)
        yield gpu, host


def test_kvctl_list_json_shows_the_headroom_and_the_working_memory(engines) -> None:
    done = CliRunner().invoke(main, ["list", "--json"])
    assert done.exit_code == 0, done.output
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    figures = ("device_headroom", "working_peak_bytes", "working_now_bytes")
    assert [rows["gpu-model"][k] for k in figures] == [64 * MiB, 3 * GiB, GiB]
    assert [rows["host-model"][k] for k in figures] == [0, 0, 0]


def test_kvctl_watch_csv_has_them_as_columns(engines) -> None:
    done = CliRunner().invoke(main, ["watch", "--format", "csv", "--count", "1", "gpu-model"])
    assert done.exit_code == 0, done.output
    [row] = list(csv.DictReader(io.StringIO(done.stdout)))
    assert (row["device_headroom"], row["working_peak_bytes"], row["working_now_bytes"]) == (
        str(64 * MiB), str(3 * GiB), str(GiB))


def test_the_exporter_serves_them(engines) -> None:
    with Exporter("127.0.0.1", 0) as exporter, urllib.request.urlopen(exporter.url, timeout=10) as response:
        text = response.read().decode()
    samples = {(s.name, s.labels["model"]): s.value for family in text_string_to_metric_families(text)
               for s in family.samples if "model" in s.labels}
    assert samples[("kvcached_device_headroom_bytes", "gpu-model")] == 64 * MiB
    assert samples[("kvcached_working_peak_bytes", "gpu-model")] == 3 * GiB
    assert samples[("kvcached_working_now_bytes", "gpu-model")] == GiB
    for family in ("kvcached_device_headroom_bytes", "kvcached_working_peak_bytes", "kvcached_working_now_bytes"):
        assert (family, "host-model") not in samples  # none: absent, never an invented 0


def test_kvtops_device_bar_keeps_the_working_memory_and_the_headroom_from_free() -> None:
    pages = fake_pages(64, inuse=8, reserved=0, bpp=8, seed=1)
    a = replace(fake_model("a", pages=pages, backend="cuda", pid=1), device_headroom=4 * GiB,
                working_peak=10 * GiB, working_now=4 * GiB)
    b = replace(fake_model("b", pages=pages, backend="cuda", pid=2), device_headroom=2 * GiB,
                working_peak=GiB, working_now=2 * GiB)  # holds more than its peak: nothing outstanding
    c = replace(fake_model("c", pages=pages, backend="cuda", pid=3, device=1), working_peak=5 * GiB)
    gpus = (GpuInfo(0, "H100", "GPU-0", 80 * GiB, 30 * GiB, 50 * GiB), GpuInfo(1, "H100", "GPU-1", 80 * GiB, 0, 80 * GiB))
    first, second = device_bars(FakeSource([(a, b, c)], gpus=gpus).read(None))
    assert [(p.label, p.nbytes) for p in first.kept] == [("working", 6 * GiB), ("headroom", 4 * GiB)]
    assert first.free == 80 * GiB - first.taken - 10 * GiB
    assert [(p.label, p.nbytes) for p in second.kept] == [("working", 5 * GiB)]
    bar, legend = device_lines(first, 160)
    assert legend.plain.startswith("░ working 6.0 GiB  ░ headroom 4.0 GiB  ■ a ")
    assert legend.plain.endswith(f"free {kc.format_bytes(first.free)}")
    assert "░" in bar.plain
