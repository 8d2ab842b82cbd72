"""A small HTTP/1.x server for a few fixed pages, on one asyncio loop in a daemon thread.

Why not a thread per connection (``socketserver``): 50 scrapers arriving together meant 50
threads started and 50 WSGI handlers fighting for one interpreter, so the last scrape waited
for all the others (benchmarks/exporter_load.py measures it; benchmarks/results/exporter-load-2cpu.md
has both designs under the same load). One
event loop parks every connection for the price of a few objects, and each answer is a single
write. A page is made in a worker thread once for every request that arrived while no making of
it had started yet: a request never gets a page read before it arrived, and a burst of 50 costs
at most two makings (the one running when it began, and one for all that came during it).

The server answers ``GET`` and ``HEAD`` only, one request per connection (``Connection: close``),
with a bounded request head and a bounded wait for it, so a slow or hostile client holds
nothing but its own socket.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

HEAD_LIMIT = 16 * 1024  # bytes of request line and headers a client may send
HEAD_TIMEOUT_S = 10.0  # how long a connection may take to send them
BACKLOG = 128  # pending connections the kernel holds; its usual 5 made scrapers wait out SYN retries


@dataclass(frozen=True)
class Page:
    """What one path answers: a status line, a content type, and a function making the body."""

    status: str
    content_type: str
    body: Callable[[], bytes]


NOT_FOUND = Page("404 Not Found", "text/plain; charset=utf-8", lambda: b"not found\n")
ERRORS = {
    "400": Page("400 Bad Request", "text/plain; charset=utf-8", lambda: b"bad request\n"),
    "405": Page("405 Method Not Allowed", "text/plain; charset=utf-8", lambda: b"only GET and HEAD\n"),
    "500": Page("500 Internal Server Error", "text/plain; charset=utf-8", lambda: b"the page could not be made\n"),
}


class _Making:
    """One page's makings: whether one runs, and the future that requests arriving now will get."""

    def __init__(self) -> None:
        self.running = False
        self.next: asyncio.Future[bytes] | None = None


class PageServer:
    """Serves ``pages[path]`` (the query string ignored) until :meth:`close`; ``port`` is the bound port."""

    def __init__(self, host: str, port: int, pages: dict[str, Page], not_found: Page = NOT_FOUND) -> None:
        self.pages = pages
        self.not_found = not_found
        self.backlog = BACKLOG
        self._makings: dict[str, _Making] = {}
        self._loop = asyncio.new_event_loop()
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(
                self._handle, host, port, family=family, backlog=BACKLOG, reuse_address=True, limit=HEAD_LIMIT))
        except BaseException:
            self._loop.close()
            raise
        self.port: int = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcached-exporter-http", daemon=True)
        self._thread.start()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                return
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                await self._answer(writer, "400", True)
                return
            method, target = parts[0], parts[1].split(b"?", 1)[0].decode("latin-1")
            version = "HTTP/1.0" if parts[2] == b"HTTP/1.0" else "HTTP/1.1"  # answer a 1.0 client in its own
            if method not in (b"GET", b"HEAD"):
                await self._answer(writer, "405", True, version)
                return
            if target not in self.pages:
                target = ""
            await self._answer(writer, target, method == b"GET", version)
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _page(self, key: str) -> Page:
        if key in self.pages:
            return self.pages[key]
        return ERRORS.get(key, self.not_found)

    def _body(self, key: str) -> asyncio.Future[bytes]:
        """The body a request arriving now gets: the next making of its page (started now if none runs)."""
        making = self._makings.setdefault(key, _Making())
        if making.next is None:
            making.next = self._loop.create_future()
        promised = making.next
        if not making.running:
            self._start(key, making)
        return promised

    def _start(self, key: str, making: _Making) -> None:
        assert making.next is not None
        promised, making.next, making.running = making.next, None, True
        work = self._loop.run_in_executor(None, self._page(key).body)

        def finished(done: asyncio.Future[bytes]) -> None:
            making.running = False
            error = done.exception()
            if error is not None:
                promised.set_exception(error)
            else:
                promised.set_result(done.result())
            if making.next is not None:  # requests came while this one was being made
                self._start(key, making)

        work.add_done_callback(finished)

    async def _answer(self, writer: asyncio.StreamWriter, key: str, with_body: bool,
                      version: str = "HTTP/1.1") -> None:
        page = self._page(key)
        try:
            body = await self._body(key)
        except Exception:  # noqa: BLE001 - the page could not be made: say so, keep serving
            page, body = ERRORS["500"], b"the page could not be made\n"
        head = (f"{version} {page.status}\r\nContent-Type: {page.content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
        writer.write(head + body if with_body else head)
        await writer.drain()

    def close(self) -> None:
        """Stop accepting, stop the loop and release the port."""
        async def shut() -> None:
            self._server.close()
            await self._server.wait_closed()

        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
