"""kvctl route against real allocators (the answers that need no engine behind them) and its bad input.

Requests that reach a real engine (tokens, streaming, waking, a killed engine, 200 at once) are in
tests_vllm/test_vllm_route.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import child_env, wait_for

from kvcached_core.segment.reader import snapshot

SLEEPER = """
import threading
def handler(action):
    if action.startswith("sleep"):
        threading.Thread(target=m.sleep.ready).start()
m.set_sleep_handler(handler)
"""


def kvctl(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvtop.cli", *args], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def router(shm_dir) -> Iterator[str]:
    """A running ``kvctl route`` on a free port, rescanning every 0.1 s: its base URL."""
    proc = kvctl("route", "--listen", "127.0.0.1:0", "--rescan", "0.1", "--wake-timeout", "10")
    line = proc.stderr.readline()
    found = re.search(r"serving (http://\S+)/v1 ", line)
    assert found, line + proc.stderr.read() if proc.poll() is not None else line
    yield found.group(1)
    proc.terminate()
    assert proc.wait(timeout=10) == 0
    assert not list(shm_dir.glob(".kvroute.*"))  # its figures file goes with it


def call(url: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nobody listens there once the socket is closed


def test_models_come_and_go_with_their_segments(router, spawn_allocator):
    assert call(router + "/v1/models") == (200, {"object": "list", "data": []})
    proc = spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    spawn_allocator("m2")  # publishes no endpoint: nothing to send requests to
    status, listed = call(router + "/v1/models")
    assert status == 200 and [(m["id"], m["state"], m["segment"]) for m in listed["data"]] == [("m1", "live", "m1")]
    proc.kill()
    proc.wait()
    wait_for(lambda: call(router + "/v1/models")[1]["data"] == [], what="the killed model to leave /v1/models")


def test_unknown_model_and_bad_bodies_get_openai_errors(router, spawn_allocator):
    spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    assert call(router + "/v1/models")[1]["data"][0]["id"] == "m1"
    status, body = call(router + "/v1/completions", {"model": "nosuch", "prompt": "hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert "`nosuch` does not exist" in body["error"]["message"] and "m1" in body["error"]["message"]
    assert call(router + "/v1/chat/completions", b"{not json")[0] == 400
    status, body = call(router + "/v1/completions", {"prompt": "no model"})
    assert status == 400 and body["error"]["code"] == "model_required"


@pytest.mark.parametrize(("method", "path", "status", "code", "allow"), [
    ("GET", "/nope", 404, "not_found", None),
    ("POST", "/v2/completions", 404, "not_found", None),
    ("GET", "/v1/completions", 405, "method_not_allowed", "POST"),
    ("DELETE", "/health", 405, "method_not_allowed", "GET,HEAD"),
    ("PUT", "/v1/models", 405, "method_not_allowed", "GET,HEAD,POST"),
], ids=["unknown-path", "unknown-version", "get-completions", "delete-health", "put-models"])
def test_a_wrong_path_or_method_gets_openai_error_json(router, method, path, status, code, allow):
    """Every answer of an OpenAI-compatible endpoint is OpenAI's error object, with the right status; aiohttp's own
    answer was plain text (``404: Not Found``), which an OpenAI client cannot read."""
    req = urllib.request.Request(router + path, method=method, data=b"{}" if method in ("POST", "PUT") else None)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    answer = refused.value
    assert answer.code == status
    assert answer.headers["Content-Type"].startswith("application/json")
    assert answer.headers.get("Allow") == allow
    body = json.load(answer)
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"]
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code
    assert body["error"]["param"] is None and f"({method} {path})" in body["error"]["message"]


def test_an_engine_that_cannot_be_reached_or_is_gone_is_a_503_with_the_reason(router, spawn_allocator):
    port = closed_port()
    proc = spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{port}')\n")
    status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
    assert status == 503 and body["error"]["code"] == "engine_unreachable"
    assert f"127.0.0.1:{port} cannot be reached (connection refused)" in body["error"]["message"]
    proc.kill()  # the segment stays behind, stale
    proc.wait()
    status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
    assert status == 503 and body["error"]["code"] == "engine_gone"
    assert f"its engine (pid {proc.pid}) has exited" in body["error"]["message"]
    figures = call(router + "/kvcached/figures")[1]
    assert figures["models"]["m1"]["requests"] == 2 and figures["models"]["m1"]["errors"] == 2


def test_a_request_wakes_a_sleeping_model(router, spawn_allocator):
    spawn_allocator("m1", script=SLEEPER + f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    assert kvctl("sleep", "m1", "--wait").wait(timeout=30) == 0
    assert snapshot("m1").sleep.state == "asleep"
    wait_for(lambda: call(router + "/v1/models")[1]["data"][0]["state"] == "asleep", what="asleep in /v1/models")
    status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
    assert snapshot("m1").sleep.state == "awake"  # woken before the request went on (to no engine here: 503)
    assert status == 503 and body["error"]["code"] == "engine_unreachable"
    assert call(router + "/kvcached/figures")[1]["models"]["m1"]["woken"] == 1


def test_a_segment_too_busy_to_read_keeps_its_engine_routed(router, spawn_allocator, shm_dir):
    """A writer stopped inside a publish (its sequence odd): every read of its segment gives up busy. The engine is
    still there, so requests still go to it (here a closed port: 503 engine_unreachable); the old router took the
    busy segment for a removed one, dropped the model from /v1/models and answered 503 engine_gone."""
    import os
    import signal

    from conftest import freeze

    from kvcached_core.segment import layout as L

    proc = spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    assert [m["id"] for m in call(router + "/v1/models")[1]["data"]] == ["m1"]
    freeze(proc.pid)
    fd = os.open(shm_dir / "kvc.m1", os.O_RDWR)
    (seq,) = L.U64.unpack(os.pread(fd, 8, L.SEQ_OFF))
    try:
        os.pwrite(fd, L.U64.pack(seq | 1), L.SEQ_OFF)  # inside a publish, and it stays there
        status, listed = call(router + "/v1/models")  # rescans first: the segment reads busy
        assert status == 200 and [(m["id"], m["state"]) for m in listed["data"]] == [("m1", "live")], listed
        status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "engine_unreachable", body
    finally:
        os.pwrite(fd, L.U64.pack(seq), L.SEQ_OFF)
        os.close(fd)
        os.kill(proc.pid, signal.SIGCONT)


class ClosingEngine(socketserver.ThreadingTCPServer):
    """An HTTP engine that answers the first request of each connection (keeping it open) and closes the
    connection, unanswered, when a second request comes on it: what an engine does when its keep-alive runs
    out just as the router sends on the idle connection (vLLM's closes idle connections after 5 s)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answers: int = 1) -> None:
        super().__init__(("127.0.0.1", 0), ClosingEngineHandler)
        self.answers = answers  # requests answered on each connection before the next one is dropped
        self.cut = False  # each answer to a POST stops halfway and the connection closes
        self.answered: list[str] = []  # "METHOD path" of each request answered
        self.dropped: list[str] = []  # and of each dropped unanswered


def read_request(rfile: io.BufferedIOBase) -> bytes:
    """One HTTP request read off ``rfile``, its head and its body: its request line (b"" once the client closed)."""
    line = rfile.readline()
    if not line:
        return line
    length = 0
    while (header := rfile.readline()) not in (b"\r\n", b""):
        name, _, value = header.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    rfile.read(length)
    return line


class ClosingEngineHandler(socketserver.StreamRequestHandler):
    server: ClosingEngine

    def handle(self) -> None:
        for number in range(self.server.answers + 1):
            line = read_request(self.rfile)
            if not line:
                return
            said = " ".join(line.decode().split()[:2])
            if number == self.server.answers:
                self.server.dropped.append(said)
                return  # closed unanswered
            self.server.answered.append(said)
            body = json.dumps({"object": "list", "data": [{"id": "m1"}]} if line.startswith(b"GET")
                              else {"object": "text_completion", "choices": [{"text": "ok"}]}).encode()
            cut = self.server.cut and line.startswith(b"POST")  # half the answer said, then the connection closed
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:len(body) // 2] if cut else body))
            self.wfile.flush()
            if cut:
                return


def test_a_connection_the_engine_closes_as_it_is_reused_is_sent_again_on_a_new_one(router, spawn_allocator):
    """The old router answered 503 engine_unreachable ('hung up') whenever it sent on an idle connection the
    engine closed at that moment: a request a client would have had answered on a new connection."""
    engine = ClosingEngine()
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        host, port = engine.server_address[:2]
        spawn_allocator("m1", script=f"m.publish_endpoint('http://{host}:{port}')\n")
        answers = [call(router + "/v1/completions", {"model": "m1", "prompt": "hi"}) for _ in range(4)]
        assert [status for status, _ in answers] == [200] * 4, answers
        assert engine.dropped  # the router did send on a connection the engine then closed
        assert engine.answered.count("POST /v1/completions") == 4
        figures = call(router + "/kvcached/figures")[1]["models"]["m1"]
        assert figures["requests"] == 4 and figures["errors"] == 0
    finally:
        engine.shutdown()
        engine.server_close()


def test_a_request_that_fails_on_a_new_connection_is_not_sent_again(router, spawn_allocator):
    """The engine may have run it: an engine that drops every request unanswered gets each one once, and the
    client is told the engine hung up."""
    engine = ClosingEngine(answers=0)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        host, port = engine.server_address[:2]
        spawn_allocator("m1", script=f"m.publish_endpoint('http://{host}:{port}')\n")
        status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "engine_unreachable" and "hung up" in body["error"]["message"]
        time.sleep(0.5)  # a resend would have come by now
        assert engine.dropped.count("POST /v1/completions") == 1 and not engine.answered
    finally:
        engine.shutdown()
        engine.server_close()


def test_an_engine_that_hangs_up_halfway_through_its_answer_is_a_503_not_a_500(router, spawn_allocator):
    """The old router let aiohttp's ClientPayloadError out of the handler: 500 Internal Server Error, a traceback
    in its log."""
    engine = ClosingEngine()
    engine.cut = True
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        host, port = engine.server_address[:2]
        spawn_allocator("m1", script=f"m.publish_endpoint('http://{host}:{port}')\n")
        status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "engine_unreachable", body
        assert "hung up before its answer was whole" in body["error"]["message"]
    finally:
        engine.shutdown()
        engine.server_close()


@pytest.mark.parametrize(("args", "code", "message"), [
    (("--listen", "8080"), 2, "'8080' is not HOST:PORT"),
    (("--listen", "127.0.0.1:65536"), 2, "is not a whole number from 0 to 65535"),
    (("--listen", "::1:8080"), 2, "an IPv6 address goes in brackets ([::1]:8080)"),
    (("--listen", "[localhost]:8080"), 2, "in brackets is not an IPv6 address"),
    (("--rescan", "0"), 2, "'0' is out of range"),
    (("--wake-timeout", "soon"), 2, "'soon' is not a number"),
    (("--listen", "no.such.host.invalid:8080", "--no-auth"), 1, "cannot serve on no.such.host.invalid:8080"),
    (("--max-in-flight", "-1"), 2, "-1 is not in the range x>=0"),
], ids=["listen-no-port", "listen-port-65536", "listen-ipv6-bare", "listen-brackets-not-ipv6", "rescan-0",
        "wake-timeout-word", "listen-unresolvable", "max-in-flight-negative"])
def test_kvctl_route_bad_input(args, code, message, shm_dir):
    proc = kvctl("route", *args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


def test_kvctl_route_on_a_busy_port_fails_in_one_line(shm_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = kvctl("route", "--listen", f"127.0.0.1:{port}")
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in err
    assert len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_ends_the_router_with_130_and_sigterm_with_0(sig, code, shm_dir, procs):
    """As docs/kvctl.md's exit codes say, and as watch, demo and record end. Started as from a terminal (default
    signal dispositions, its own process group: also when the test run ignores SIGINT, a background job), the
    signal sent to the whole group as a terminal's Ctrl-C is."""
    proc = procs.start([sys.executable, "-m", "kvtop.cli", "route", "--listen", "127.0.0.1:0"], env=child_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().startswith("kvctl route: serving http://127.0.0.1:")
    wait_for(lambda: list(shm_dir.glob(".kvroute.*")), what="the router's figures file")
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert out == "" and "Traceback" not in err
    assert not list(shm_dir.glob(".kvroute.*"))  # it cleaned up as it ended


def test_the_router_drops_a_client_that_trickles_its_request_head(router):
    """The router serves with kvtop.serve.aioserve's limits: a connection that never finishes its request head is closed
    at the head deadline, however steadily it trickles bytes; other clients are served meanwhile and after."""
    from kvtop.serve.aioserve import HEAD_TIMEOUT_S

    host, port = router.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        dropped = False
        deadline = time.monotonic() + 3 * HEAD_TIMEOUT_S
        while not dropped and time.monotonic() < deadline:  # a header byte at a time, never the blank line
            try:
                slow.sendall(b"X")
                slow.settimeout(0.1)
                dropped = slow.recv(1 << 16) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                dropped = True
        assert dropped, "the router kept a connection that never sent a whole request head"
    with urllib.request.urlopen(f"{router}/health", timeout=30) as resp:
        assert resp.status == 200


def test_the_router_answers_name_no_library_or_python_version(router, spawn_allocator):
    spawn_allocator("named")
    for path in ("/health", "/v1/models", "/nowhere"):
        try:
            with urllib.request.urlopen(f"{router}{path}", timeout=30) as resp:
                server = resp.headers["Server"]
        except urllib.error.HTTPError as exc:
            server = exc.headers["Server"]
        assert server == "kvtop", (path, server)


def test_only_segments_of_this_user_kept_private_are_routed(router, spawn_allocator, shm_dir):
    """A segment file others could have written (not 0600, or another owner's) may name any address: no request
    goes there, since requests carry prompts."""
    spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    assert [m["id"] for m in call(router + "/v1/models")[1]["data"]] == ["m1"]
    (shm_dir / "kvc.m1").chmod(0o622)
    assert call(router + "/v1/models")[1]["data"] == []
    status, body = call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})
    assert status == 503 and "no longer private to this user" in body["error"]["message"]


def router_key_table() -> dict[str, str]:
    """docs/json.md's router keys -> their documented types."""
    from test_docs_reference import DOCS, names, table

    return {name: row[1] for row in table(DOCS / "json.md", "router key") for name in names(row[0])}


def listed_router(name: str, *args: str) -> tuple[object, str]:
    from conftest import kvctl as kvctl_in_process

    done = kvctl_in_process("list", "--json", *args)
    (row,) = [r for r in json.loads(done.stdout) if r["name"] == name]
    return row["router"], done.stderr


def test_router_figures_reach_kvctl_and_the_exporter(router, spawn_allocator, shm_dir):
    from test_core_words import exported

    spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    spawn_allocator("m2", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    for _ in range(3):
        assert call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})[0] == 503
    figures = wait_for(lambda: (f := listed_router("m1")[0]) and f["requests"] == 3 and f, what="published figures")
    assert (figures["errors"], figures["in_flight"], figures["woken"]) == (3, 0, 0)
    assert figures["latency_p50_s"] is None and figures["ttft_p99_s"] is None  # no answer came from an engine
    assert listed_router("m2")[0] is None  # no request yet: the router has no figures for it
    documented = router_key_table()
    assert {"router", *(f"router.{k}" for k in figures)} == set(documented)
    from test_docs_reference import TYPES
    for key, value in figures.items():
        assert type(value) in tuple(TYPES[t.strip()] for t in documented[f"router.{key}"].split("|")), key
    shown = json.loads(subprocess.run([sys.executable, "-m", "kvtop.cli", "show", "m1", "--json"], env=child_env(),
                                      capture_output=True, text=True, check=True).stdout)
    assert shown["router"]["requests"] == 3
    samples = {(s.name, s.labels.get("model")): s.value for s in exported("m1")}
    assert samples[("kvcached_router_requests_total", "m1")] == 3
    assert samples[("kvcached_router_errors_total", "m1")] == 3
    assert samples[("kvcached_router_in_flight", "m1")] == 0


def untrusted_files() -> float:
    from kvtop.serve.exporter import KVCachedCollector

    (value,) = [s.value for family in KVCachedCollector(with_nvml=False).collect() for s in family.samples
                if s.name == "kvcached_router_untrusted_files"]
    return value


def test_forged_router_figures_are_not_trusted(shm_dir, spawn_allocator):
    from test_core_words import exported

    from kvcached_core.segment.procinfo import start_time

    spawn_allocator("m1")
    pid = os.getpid()  # a process that runs, as a forger would name
    good = {"version": 1, "pid": pid, "start_time": start_time(pid), "listen": "http://127.0.0.1:1", "written_ns": 1,
            "models": {"m1": {"requests": 5, "errors": 0, "in_flight": 0, "woken": 0, "ttft_p50_s": None,
                              "ttft_p99_s": None, "latency_p50_s": 0.1, "latency_p99_s": 0.2}}}
    path = shm_dir / f".kvroute.{pid}"
    path.write_text(json.dumps(good))
    path.chmod(0o600)
    assert listed_router("m1")[0]["requests"] == 5  # the shape a router writes, from a running process
    for forged in ({**good, "models": {"m1": {**good["models"]["m1"], "requests": -1}}},
                   {**good, "models": {"m1": {**good["models"]["m1"], "latency_p99_s": 1e30}}},
                   {**good, "extra": 1}, {**good, "pid": pid + 1}):
        path.write_text(json.dumps(forged))
        figures, err = listed_router("m1", "--all")
        assert figures is None and "router figures not trusted" in err, forged
        assert untrusted_files() == 1 and not [s for s in exported("m1") if "router" in s.name]
    path.write_text(json.dumps(good))
    path.chmod(0o644)  # others could have written it
    figures, err = listed_router("m1", "--all")
    assert figures is None and "not a private file of this user" in err
    path.chmod(0o600)
    path.write_text(json.dumps({**good, "start_time": start_time(pid) + 1}))  # its router has exited
    figures, err = listed_router("m1", "--all")
    assert figures is None and "router" not in err and untrusted_files() == 0


def test_kvctl_show_and_kvtop_details_say_the_endpoint_and_the_router_figures(router, spawn_allocator):
    from kvtop_pilot import drive, seen, until
    from rich.console import Console
    from textual.pilot import Pilot

    from kvtop.frames.source import LiveSource
    from kvtop.screen.dashboard import KvtopApp
    from kvtop.screen.widgets import DetailsScreen

    port = closed_port()
    spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{port}')\n")
    assert call(router + "/v1/completions", {"model": "m1", "prompt": "hi"})[0] == 503
    wait_for(lambda: listed_router("m1")[0], what="published figures")
    shown = subprocess.run([sys.executable, "-m", "kvtop.cli", "show", "m1"], env=child_env(), capture_output=True,
                           text=True, check=True).stdout
    assert f"endpoint     http://127.0.0.1:{port}\n" in shown
    assert re.search(r"router       1 requests, 1 errors, 0 in flight, 0 woke it; TTFT p50/p99 -/- ms", shown)
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: seen(app, "m1") and app.selected == "m1" and app.frame.router.get("m1"),
                    "m1 and its router figures")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, DetailsScreen), "the details")
        details = app.screen
        assert isinstance(details, DetailsScreen) and details.router is not None
        assert details.router["requests"] == 1
        console = Console(width=200, file=io.StringIO(), record=True)
        for widget in details.query("Static"):
            console.print(widget.content)
        text = console.export_text()
        assert f"http://127.0.0.1:{port}" in text and "1 requests, 1 errors" in text

    drive(app, script)


def test_kvctl_clean_removes_the_figures_of_a_killed_router_only(router, shm_dir):
    """A router that stops removes its file; one that was killed leaves it, and kvctl clean takes it."""
    from conftest import kvctl as kvctl_in_process

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = shm_dir / f".kvroute.{gone.pid}"
    left.write_text("{}")
    left.chmod(0o600)
    running = wait_for(lambda: [p for p in shm_dir.glob(".kvroute.*") if p != left], what="the live router's file")
    done = kvctl_in_process("clean")
    assert done.exit_code == 0
    assert f"removed {left} (kvctl route figures, pid {gone.pid} gone, 2 B)" in done.stdout
    assert not left.exists() and all(p.exists() for p in running)  # the running router's file stays


def test_v1_models_says_each_models_priority_and_figures_the_requests_waiting(router, spawn_allocator):
    from kvcached_core.control.policy import request_policy

    spawn_allocator("m1", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    spawn_allocator("m2", script=f"m.publish_endpoint('http://127.0.0.1:{closed_port()}')\n")
    request_policy("m1", priority=7, wait=5)
    wait_for(lambda: [(m["id"], m["priority"]) for m in call(router + "/v1/models")[1]["data"]]
             == [("m1", 7), ("m2", 0)], what="the policy priorities in /v1/models")
    assert call(router + "/kvcached/figures")[1]["waiting"] == {}  # no --max-in-flight: nobody ever waits


def test_a_freed_place_goes_to_the_highest_model_priority_then_the_lowest_request_priority():
    """The router's admission (kvtop.serve.router.admission) with one place on device 0: three requests wait behind the
    one holding it; each freed place goes to the next by (model priority high first, request priority low first,
    arrival), a cancelled waiter is passed over, and another device has its own place."""
    import asyncio

    from kvtop.serve.router.admission import Admission

    async def scenario() -> tuple[list[str], dict[str, int], dict[str, int]]:
        admission = Admission(1)
        order: list[str] = []

        async def one(label: str, model: str, model_priority: int, request_priority: int, device: int = 0) -> None:
            await admission.enter(device, model, model_priority, request_priority)
            order.append(label)

        await one("first", "batch", 0, 0)  # holds device 0's place
        waiting = [asyncio.create_task(one(*args)) for args in (
            ("batch late", "batch", 0, 0), ("chat prio 5", "chat", 10, 5), ("gone", "chat", 10, -1),
            ("chat prio 1", "chat", 10, 1))]
        await asyncio.sleep(0)
        await one("other device", "code", 0, 0, device=1)  # device 1's place is free: no wait behind device 0
        seen = admission.waiting()
        waiting[2].cancel()
        await asyncio.sleep(0)
        for _ in range(3):
            admission.leave(0)
            await asyncio.sleep(0)
        await asyncio.gather(*waiting, return_exceptions=True)
        return order, seen, admission.waiting()

    order, seen, after = asyncio.run(scenario())
    assert order == ["first", "other device", "chat prio 1", "chat prio 5", "batch late"]
    assert seen == {"batch": 1, "chat": 3} and after == {}


class SilentEngine(socketserver.ThreadingTCPServer):
    """An engine that starts streaming its first answer, one event, and then sends nothing more until the
    other end closes the connection (a long prefill, a stalled engine); every later answer is whole."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), SilentEngineHandler)
        self.posts = 0  # requests passed on to it
        self.hung_up = threading.Event()  # the connection of the silent answer was closed by the router


class SilentEngineHandler(socketserver.StreamRequestHandler):
    server: SilentEngine

    def handle(self) -> None:
        line = read_request(self.rfile)
        if line.startswith(b"GET"):
            body = json.dumps({"object": "list", "data": [{"id": "m1"}]}).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            return
        self.server.posts += 1
        first = self.server.posts == 1
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         b'data: {"choices": [{"text": "a"}]}\n\n')
        self.wfile.flush()
        if first:
            if self.rfile.read(1) == b"":  # nothing more comes from the router: it closed the connection
                self.server.hung_up.set()
            return
        self.wfile.write(b"data: [DONE]\n\n")


def test_a_client_gone_while_its_engine_is_silent_frees_its_place_at_once(spawn_allocator):
    """With one place, a streamed request whose client goes away while its engine sends nothing: the router closes
    the engine's connection (the engine aborts it) and the waiting request gets the place. The old router noticed
    the client only when the engine next wrote: the place stayed held and the waiting request never went on."""
    engine = SilentEngine()
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    proc = kvctl("route", "--listen", "127.0.0.1:0", "--rescan", "0.1", "--max-in-flight", "1")
    try:
        found = re.search(r"serving (http://\S+)/v1 ", proc.stderr.readline())
        assert found
        router = found.group(1)
        host, port = engine.server_address[:2]
        spawn_allocator("m1", script=f"m.publish_endpoint('http://{host}:{port}')\n")
        wait_for(lambda: call(router + "/v1/models")[1]["data"], timeout=30)
        url = urllib.parse.urlsplit(router)
        held = socket.create_connection((url.hostname, url.port))
        body = json.dumps({"model": "m1", "prompt": "hi", "stream": True}).encode()
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        first = b""
        while b"data:" not in first:
            chunk = held.recv(4096)
            assert chunk, first
            first += chunk
        later: list[tuple[int, dict | str]] = []

        def send_later() -> None:
            req = urllib.request.Request(router + "/v1/completions", data=json.dumps(
                {"model": "m1", "prompt": "hi", "stream": True}).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                later.append((resp.status, resp.read().decode()))

        waiter = threading.Thread(target=send_later)
        waiter.start()
        wait_for(lambda: call(router + "/kvcached/figures")[1]["waiting"] == {"m1": 1}, timeout=30)
        held.shutdown(socket.SHUT_RDWR)
        held.close()
        assert engine.hung_up.wait(timeout=30), "the router kept the silent engine's connection"
        waiter.join(timeout=60)
        assert later and later[0][0] == 200 and "[DONE]" in later[0][1], later
        assert engine.posts == 2
        figures = call(router + "/kvcached/figures")[1]
        assert figures["waiting"] == {} and figures["models"]["m1"]["in_flight"] == 0
        assert figures["models"]["m1"]["errors"] == 0  # a client gone mid-answer is no error of the router's
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        engine.shutdown()
        engine.server_close()
