"""kvctl route over kvctl demo: a real demo fleet (each model serving its toy OpenAI-compatible endpoint), a real
router process, real HTTP. Also the router's API key and what it refuses at startup.

Every process is started in its own process group with SIGINT and SIGQUIT at their defaults, and ended by its
fixture (or a finally) even when the test fails."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from conftest import child_env, wait_for

from kvcached_core.segment.reader import snapshot
from kvtop.demo.fleet import DemoFleet

LLAMA = "demo-llama-3-8b"


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``kvctl ARGS`` in its own process group, with default signal dispositions whatever the test inherited."""
    return subprocess.Popen([sys.executable, "-m", "kvtop.cli", *args], env=child_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_default_signals)


def end(proc: subprocess.Popen) -> None:
    """End ``proc``'s process group: SIGTERM, then SIGKILL if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def fleet() -> Iterator[DemoFleet]:
    """Three demo models (kvctl demo's), each serving its endpoint; stopped at teardown."""
    demo = DemoFleet(3)
    try:
        demo.start()
        assert demo.wait_ready(timeout=60), demo.failure
        yield demo
    finally:
        demo.stop()


@pytest.fixture
def route() -> Iterator[Callable[..., tuple[str, list[str]]]]:
    """Start ``kvctl route`` on a free loopback port: its base URL and its startup report's lines."""
    procs: list[subprocess.Popen] = []

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
        proc = start("route", "--listen", "127.0.0.1:0", "--rescan", "0.1", "--wake-timeout", "30", *args, env=env)
        procs.append(proc)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stderr or ()],
                         daemon=True).start()
        report: list[str] = []
        deadline = time.monotonic() + 30
        while not report or not report[-1].startswith("  serving:"):  # the report's last line says what is served
            try:
                report.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"the router's startup report did not end with what it serves: {report}") from None
        found = re.search(r"serving (http://\S+)/v1 ", report[0])
        assert found, report
        return found.group(1), report

    yield run
    for proc in procs:
        end(proc)


def call(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def completion(model: str = LLAMA, **extra: object) -> dict:
    return {"model": model, "prompt": "Where does the memory go", "max_tokens": 8, **extra}


def sleep_model(name: str) -> None:
    proc = start("sleep", name, "--wait", "30")
    try:
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        end(proc)
    assert snapshot(name).sleep.state == "asleep"


def test_route_over_the_demo_lists_its_models_and_answers_a_completion(fleet, route):
    url, report = route()
    assert report[-1] == "  serving: " + ", ".join(f"{n} (live)" for n in sorted(fleet.names()))
    status, listed = call(url + "/v1/models")
    assert status == 200 and isinstance(listed, dict)
    assert sorted(m["id"] for m in listed["data"]) == sorted(fleet.names())
    before = snapshot(LLAMA).traffic
    status, body = call(url + "/v1/completions", completion())
    assert status == 200 and isinstance(body, dict), body
    assert body["model"] == LLAMA and len(body["choices"][0]["text"].split()) == 8
    assert body["usage"]["completion_tokens"] == 8
    traffic = snapshot(LLAMA).traffic  # the request moved the model's traffic figures
    assert traffic is not None and traffic.finished == (before.finished if before else 0) + 1
    assert traffic.generated_tokens >= 8
    # streamed, in OpenAI's server-sent events, through the router
    req = urllib.request.Request(url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": LLAMA, "max_tokens": 4, "stream": True,
                                                  "messages": [{"role": "user", "content": "hi"}]}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert len("".join(pieces).split()) == 4
    assert call(url + "/health") == (200, "ok")


def test_a_demo_model_answers_a_wrong_path_or_method_in_openai_error_json(fleet, route):
    """Through the router (a POST /v1/... naming a model goes on to its engine) and at the model's own endpoint."""
    url, _ = route()
    endpoint = snapshot(LLAMA).endpoint
    assert endpoint is not None
    for target, method, body, status in ((url + "/v1/embeddings", "POST", {"model": LLAMA, "input": "hi"}, 404),
                                         (endpoint + "/v1/nope", "GET", None, 404),
                                         (endpoint + "/v1/completions", "GET", None, 405)):
        req = urllib.request.Request(target, method=method, headers={"Content-Type": "application/json"},
                                     data=None if body is None else json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == status, target
        assert refused.value.headers["Content-Type"].startswith("application/json"), target
        error = json.load(refused.value)["error"]
        assert sorted(error) == ["code", "message", "param", "type"] and error["code"] == status, target
        assert error["message"].startswith(("Invalid URL (", "Invalid method (")), error


def test_a_sleeping_demo_model_is_woken_by_a_request(fleet, route):
    url, _ = route()
    sleep_model(LLAMA)
    assert snapshot(LLAMA).mapped_bytes == 0
    status, body = call(url + "/v1/completions", completion())
    assert status == 200, body
    assert snapshot(LLAMA).sleep.state == "awake"
    status, figures = call(url + "/kvcached/figures")
    assert isinstance(figures, dict) and figures["models"][LLAMA]["woken"] == 1


def test_with_a_key_a_request_without_it_gets_401_and_wakes_nothing(fleet, route):
    url, report = route(env={"KVCTL_ROUTE_API_KEY": "s3cret-key"})
    assert report[0].endswith("requests need the API key")
    sleep_model(LLAMA)
    for key in (None, "wrong-key", "s3cret-key-and-more"):
        status, body = call(url + "/v1/completions", completion(), key=key)
        assert status == 401 and isinstance(body, dict), (key, body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
        assert call(url + "/v1/models", key=key)[0] == 401
    assert snapshot(LLAMA).sleep.state == "asleep"  # nothing was woken
    assert call(url + "/health") == (200, "ok")  # open, and says nothing of the models
    status, listed = call(url + "/v1/models", key="s3cret-key")
    assert status == 200 and isinstance(listed, dict)
    assert {m["id"]: m["state"] for m in listed["data"]}[LLAMA] == "asleep"
    status, body = call(url + "/v1/completions", completion(), key="s3cret-key")
    assert status == 200, body
    assert snapshot(LLAMA).sleep.state == "awake"


def test_a_key_from_a_file(tmp_path, fleet, route):
    keyfile = tmp_path / "key"
    keyfile.write_text("from-a-file\n")
    url, _ = route("--api-key-file", str(keyfile))
    assert call(url + "/v1/completions", completion())[0] == 401
    assert call(url + "/v1/completions", completion(), key="from-a-file")[0] == 200


@pytest.mark.parametrize(("args", "env", "message"), [
    (("--listen", "0.0.0.0:0"), {}, "listening on 0.0.0.0 serves other hosts: give a key"),
    (("--listen", "[::]:0"), {}, "listening on :: serves other hosts: give a key"),
    (("--listen", "0.0.0.0:0", "--no-auth"), {"KVCTL_ROUTE_API_KEY": "k"}, "give it or a key, not both"),
    (("--api-key-file", "/nonexistent/key"), {}, "--api-key-file /nonexistent/key: No such file or directory"),
    (("--api-key", "two words"), {}, "printable characters without blanks"),
], ids=["any-v4-no-key", "any-v6-no-key", "no-auth-and-key", "key-file-missing", "key-blank"])
def test_a_router_that_would_serve_strangers_or_has_a_bad_key_is_refused_in_one_line(args, env, message, shm_dir):
    proc = start("route", *args, env=env)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        end(proc)
    assert proc.returncode == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == "" and not list(shm_dir.iterdir())


IN_CREATE, IN_MOVED_TO, IN_NONBLOCK = 0x100, 0x80, 0o4000


def test_a_router_on_a_busy_port_writes_nothing_in_the_segment_directory(shm_dir):
    """Watched with inotify: not even a file created and removed again (the figures file was written before the
    address was bound, from a thread that could outlive the removal and leave it behind)."""
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(IN_NONBLOCK)
    assert fd >= 0
    try:
        assert libc.inotify_add_watch(fd, str(shm_dir).encode(), IN_CREATE | IN_MOVED_TO) >= 0
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            proc = start("route", "--listen", f"127.0.0.1:{port}")
            try:
                out, err = proc.communicate(timeout=30)
            finally:
                end(proc)
        assert proc.returncode == 1 and f"cannot serve on 127.0.0.1:{port}: Address already in use" in err
        assert len(err.strip().splitlines()) == 1 and out == ""
        with pytest.raises(BlockingIOError):
            os.read(fd, 4096)  # no event: nothing was created there
        assert not list(shm_dir.iterdir())
    finally:
        os.close(fd)


def test_a_model_that_publishes_no_address_is_told_so(route, spawn_allocator, fleet):
    spawn_allocator("plain")  # a model kvctl list shows, whose engine serves no HTTP
    wait_for(lambda: snapshot("plain").status == "live", what="plain to be live")
    url, report = route()
    assert "  skipped: plain: publishes no serving address (its engine serves no HTTP endpoint)" in report
    status, body = call(url + "/v1/completions", completion("plain"))
    assert status == 404 and isinstance(body, dict)
    assert body["error"]["code"] == "model_not_served" and body["error"]["param"] == "model"
    assert body["error"]["message"] == ("model 'plain' publishes no serving address (its engine serves no HTTP "
                                        "endpoint)")
    assert "plain" not in [m["id"] for m in call(url + "/v1/models")[1]["data"]]  # type: ignore[index]
