"""A few fixed pages served over HTTP by aiohttp, on one asyncio loop in a daemon thread.

aiohttp parses the requests and :mod:`kvtop.serve.aioserve` bounds them (head size, the wait for a head,
the listen backlog); what is this module's own is how a page is made. A page is made in a worker
thread once for every request that arrived while no making of it had started yet: a request
never gets a page read before it arrived, and a burst of 50 costs at most two makings (the one
running when it began, and one for all that came during it). One event loop parks every
connection for the price of a few objects (a thread per connection made 50 scrapers arriving
together wait for one another: benchmarks/results/exporter-load-2cpu.md).

The server answers ``GET`` and ``HEAD`` (the query string ignored), one request per connection
(``Connection: close``); another method is 405, an unknown path the ``not_found`` page, a page
that cannot be made 500.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from kvtop.serve.aioserve import BACKLOG, HEAD_TIMEOUT_S, Served, serve


@dataclass(frozen=True)
class Page:
    """What one path answers: a status line, a content type, and a function making the body."""

    status: str
    content_type: str
    body: Callable[[], bytes]

    @property
    def code(self) -> int:
        return int(self.status.split(None, 1)[0])


NOT_FOUND = Page("404 Not Found", "text/plain; charset=utf-8", lambda: b"not found\n")
NOT_ALLOWED = Page("405 Method Not Allowed", "text/plain; charset=utf-8", lambda: b"only GET and HEAD\n")
UNMADE = Page("500 Internal Server Error", "text/plain; charset=utf-8", lambda: b"the page could not be made\n")


class _Making:
    """One page's makings: whether one runs, and the future that requests arriving now will get."""

    def __init__(self) -> None:
        self.running = False
        self.next: asyncio.Future[bytes] | None = None


class PageServer:
    """Serves ``pages[path]`` until :meth:`close`; ``port`` is the bound port. OSError when it cannot bind."""

    def __init__(self, host: str, port: int, pages: dict[str, Page], not_found: Page = NOT_FOUND,
                 *, head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
        self.pages = pages
        self.not_found = not_found
        self.backlog = BACKLOG
        self._makings: dict[str, _Making] = {}
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        try:
            self._served: Served = self._loop.run_until_complete(
                serve(app, host, port, head_timeout_s=head_timeout_s))
        except BaseException:
            self._loop.run_until_complete(self._loop.shutdown_default_executor())  # its name lookup's thread
            self._loop.close()
            raise
        self.port: int = self._served.address[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcached-exporter-http", daemon=True)
        self._thread.start()

    async def _handle(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            page, body = NOT_ALLOWED, NOT_ALLOWED.body()
        else:
            key = request.path if request.path in self.pages else ""
            page = self.pages.get(key, self.not_found)
            try:
                body = await self._body(key)
            except Exception:  # noqa: BLE001 - the page could not be made: say so, keep serving
                page, body = UNMADE, UNMADE.body()
        headers = {"Content-Type": page.content_type}
        if page is NOT_ALLOWED:
            headers["Allow"] = "GET, HEAD"
        response = web.Response(status=page.code, body=body, headers=headers)
        response.force_close()
        return response

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
        work = self._loop.run_in_executor(None, self.pages.get(key, self.not_found).body)

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

    def close(self) -> None:
        """Stop accepting, stop the loop and release the port."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._served.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
