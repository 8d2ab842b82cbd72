"""The exporter's HTTP server: fresh pages shared by requests that arrive together, bounded requests."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvtop.serve.http_page import Page, PageServer


def raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


class SlowCounter:
    """A page body that takes a while and says which making it was."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.made = 0
        self.started = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        with self._lock:
            self.made += 1
            number = self.made
        self.started.set()
        time.sleep(self.seconds)
        return b"making %d" % number


@pytest.fixture
def slow(request: pytest.FixtureRequest) -> tuple[PageServer, SlowCounter]:
    counter = SlowCounter(getattr(request, "param", 0.4))  # seconds a making takes
    server = PageServer("127.0.0.1", 0, {"/p": Page("200 OK", "text/plain", counter)})
    yield server, counter
    server.close()


@pytest.mark.parametrize("slow", [2.0], indirect=True)  # long enough for ten threads to connect under load
def test_a_request_arriving_while_the_page_is_made_gets_the_next_making(slow) -> None:
    server, counter = slow
    answers: dict[str, bytes] = {}
    first = threading.Thread(target=lambda: answers.__setitem__("first", raw(server.port, b"GET /p HTTP/1.0\r\n\r\n")))
    first.start()
    assert counter.started.wait(10)
    late = [threading.Thread(target=lambda i=i: answers.__setitem__(f"late{i}", raw(server.port, b"GET /p HTTP/1.0\r\n\r\n")))
            for i in range(10)]
    for t in late:
        t.start()
    for t in [first, *late]:
        t.join()
    assert answers["first"].endswith(b"making 1")
    # Read after they arrived (never the making already under way), and all ten share one making.
    assert {answers[f"late{i}"].rsplit(b"\r\n\r\n", 1)[1] for i in range(10)} == {b"making 2"}
    assert counter.made == 2


def test_head_unknown_paths_other_methods_and_garbage_get_plain_answers(slow) -> None:
    server, counter = slow
    assert raw(server.port, b"HEAD /p HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200 OK")
    head = raw(server.port, b"HEAD /p HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.endswith(b"\r\n\r\n") and b"\r\nContent-Length: 8\r\n" in head  # the body's length, no body
    assert b"\r\nContent-Type: text/plain\r\n" in head and b"\r\nConnection: close\r\n" in head
    assert raw(server.port, b"GET /nope HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404")
    not_allowed = raw(server.port, b"POST /p HTTP/1.1\r\nHost: x\r\n\r\n")
    assert not_allowed.startswith(b"HTTP/1.1 405") and b"\r\nAllow: GET, HEAD\r\n" in not_allowed
    assert raw(server.port, b"GET /p HTTP/1.1\r\n\r\n").split(b" ", 2)[1] == b"400"  # HTTP/1.1 needs a Host
    assert raw(server.port, b"\x16\x03\x01garbage\r\n\r\n").split(b" ", 2)[1] == b"400"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/p?x=1", timeout=30) as response:
        assert response.read().startswith(b"making")


def test_a_client_that_never_finishes_its_request_holds_up_nobody(slow) -> None:
    server, _ = slow
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        idle.sendall(b"GET /p HTTP/1.1\r\n")  # and never the blank line
        assert raw(server.port, b"GET /p HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")
    huge = b"GET /p HTTP/1.1\r\nX: " + b"a" * (64 * 1024)
    try:
        answer = raw(server.port, huge)
    except ConnectionError:
        answer = b""
    assert not answer.startswith(b"HTTP/1.1 200")  # a head over the limit is dropped, never served


def test_a_client_that_trickles_its_request_head_is_dropped_at_the_deadline() -> None:
    server = PageServer("127.0.0.1", 0, {"/p": Page("200 OK", "text/plain", lambda: b"page")}, head_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as slow:
            slow.sendall(b"GET /p HTTP/1.1\r\n")
            dropped = False
            deadline = time.monotonic() + 60
            while not dropped and time.monotonic() < deadline:  # a header byte at a time, never the blank line
                try:
                    slow.sendall(b"X")
                    slow.settimeout(0.1)
                    dropped = slow.recv(1 << 16) == b""
                except TimeoutError:
                    continue
                except ConnectionError:
                    dropped = True
            assert dropped  # the server closed it: the trickle does not keep resetting a timer
            assert raw(server.port, b"GET /p HTTP/1.0\r\n\r\n").endswith(b"page")
    finally:
        server.close()


def test_a_page_that_cannot_be_made_is_a_500_and_the_server_keeps_serving() -> None:
    calls = []

    def broken() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return b"fine"

    server = PageServer("127.0.0.1", 0, {"/p": Page("200 OK", "text/plain", broken)})
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/p", timeout=30)
        assert err.value.code == 500
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/p", timeout=30) as response:
            assert response.read() == b"fine"
    finally:
        server.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()  # the port is released


def test_answers_name_no_library_or_python_version() -> None:
    server = PageServer("127.0.0.1", 0, {"/p": Page("200 OK", "text/plain", lambda: b"x")})
    try:
        for request in (b"GET /p HTTP/1.0\r\n\r\n", b"GET /nowhere HTTP/1.0\r\n\r\n"):
            head = raw(server.port, request).split(b"\r\n\r\n", 1)[0].lower()
            assert b"\r\nserver: kvtop" in head
            assert b"aiohttp" not in head and b"python" not in head
    finally:
        server.close()
