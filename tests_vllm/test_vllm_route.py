"""kvctl route in front of two real vLLM engines (``vllm serve``, the tiny model, the plugin on).

The two engines start once for the module (one core each) and every test runs against them; the
engine is killed in the last test only. Each engine's segment says where it serves (the plugin
publishes vLLM's bound --host/--port), and the router finds both there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvcached_core.segment.reader import snapshot
from kvcached_vllm.tiny import prompts

from .harness import ABORTED, MAX_MODEL_LEN, Server, base_env, engine_stopped, kvctl, start_server, wait_for

NAMES = ("m0", "org/m1")  # what each engine serves (--served-model-name)
SEGMENTS = ("m0", "org_m1")  # their segments' names: kvctl's, which the router also answers to
M1 = NAMES[1]
PROMPTS = prompts(3, length=40, seed=21)
ROUTER_LOG = "route.log"  # the router's stderr, in the session's workdir
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def fleet(model_dir: Path, workdir: Path) -> Iterator[tuple[dict[str, Server], str, Path]]:
    """Two engines (m0 on core 0, org/m1 on core 1) and a router in front of them: (servers by served name, router
    URL, shm)."""
    shm = workdir / "shm-route"
    shm.mkdir()

    def start(i: int) -> Server:
        env = base_env(shm, enabled=True, VLLM_CPU_OMP_THREADS_BIND=str(i), KVCACHED_IDLE_RETURN_S="-1")
        return start_server(model_dir, env, workdir / f"serve-route-{i}.log", name=NAMES[i],
                            args=("--chat-template", CHAT_TEMPLATE, "--enable-log-requests"))  # ABORTED's lines

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(start, range(2)))
    servers = dict(zip(NAMES, started, strict=True))
    log = workdir / ROUTER_LOG
    with open(log, "w") as err:
        router = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "route", "--listen", "127.0.0.1:0", "--rescan",
                                   "0.2", "--wake-timeout", "120"], env=base_env(shm, enabled=False), stderr=err)
    try:
        found = wait_for(lambda: re.search(r"serving (http://\S+)/v1 ", log.read_text()) or router.poll(), timeout=60)
        assert isinstance(found, re.Match), log.read_text()
        yield servers, found.group(1), shm
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(timeout=30)
        for server in servers.values():
            server.stop()


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def completion(model: str, prompt: list[int], max_tokens: int = 16, **extra: object) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **extra}


def tokens(base: str, model: str, prompt: list[int], max_tokens: int = 16) -> list[int]:
    status, body = post(base + "/v1/completions", completion(model, prompt, max_tokens))
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


def test_each_engine_publishes_where_it_serves_and_the_router_lists_both(fleet) -> None:
    servers, router, shm = fleet
    for segment, server in zip(SEGMENTS, servers.values(), strict=True):
        assert snapshot(segment, directory=shm).endpoint == f"http://127.0.0.1:{server.port}"
    expected = [(name, "live", segment, f"http://127.0.0.1:{server.port}")
                for (name, server), segment in zip(servers.items(), SEGMENTS, strict=True)]
    # each listed under the id its engine serves, once the router asked it (at discovery)
    wait_for(lambda: _models(router) == expected, timeout=30)


def _models(router: str) -> list[tuple[str, str, str, str]]:
    with urllib.request.urlopen(router + "/v1/models", timeout=30) as resp:
        return [(m["id"], m["state"], m["segment"], m["endpoint"]) for m in json.load(resp)["data"]]


def test_tokens_through_the_router_equal_tokens_straight_from_the_engine(fleet) -> None:
    servers, router, _ = fleet
    for name, server in servers.items():
        for prompt in PROMPTS:
            assert tokens(router, name, prompt) == server.complete(prompt, 16)
    assert tokens(router, "org_m1", PROMPTS[0]) == servers[M1].complete(PROMPTS[0], 16)  # kvctl's name, rewritten
    chat = {"model": "m0", "messages": [{"role": "user", "content": "w10 w11 w12 w13"}], "max_tokens": 8,
            "temperature": 0}
    via, direct = post(router + "/v1/chat/completions", chat), post(servers["m0"].url("/v1/chat/completions"), chat)
    assert via[0] == direct[0] == 200, (via, direct)
    assert via[1]["choices"][0]["message"] == direct[1]["choices"][0]["message"]


async def _stream(url: str, body: dict) -> tuple[str, list[bytes], str]:
    """The streamed answer: its content type, the chunks as they arrived, the text the events carry."""
    chunks, text = [], []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in resp.content.iter_any():
            chunks.append(chunk)
        for event in b"".join(chunks).decode().split("\n\n"):
            data = event.removeprefix("data: ").strip()
            if data and data != "[DONE]":
                text.append(json.loads(data)["choices"][0]["text"])
        return resp.content_type, chunks, "".join(text)


def test_streaming_passes_the_engines_events_through(fleet) -> None:
    servers, router, shm = fleet
    body = completion(M1, PROMPTS[0], 24, stream=True)
    kind, chunks, text = asyncio.run(_stream(router + "/v1/completions", body))
    _, direct_chunks, direct_text = asyncio.run(_stream(servers[M1].url("/v1/completions"), body))
    assert kind == "text/event-stream"
    assert text == direct_text and text.split() and len(text.split()) == 24
    assert b"".join(chunks).rstrip().endswith(b"data: [DONE]")
    # Event by event as the engine sent them, not one body at the end: the first event reaches the client while
    # org/m1's engine, stopped once it has generated a token, still holds the request (2000 tokens); a router that
    # held the body back until the end would send nothing then. Counting chunks did not prove it (a client kept off
    # the CPU reads many events at once), nor the time of the first event (a starved API server once sent a whole
    # answer in one burst after the engine ran it out).
    for _ in range(3):  # again when the stop came after the request ended
        # From an idle engine, its figures final: the requests above (and an earlier try's, aborted) end in the
        # engine after their clients have their answers, and a look taken before would count them as this one's.
        before = wait_for(lambda: (t := _traffic(shm, "org_m1")).running == 0 and t.waiting == 0 and t, timeout=120)
        client = _send(router, completion(M1, PROMPTS[0], MAX_MODEL_LEN - len(PROMPTS[0]), stream=True))
        try:
            wait_for(lambda b=before: (t := _traffic(shm, "org_m1")).running == 1
                     and t.generated_tokens > b.generated_tokens or t.finished > b.finished, timeout=120)
            with engine_stopped(servers[M1]):  # (stopped inside a publish, it reads late: its traffic as published)
                now = _traffic(shm, "org_m1")
                if now.running == 1 and now.finished == before.finished:
                    assert b"\ndata: " in _read_until(client, b"\ndata: ", timeout=60)
                    return
        finally:
            _hang_up(client)
    pytest.fail("org/m1's long request ended before its engine could be stopped, three times")


def test_a_sleeping_model_is_woken_by_a_request_and_answers(fleet) -> None:
    servers, router, shm = fleet
    env = base_env(shm, enabled=False)
    expected = servers[M1].complete(PROMPTS[1], 16)
    kvctl("sleep", "org_m1", "--wait", env=env)
    assert snapshot("org_m1", directory=shm).sleep.state == "asleep"
    wait_for(lambda: _state(router, M1) == "asleep", timeout=30)
    assert tokens(router, "org_m1", PROMPTS[1]) == expected  # named as kvctl names it: the router says org/m1
    assert snapshot("org_m1", directory=shm).sleep.state == "awake"
    with urllib.request.urlopen(router + "/kvcached/figures", timeout=30) as resp:
        assert json.load(resp)["models"]["org_m1"]["woken"] >= 1


def _state(router: str, model: str) -> str | None:
    with urllib.request.urlopen(router + "/v1/models", timeout=30) as resp:
        return next((m["state"] for m in json.load(resp)["data"] if m["id"] == model), None)


def test_an_unknown_model_is_a_404_in_openai_shape(fleet) -> None:
    _, router, _ = fleet
    status, body = post(router + "/v1/completions", completion("nosuch", PROMPTS[0]))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "m0, org/m1" in body["error"]["message"]


async def _many(router: str, count: int) -> list[tuple[int, int | str]]:
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, int | str]:
        body = completion(NAMES[i % 2], PROMPTS[i % len(PROMPTS)][: 8 + i % 16], 4)
        async with session.post(router + "/v1/completions", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:  # the error's message, for the failure
                return resp.status, str(answer.get("error", answer))
            return resp.status, len(answer["choices"][0]["token_ids"])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(count)))


def test_two_hundred_concurrent_requests_lose_none(fleet) -> None:
    _, router, _ = fleet
    answers = asyncio.run(_many(router, 200))
    assert answers == [(200, 4)] * 200, [a for a in answers if a != (200, 4)][:5]
    with urllib.request.urlopen(router + "/kvcached/figures", timeout=30) as resp:
        figures = json.load(resp)["models"]
    assert all(figures[name]["in_flight"] == 0 for name in SEGMENTS)


def test_a_client_that_goes_away_mid_stream_ends_the_engines_request(fleet, workdir: Path) -> None:
    """The client reads the first event and goes away; the router closes its connection to the engine, whose API
    server aborts the request before its tokens run out. m0's engine is stopped from that first event until its API
    server has passed the abort on (its log says so): a starved router and API server once took longer to pass the
    hang-up on than the engine took to run all 1,800 tokens."""
    servers, router, shm = fleet
    m0 = servers["m0"]
    for _ in range(3):  # again when the request ran out before its engine could be stopped
        # From an idle engine, its figures final (the requests of earlier tests end after their clients go).
        before = wait_for(lambda: (t := _traffic(shm, "m0")).running == 0 and t.waiting == 0 and t, timeout=120)
        client = _send(router, completion("m0", PROMPTS[0], 1800, stream=True))  # about 10 s of tokens
        try:
            assert b"\ndata: " in _read_until(client, b"\ndata: ", timeout=120)
            with engine_stopped(m0):
                if _traffic(shm, "m0").finished != before.finished:
                    continue  # its tokens ran out first: this try proves nothing
                aborted = m0.log.read_text().count(ABORTED)
                _hang_up(client)
                wait_for(lambda n=aborted: m0.log.read_text().count(ABORTED) > n, timeout=120)
        finally:
            _hang_up(client)
        ended = wait_for(lambda b=before: (t := _traffic(shm, "m0")).running == 0 and t.waiting == 0
                         and t.finished > b.finished and t, timeout=120)
        # the engine aborted the request before its tokens ran out
        assert ended.generated_tokens - before.generated_tokens < 1800, (before, ended)
        assert "Traceback" not in (workdir / ROUTER_LOG).read_text()
        assert tokens(router, "m0", PROMPTS[1]) == tokens(router, "m0", PROMPTS[1])  # and it serves on
        return
    pytest.fail("m0's long request ran out before its engine could be stopped, three times")


def _figures(router: str) -> dict:
    with urllib.request.urlopen(router + "/kvcached/figures", timeout=30) as resp:
        return json.load(resp)


def test_a_freed_place_goes_to_the_model_of_highest_priority(fleet, workdir: Path) -> None:
    """A second router with --max-in-flight 1: a long m0 request holds the device's one place, an m0 request and
    then an org/m1 request (policy priority 10 over m0's 0) wait; org/m1's goes first although it came later.
    Its body's priority (3) reaches an engine that schedules first come, first served, which answers as usual.
    A third m0 request whose client gives up while it waits never reaches the engine."""
    servers, _, shm = fleet
    env = base_env(shm, enabled=False)
    assert snapshot("m0", directory=shm).device == snapshot("org_m1", directory=shm).device  # one device's place
    kvctl("policy", "org_m1", "--priority", "10", env=env)
    log = workdir / "route-limited.log"
    with open(log, "w") as err:
        router_proc = subprocess.Popen([sys.executable, "-m", "kvtop.cli", "route", "--listen", "127.0.0.1:0",
                                        "--rescan", "0.2", "--max-in-flight", "1"], env=env, stderr=err)
    try:
        found = wait_for(lambda: re.search(r"serving (http://\S+)/v1 ", log.read_text()) or router_proc.poll(),
                         timeout=60)
        assert isinstance(found, re.Match), log.read_text()
        router = found.group(1)
        wait_for(lambda: {(m["id"], m["priority"]) for m in json.load(urllib.request.urlopen(router + "/v1/models"))[
            "data"]} == {("m0", 0), (M1, 10)}, timeout=30)
        done: list[str] = []

        def send(label: str, body: dict) -> tuple[int, dict]:
            answer = post(router + "/v1/completions", body)
            done.append(label)
            return answer

        # The long m0 request holds the router's one place until the test lets it go: once m0's engine runs it (its
        # segment says so), m0's processes (API server and engine core) are stopped until org/m1 is answered, so it
        # can neither end nor free the place, however fast or slow the host. Closing its connection frees the place
        # (the router drops it; vLLM aborts it once continued). Its 2000 tokens once ran out in 6 s on an idle host,
        # before org/m1 was sent; a loaded host once let the engine run them all before the first event came.
        group = servers["m0"].proc.pid  # the server leads a session of its own: its engine core is in the group
        long, finished = _hold_stopped(router, shm, group)
        stopped = True
        with ThreadPoolExecutor(2) as pool:
            try:  # closed before the pool waits for the others, which wait behind it
                late_m0 = pool.submit(send, "m0", completion("m0", PROMPTS[1], 16))
                wait_for(lambda: _figures(router)["waiting"] == {"m0": 1}, timeout=30)
                try:  # gives up and closes its connection
                    given_up = post(router + "/v1/completions", completion("m0", PROMPTS[2], 16), timeout=1)
                except TimeoutError:
                    given_up = None
                assert given_up is None, f"answered instead of waiting: {given_up}, {_figures(router)}, {done}"
                m1 = pool.submit(send, "org/m1", completion(M1, PROMPTS[2], 16, priority=3))
                # org/m1 waits beside m0's late request (the one given up on counts until the router drops it)
                def m1_waits() -> bool:
                    assert not m1.done(), f"org/m1 was answered without waiting: {m1.result()}, {_figures(router)}"
                    return _figures(router)["waiting"].get("org_m1") == 1

                wait_for(m1_waits, timeout=30)
                assert _figures(router)["waiting"].get("m0") in (1, 2)
                _hang_up(long)  # its place is freed: it goes to org/m1, of the higher model priority
                m1_answer = m1.result(timeout=120)  # m0's late request, still waiting or sent to the stopped server
                os.killpg(group, signal.SIGCONT)
                stopped = False
                answers = [late_m0.result(timeout=120), m1_answer]
            finally:
                if stopped:
                    os.killpg(group, signal.SIGCONT)
                _hang_up(long)
        assert [status for status, _ in answers] == [200, 200], answers
        assert done == ["org/m1", "m0"]
        assert answers[1][1]["choices"][0]["token_ids"] == servers[M1].complete(PROMPTS[2], 16)
        wait_for(lambda: _figures(router)["waiting"] == {}, timeout=30)
        assert _figures(router)["models"]["m0"]["errors"] == 1  # the one given up on: 499, never passed on
        wait_for(lambda: snapshot("m0", directory=shm).traffic.finished >= finished + 2, timeout=30)
        assert snapshot("m0", directory=shm).traffic.finished == finished + 2  # the long one (aborted), the late one
    finally:
        router_proc.send_signal(signal.SIGINT)
        router_proc.wait(timeout=30)
        kvctl("policy", "org_m1", "--priority", "0", env=env)
    assert "Traceback" not in log.read_text()


def _traffic(shm: Path, segment: str) -> Any:
    traffic = snapshot(segment, directory=shm, with_pages=False).traffic
    assert traffic is not None
    return traffic


def _send(router: str, body: dict) -> socket.socket:
    """``body`` posted to the router's /v1/completions on a raw connection, its answer left unread."""
    url = urllib.parse.urlsplit(router)
    client = socket.create_connection((url.hostname, url.port), timeout=30)
    data = json.dumps(body).encode()
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return client


def _read_until(client: socket.socket, marker: bytes, timeout: float) -> bytes:
    """What the connection brought until ``marker`` came, it closed, or ``timeout`` passed."""
    received = b""
    client.settimeout(timeout)
    with contextlib.suppress(TimeoutError):
        while marker not in received and (chunk := client.recv(65536)):
            received += chunk
    return received


def _hold_stopped(router: str, shm: Path, group: int) -> tuple[socket.socket, int]:
    """A long streamed m0 request sent through the router, and m0's process group stopped while its engine runs it:
    (the client's connection, left unread; m0's finished count before the request). Sent again, at most twice,
    when it ended before the stop."""
    for _ in range(3):
        finished = _traffic(shm, "m0").finished
        client = _send(router, completion("m0", PROMPTS[0], MAX_MODEL_LEN - len(PROMPTS[0]), stream=True))
        wait_for(lambda before=finished: (t := _traffic(shm, "m0")).running >= 1 or t.finished > before, timeout=120)
        os.killpg(group, signal.SIGSTOP)
        try:
            after = _traffic(shm, "m0")
        except BlockingIOError:  # stopped inside a publish: it was running at the look above, a step ago
            return client, finished
        if after.running >= 1 and after.finished == finished:
            return client, finished
        os.killpg(group, signal.SIGCONT)  # it ended first: again
        _hang_up(client)
    raise AssertionError("m0's long request ended before its engine could be stopped, three times")


def _hang_up(client: socket.socket) -> None:
    with contextlib.suppress(OSError):
        client.shutdown(socket.SHUT_RDWR)  # the router sees the client go at once
    client.close()


def test_a_killed_engine_is_a_503_while_the_other_is_still_served(fleet) -> None:
    """Last in the module: it kills org/m1's engine."""
    servers, router, _ = fleet
    os.killpg(servers[M1].proc.pid, signal.SIGKILL)  # the server and its EngineCore and worker, at once
    servers[M1].proc.wait()
    status, body = post(router + "/v1/completions", completion(M1, PROMPTS[0]))
    assert status == 503 and body["error"]["code"] in ("engine_gone", "engine_unreachable"), body
    assert "m1" in body["error"]["message"]
    wait_for(lambda: post(router + "/v1/completions", completion(M1, PROMPTS[0]))[1]["error"]["code"]
             == "engine_gone", timeout=30)
    assert tokens(router, "m0", PROMPTS[2]) == servers["m0"].complete(PROMPTS[2], 16)
    assert _state(router, M1) is None and _state(router, "m0") == "live"
