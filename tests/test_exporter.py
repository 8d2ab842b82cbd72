"""The Prometheus exporter, scraped over loopback with a real HTTP client, against allocators in child processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from conftest import child_env, send, wait_for
from prometheus_client.parser import text_string_to_metric_families

import kvcached_core as kc
from kvcached_core.backends import nvml
from kvcached_core.control.policy import request_policy
from kvcached_core.segment import layout as L
from kvtop.serve.exporter import Exporter

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """Every sample of one scrape, keyed by (sample name, labels)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    matches = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def models_in(samples: Samples) -> set[str]:
    return {dict(lab)["model"] for (n, lab) in samples if n == "kvcached_model_info"}



@pytest.fixture
def exporter():
    with Exporter("127.0.0.1", 0) as running:
        yield running


def test_scrape_reports_each_model_with_its_labels_and_figures(spawn_allocator, exporter):
    a = spawn_allocator("alpha", engine="vllm", device=0, script="b = m.alloc(9); m.mark_cached(b[:3])")
    b = spawn_allocator("beta", engine="sglang", script="b = m.alloc(2)")
    kc.request_limit("alpha", 12 << 20, wait=5)

    samples = scrape(exporter.url)
    assert models_in(samples) == {"alpha", "beta"}
    host = socket.gethostname()
    snap = kc.snapshot("alpha")
    labels = {"model": "alpha", "engine": "vllm", "device": "0", "pid": str(a.pid), "host": host}
    assert value(samples, "kvcached_model_info", **labels, status="live", backend="host") == 1
    assert value(samples, "kvcached_held_bytes", **labels) == snap.held_bytes == 9 * snap.block_bundle_bytes
    assert value(samples, "kvcached_cached_bytes", **labels) == 3 * snap.block_bundle_bytes
    assert value(samples, "kvcached_limit_bytes", **labels) == 12 << 20
    assert value(samples, "kvcached_requested_limit_bytes", **labels) == 12 << 20
    assert value(samples, "kvcached_limit_status", **labels, status="applied") == 1
    assert value(samples, "kvcached_limit_status", **labels, status="deferred") == 0
    assert value(samples, "kvcached_waste_ratio", **labels) == pytest.approx(snap.waste_ratio)
    pages = {s: value(samples, "kvcached_pages", **labels, state=s) for s in ("inuse", "reserved", "free")}
    assert sum(pages.values()) == snap.pages_total
    assert pages["inuse"] == 3  # 9 blocks of 4 per page, packed
    assert value(samples, "kvcached_mapped_bytes", **labels) == (pages["inuse"] + pages["reserved"]) * snap.bundle_bytes
    assert value(samples, "kvcached_allocs_total", **labels) == 1
    assert value(samples, "kvcached_stale", **labels) == 0
    assert 0 <= value(samples, "kvcached_heartbeat_age_seconds", **labels) < 3

    beta = {"model": "beta", "engine": "sglang", "pid": str(b.pid)}
    assert value(samples, "kvcached_held_bytes", **beta) == 2 * snap.block_bundle_bytes
    assert value(samples, "kvcached_limit_status", **beta, status="none") == 1
    assert not [k for k in samples if k[0] == "kvcached_limit_bytes" and ("model", "beta") in k[1]]
    assert value(samples, "kvcached_models", status="live") == 2
    assert value(samples, "kvcached_nvml_up") == (1 if nvml.available() else 0)


def test_rates_come_from_count_deltas_between_scrapes(spawn_allocator, exporter):
    proc = spawn_allocator("gamma", script="held = []")
    first = scrape(exporter.url)
    assert not [k for k in first if k[0] == "kvcached_alloc_rate"]  # one observation: no rate yet
    for _ in range(5):
        send(proc, "held.append(m.alloc(1))")
    send(proc, "m.free(held.pop())")
    second = scrape(exporter.url)
    assert value(second, "kvcached_allocs_total", model="gamma") == 5
    assert value(second, "kvcached_frees_total", model="gamma") == 1
    assert value(second, "kvcached_alloc_rate", model="gamma") > value(second, "kvcached_free_rate", model="gamma") > 0
    third = scrape(exporter.url)  # nothing happened since
    assert value(third, "kvcached_alloc_rate", model="gamma") == 0


def test_a_model_that_vanishes_drops_out(spawn_allocator, exporter, shm_dir):
    keep = spawn_allocator("keep")
    gone = spawn_allocator("gone")
    dies = spawn_allocator("dies")
    assert models_in(scrape(exporter.url)) == {"keep", "gone", "dies"}

    send(gone, "m.close()")  # a clean exit unlinks its segment
    os.kill(dies.pid, signal.SIGKILL)  # a crash leaves a stale segment behind
    dies.wait()
    samples = scrape(exporter.url)
    assert models_in(samples) == {"keep", "dies"}
    assert not [k for k in samples if ("model", "gone") in k[1]]
    assert value(samples, "kvcached_stale", model="dies") == 1
    assert value(samples, "kvcached_model_info", model="dies", status="stale") == 1
    assert value(samples, "kvcached_models", status="stale") == 1

    (shm_dir / "kvc.dies").unlink()  # what `kvctl clean` does
    samples = scrape(exporter.url)
    assert models_in(samples) == {"keep"}
    assert value(samples, "kvcached_stale", model="keep") == 0
    assert keep.poll() is None


def test_refresh_interval_serves_a_cached_copy_that_follows_changes(spawn_allocator):
    proc = spawn_allocator("delta")
    with Exporter("127.0.0.1", 0, interval=0.2) as exporter:
        assert value(scrape(exporter.url), "kvcached_held_bytes", model="delta") == 0
        send(proc, "b = m.alloc(4)")
        held = wait_for(lambda: value(scrape(exporter.url), "kvcached_held_bytes", model="delta") > 0)
        assert held
        send(proc, "m.close()")
        assert wait_for(lambda: "delta" not in models_in(scrape(exporter.url)))


def test_problem_files_are_counted_and_do_not_break_a_scrape(spawn_allocator, exporter, shm_dir):
    spawn_allocator("ok")
    (shm_dir / "kvc.junk").write_bytes(b"not a segment at all")
    (shm_dir / "kvc.short").write_bytes(b"KVCSEG\x00\x01" + bytes(40))
    samples = scrape(exporter.url)
    assert models_in(samples) == {"ok"}
    assert value(samples, "kvcached_segment_problems", status="foreign") == 1
    assert value(samples, "kvcached_segment_problems", status="corrupt") == 1


def test_a_busy_port_is_a_clear_error():
    import threading

    with Exporter("127.0.0.1", 0, with_nvml=False) as first:
        before = set(threading.enumerate())
        with pytest.raises(OSError):
            Exporter("127.0.0.1", first.port, interval=0.5, with_nvml=False)
        assert set(threading.enumerate()) <= before  # nothing left running: no refresh, no loop, no worker


def test_metrics_carry_prometheus_content_type_and_head_answers_headers_only(exporter):
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    with urllib.request.urlopen(exporter.url, timeout=10) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
    head = urllib.request.Request(exporter.url, method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as response:
        assert response.status == 200 and response.read() == b""
        assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST and int(response.headers["Content-Length"]) > 0


def kvctl(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtop.cli", *args], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_kvctl_export_serves_until_sigterm(spawn_allocator):
    spawn_allocator("epsilon", script="b = m.alloc(3)")
    proc = kvctl("export", "--port", "0", "--interval", "0.2")
    try:
        line = proc.stderr.readline()
        match = re.search(r"serving (http://127\.0\.0\.1:\d+/metrics)", line)
        assert match, line
        samples = scrape(match.group(1))
        assert models_in(samples) == {"epsilon"}
        assert value(samples, "kvcached_held_bytes", model="epsilon") > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stdout.read() == ""  # stdout carries data only; a server has none
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvctl_export_answers_bad_requests_without_a_word_on_stderr():
    proc = kvctl("export", "--port", "0")
    try:
        line = proc.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line).group(1))
        for junk in (b"\x16\x03\x01garbage\r\n\r\n", b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 65536 + b"\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                answer = b""
                with contextlib.suppress(ConnectionError):  # a head over the limit may be cut off mid-send
                    sock.sendall(junk)
                    answer = sock.recv(1 << 16)
                assert answer == b"" or answer.split(b" ", 2)[1] == b"400"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200  # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stderr.read() == ""  # a stranger's bytes print no traceback on the operator's terminal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("args", "code", "message"), [
    (("--port", "70000"), 2, "Invalid value for '--port'"),
    (("--interval", "0"), 2, "Invalid value for '--interval'"),
    (("--host", "no.such.host.invalid"), 1, "cannot serve on no.such.host.invalid:"),
], ids=["port-70000", "interval-0", "host-unresolvable"])
def test_kvctl_export_bad_input(args, code, message):
    proc = kvctl("export", *args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


def test_kvctl_export_on_a_busy_port_fails_in_one_line():
    with Exporter("127.0.0.1", 0) as taken:
        proc = kvctl("export", "--port", str(taken.port))
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"cannot serve on 127.0.0.1:{taken.port}: Address already in use" in err
    assert len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.gpu
@pytest.mark.skipif(not nvml.available(), reason=f"needs an NVIDIA GPU: {nvml.unavailable_reason()}")
def test_nvml_memory_and_a_cuda_allocator_on_the_gpu(spawn_allocator, exporter):
    proc = spawn_allocator("gpu0", backend="cuda", device=0, num_blocks=1024, block_bytes=64 * 1024,
                           page_size=2 << 20, script="b = m.alloc(100)")
    samples = scrape(exporter.url)
    (gpu,) = [g for g in nvml.probe() if g.index == 0]
    labels = {"device": "0", "host": socket.gethostname()}
    assert value(samples, "kvcached_nvml_up") == 1
    assert value(samples, "kvcached_gpu_memory_total_bytes", **labels) == gpu.total_bytes > 0
    used = value(samples, "kvcached_gpu_memory_used_bytes", **labels)
    free = value(samples, "kvcached_gpu_memory_free_bytes", **labels)
    assert 0 < used <= gpu.total_bytes and 0 <= free <= gpu.total_bytes
    mapped = value(samples, "kvcached_mapped_bytes", model="gpu0", pid=str(proc.pid), device="0")
    assert value(samples, "kvcached_model_info", model="gpu0", backend="cuda") == 1
    assert mapped >= 4 * (2 << 20) * 2 * 2  # 100 blocks of 32 per page: at least 4 pages of 2 layers x K/V
    process = [v for (n, lab), v in samples.items()
               if n == "kvcached_gpu_process_memory_bytes" and ("pid", str(proc.pid)) in lab]
    if process:  # NVML lists processes only where the driver sees the container's pids
        assert process[0] >= mapped


# Models of 1 MiB page bundles under one 26 MiB host budget (as tests/test_core_pressure.py): a donor with
# 80 cached blocks, an asker that wants 40 blocks more than the budget leaves.
PRESSURE_GEOMETRY = dict(num_blocks=256, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
DONOR = """
active = m.alloc(8)
cached = m.alloc(80)
m.mark_cached(cached)
m.set_evict_handler(lambda: m.evict_for_limit())
"""
ASKER = """
import time
got = []
while len(got) < 40:
    ids = m.alloc(4)
    if ids is None:
        time.sleep(0.01)
    else:
        got.extend(ids)
"""
PRESSURE_METRICS = ("kvcached_min_bytes", "kvcached_priority", "kvcached_reclaim_given_bytes_total",
                    "kvcached_reclaim_taken_bytes_total", "kvcached_reclaims_answered_total",
                    "kvcached_reclaims_asked_total", "kvcached_wanted_bytes", "kvcached_reclaim_latency_seconds")


def test_reclaim_between_two_models_is_exported(spawn_allocator, exporter, shm_dir, monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "26MiB")
    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")
    donor = spawn_allocator("idle", script=DONOR, priority=-3, **PRESSURE_GEOMETRY)
    wait_for(lambda: kc.snapshot("idle").mapped_bytes >= 22 << 20, what="the donor's pages")
    request_policy("idle", min_bytes=4 << 20, wait=5)
    asker = spawn_allocator("busy", script=ASKER, **PRESSURE_GEOMETRY)  # READY once it holds its 40 blocks
    wait_for(lambda: kc.snapshot("busy").pressure.wanted_bytes == 0, what="the asker to be served")  # type: ignore[union-attr]
    (shm_dir / "kvcached_vllm_1234").write_bytes(L.LEGACY.pack(64 << 20, 0, 0))  # upstream: pressure unknown
    os.chmod(shm_dir / "kvcached_vllm_1234", 0o600)

    samples = scrape(exporter.url)
    idle, busy = kc.snapshot("idle").pressure, kc.snapshot("busy").pressure
    assert idle is not None and busy is not None and idle.gave_total > 0 and busy.took_total > 0
    of_idle, of_busy = {"model": "idle", "pid": str(donor.pid)}, {"model": "busy", "pid": str(asker.pid)}
    assert value(samples, "kvcached_min_bytes", **of_idle) == 4 << 20
    assert value(samples, "kvcached_priority", **of_idle) == -3
    assert value(samples, "kvcached_reclaim_given_bytes_total", **of_idle) == idle.gave_total
    assert value(samples, "kvcached_reclaims_answered_total", **of_idle) == idle.gave_count >= 1
    assert value(samples, "kvcached_reclaim_taken_bytes_total", **of_busy) == busy.took_total == idle.gave_total
    assert value(samples, "kvcached_reclaims_asked_total", **of_busy) == busy.asked_count >= 1
    assert value(samples, "kvcached_wanted_bytes", **of_busy) == 0
    assert value(samples, "kvcached_reclaim_latency_seconds", **of_busy) == pytest.approx(busy.latency_s)
    assert busy.latency_s > 0
    assert value(samples, "kvcached_min_bytes", **of_busy) == 0 and value(samples, "kvcached_priority", **of_busy) == 0
    latency = [k for k in samples if k[0] == "kvcached_reclaim_latency_seconds" and ("model", "idle") in k[1]]
    assert bool(latency) == (idle.took_count > 0)  # absent until a reclaim gave it memory, never a 0
    assert models_in(samples) == {"idle", "busy", "kvcached_vllm_1234"}
    assert not [k for k in samples if k[0] in PRESSURE_METRICS and ("model", "kvcached_vllm_1234") in k[1]]
