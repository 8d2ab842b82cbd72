"""Serving an aiohttp application on a TCP port with the project's limits.

aiohttp parses HTTP; this module adds what a port that strangers may reach needs and aiohttp leaves
to its user, in one place for every server of the project:

- a bounded request head: the request line and each header field at most :data:`HEAD_LIMITS` bytes,
  at most 32 header fields (aiohttp answers 400 past them, never calling a handler);
- a bounded wait for it: a connection that has not sent a whole request head ``head_timeout_s``
  seconds after it opened (or after its previous answer) is closed, however slowly it trickles
  bytes. aiohttp's own keep-alive timer bounds only idle connections, and only in its newest
  releases, so a slow client would otherwise hold its socket for as long as it likes;
- a listen backlog that holds a burst of clients (the kernel's usual 5 made them wait out SYN
  retries of 1, 3, 7 s);
- no access log and no signal handlers: the command that serves decides how it stops;
- a handler whose client goes away is cancelled (aiohttp's ``handler_cancellation``): a router request
  waiting on an engine that sends nothing lets go of its place and its engine's connection at once,
  instead of when the engine next writes;
- a ``Server`` header that names no versions (aiohttp's default tells a stranger its and Python's);
- a request that is not HTTP, or breaks a limit, is answered 400 and logged at debug level only: a
  stranger's bytes never print a traceback on the operator's terminal.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

HEAD_LIMITS: dict[str, Any] = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 32}
HEAD_TIMEOUT_S = 10.0  # how long a connection may take to send a whole request head
BACKLOG = 1024  # pending connections the kernel holds
SHUTDOWN_TIMEOUT_S = 5.0  # how long closing waits for the requests being answered
SERVER_NAME = "kvtop"  # the Server header of every answer


class _ClientFaults(logging.Filter):
    """Lowers aiohttp's report of a request it could not parse (the client's fault) to debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], HttpProcessingError):
            return record.levelno <= logging.DEBUG
        return True


LOG = logging.getLogger("kvtop.http")
LOG.addFilter(_ClientFaults())


class _Deadlines:
    """One timer per connection, running while no request of it is being handled."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._timers: dict[asyncio.BaseTransport, asyncio.TimerHandle | None] = {}

    def arm(self, transport: asyncio.BaseTransport) -> None:
        self.disarm(transport)
        self._timers[transport] = asyncio.get_running_loop().call_later(self.seconds, transport.close)

    def disarm(self, transport: asyncio.BaseTransport) -> None:
        timer = self._timers.get(transport)
        if timer is not None:
            timer.cancel()
            self._timers[transport] = None

    def forget(self, transport: asyncio.BaseTransport) -> None:
        self.disarm(transport)
        self._timers.pop(transport, None)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """A whole head arrived: no deadline while it is answered; the next head gets a new one."""
        transport = request.transport
        if transport is None or transport not in self._timers:
            return await handler(request)
        self.disarm(transport)
        try:
            return await handler(request)
        finally:
            if transport in self._timers and not transport.is_closing():
                self.arm(transport)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the connection's head deadline around it."""

    def __init__(self, inner: asyncio.Protocol, deadlines: _Deadlines) -> None:
        self._inner = inner
        self._deadlines = deadlines
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._deadlines.arm(transport)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._deadlines.forget(self._transport)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


async def _plain_server_header(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


class Served:
    """An application listening on a port until :meth:`close`."""

    def __init__(self, runner: web.AppRunner, listener: asyncio.Server) -> None:
        self._runner = runner
        self._listener = listener
        self.address: tuple[str, int] = listener.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        """Stop accepting, answer or drop the connections still open, and release the port."""
        self._listener.close()
        await self._runner.cleanup()
        await self._listener.wait_closed()


async def serve(app: web.Application, host: str, port: int, *, backlog: int = BACKLOG,
                head_timeout_s: float = HEAD_TIMEOUT_S) -> Served:
    """Listen on ``host:port`` (port 0: one the system picks; a name binds its first address only, so that
    port 0 means one port) and serve ``app`` with the limits above. OSError when the address cannot be bound."""
    deadlines = _Deadlines(head_timeout_s)
    app.middlewares.append(deadlines.middleware)
    app.on_response_prepare.append(_plain_server_header)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                           logger=LOG, handler_cancellation=True, **HEAD_LIMITS)
    await runner.setup()
    server = runner.server
    assert server is not None
    try:
        loop = asyncio.get_running_loop()
        family = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))[0][0]
        listener = await loop.create_server(lambda: _Guarded(server(), deadlines), host, port, family=family,
                                            backlog=backlog, reuse_address=True)
    except BaseException:
        await runner.cleanup()
        raise
    return Served(runner, listener)
