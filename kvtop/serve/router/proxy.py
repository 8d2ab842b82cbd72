"""The router's aiohttp application: ``/v1/models``, every ``POST /v1/...`` passed to the engine serving its
``model`` (streamed server-sent events as they come), errors in OpenAI's shape; with an API key, every route but
``/health`` answers 401 to a request without it, before anything is listed, woken or passed on."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from kvcached_core import ControlError
from kvcached_core.control import AckTimeout
from kvcached_core.settings import settings
from kvtop.serve import aioserve

from . import published
from .admission import Admission
from .directory import ASLEEP, DRAINING, GONE, Directory, Engine
from .figures import Figures

ADMISSION = web.AppKey("admission", Admission)
DIRECTORY = web.AppKey("directory", Directory)
FIGURES = web.AppKey("figures", Figures)
SESSION = web.AppKey("session", aiohttp.ClientSession)
FRESH = web.AppKey("fresh", aiohttp.ClientSession)  # a new connection for every request: the one resend
SETTINGS = web.AppKey("settings", dict)
WAKING = web.AppKey("waking", dict)
LISTENING = web.AppKey("listening", asyncio.Event)  # set once the address is bound: figures are published from then
API_KEY = web.AppKey("api_key", bytes)  # b"": no key asked
PUBLISH_S = 1.0  # how often the figures file is written
CLIENT_GONE = 499  # the status counted for a request whose client went away before it was passed on
CONNECT_TIMEOUT_S = 10.0  # an engine that accepts no connection in this long is answered 503
# An idle connection to an engine is kept this long for the next request, less than engines keep it open
# (vLLM's server: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so the router rarely takes one the engine is closing.
KEEPALIVE_S = 2.0

# Headers that belong to one connection, never passed on (RFC 9110 section 7.6.1), and the framing aiohttp sets.
HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "transfer-encoding", "upgrade", "host", "content-length"})


def error(status: int, message: str, kind: str, code: str, param: str | None = None) -> web.Response:
    """An error answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def _passed(headers: object) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP}  # type: ignore[attr-defined]


@web.middleware
async def openai_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """aiohttp's own refusals (a path no route serves, a method its route does not take, a body past the size
    limit) in OpenAI's error shape, as every other answer of the router: an OpenAI client reads ``error``."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        where = f"{request.method} {request.path}"
        if isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            response = error(405, f"Invalid method ({where}): {request.path} takes {allowed}",
                             "invalid_request_error", "method_not_allowed")
            response.headers["Allow"] = exc.headers.get("Allow", allowed)
            return response
        if isinstance(exc, web.HTTPNotFound):
            return error(404, f"Invalid URL ({where}): this router serves GET /v1/models, POST /v1/... naming a "
                         "model, GET /kvcached/figures and GET /health", "invalid_request_error", "not_found")
        return error(exc.status, f"{exc.reason} ({where}): {exc.text}" if exc.text else f"{exc.reason} ({where})",
                     "invalid_request_error", exc.reason.lower().replace(" ", "_"))


@web.middleware
async def authorized(request: web.Request, handler: Callable) -> web.StreamResponse:
    """With an API key, a request without ``Authorization: Bearer KEY`` is answered 401 before it is handled;
    ``/health`` stays open. The key is compared in constant time."""
    key = request.app[API_KEY]
    if not key or request.path == "/health":
        return await handler(request)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        response = error(401, "no API key given: send 'Authorization: Bearer KEY' with the key kvctl route was "
                         "started with", "invalid_request_error", "invalid_api_key")
    elif not hmac.compare_digest(given.strip().encode(), key):
        response = error(401, "incorrect API key given", "invalid_request_error", "invalid_api_key")
    else:
        return await handler(request)
    response.headers["WWW-Authenticate"] = 'Bearer realm="kvctl route"'
    return response


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: every model an engine serves now, with its state (live, asleep, draining)."""
    directory = request.app[DIRECTORY]
    with contextlib.suppress(OSError):
        await directory.refresh()
    data = [{"id": e.model_id, "object": "model", "created": e.seen, "owned_by": "kvcached", "state": e.state,
             "segment": e.name, "endpoint": e.endpoint, "priority": e.priority}
            for e in directory.serving()]
    return web.json_response({"object": "list", "data": data})


async def figures(request: web.Request) -> web.Response:
    """``GET /kvcached/figures``: the router's per-model figures, and the requests waiting for a place now."""
    return web.json_response({**request.app[FIGURES].to_dict(), "waiting": request.app[ADMISSION].waiting()})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _wake(app: web.Application, engine: Engine) -> str | None:
    """Wake ``engine``'s model and wait until it is awake (one wake per model, shared by its waiting requests);
    None once awake, else why not."""
    from kvcached_core.control import request_sleep

    waking: dict[str, asyncio.Future] = app[WAKING]
    future = waking.get(engine.name)
    timeout = app[SETTINGS]["wake_timeout_s"]
    if future is None:
        future = asyncio.ensure_future(asyncio.to_thread(
            request_sleep, engine.snap, "wake", wait=timeout, until_done=True))
        waking[engine.name] = future
        future.add_done_callback(lambda _f: waking.pop(engine.name, None))
    try:
        await asyncio.shield(future)
    except AckTimeout:
        return f"model {engine.model_id!r} did not wake within {timeout:g} s"
    except (ControlError, OSError) as exc:
        return f"model {engine.model_id!r} could not be woken: {exc}"
    engine.state = "live"
    return None


async def forward(request: web.Request) -> web.StreamResponse:
    """``POST /v1/...``: the request, unchanged but for ``model`` when it named a segment, to its engine."""
    app = request.app
    figs = app[FIGURES]
    raw = await request.read()
    try:
        payload = json.loads(raw)
    except ValueError:
        figs.unrouted += 1
        return error(400, "the request body is not JSON", "invalid_request_error", "invalid_json")
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str) or not model:
        figs.unrouted += 1
        return error(400, "the request names no model (a string 'model' field)", "invalid_request_error",
                     "model_required", "model")
    directory = app[DIRECTORY]
    try:
        engine = await directory.find(model)
    except OSError as exc:
        figs.unrouted += 1
        return error(503, f"the segment directory cannot be read: {exc}", "service_unavailable", "no_directory")
    if engine is None:
        figs.unrouted += 1
        skipped = directory.skipped_as(model)
        if skipped is not None:
            return error(404, f"model {model!r} {skipped.why}", "invalid_request_error", "model_not_served", "model")
        served = ", ".join(e.model_id for e in directory.serving()) or "none"
        return error(404, f"The model `{model}` does not exist (models served here: {served})",
                     "invalid_request_error", "model_not_found", "model")
    fig = figs.of(engine.name)
    fig.requests += 1
    fig.in_flight += 1
    started = time.perf_counter()
    try:
        response = await _answer(request, engine, model, payload, raw, started)
    finally:
        fig.in_flight -= 1
    if response.status >= 400:
        fig.errors += 1
    return response


async def _answer(request: web.Request, engine: Engine, model: str, payload: dict, raw: bytes,
                  started: float) -> web.StreamResponse:
    app = request.app
    fig = app[FIGURES].of(engine.name)
    if engine.state == GONE:
        return _gone_error(engine)
    admission = app[ADMISSION]
    try:  # the server cancels the handler of a client that goes away (aioserve): here, before its request is passed on
        if engine.state in (ASLEEP, DRAINING):
            fig.woken += 1
            why = await _wake(app, engine)
            if why is not None:
                return error(503, why, "service_unavailable", "wake_failed")
        if engine.served and model not in engine.served:  # a segment's name: the engine knows its served id
            payload["model"] = engine.served[0]
            raw = json.dumps(payload).encode()
        await admission.enter(engine.snap.device, engine.name, engine.priority, request_priority(payload))
    except asyncio.CancelledError:
        fig.errors += 1  # counted as the CLIENT_GONE answer below: never passed on
        raise
    try:
        if request.transport is None or request.transport.is_closing():  # the client gave up while it waited
            return web.Response(status=CLIENT_GONE, reason="Client Closed Request")
        return await _pass(request, engine, raw, started)
    finally:
        admission.leave(engine.snap.device)


def request_priority(payload: dict) -> int:
    """The request's own ``priority`` (vLLM's: lower is earlier), 0 when it gives none or not a whole number."""
    value = payload.get("priority", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def _pass(request: web.Request, engine: Engine, raw: bytes, started: float) -> web.StreamResponse:
    """The request to its engine and the answer back (server-sent events as they come)."""
    app = request.app
    fig = app[FIGURES].of(engine.name)
    url = engine.endpoint.rstrip("/") + request.rel_url.path_qs
    headers = _passed(request.headers)
    try:
        async with await _send(app, url, raw, headers) as upstream:
            out_headers = _passed(upstream.headers)
            if upstream.content_type != "text/event-stream":
                try:
                    body = await upstream.read()
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                    return _unreachable(engine, f"hung up before its answer was whole ({exc})")
                fig.latency_s.append(time.perf_counter() - started)
                return web.Response(body=body, status=upstream.status, headers=out_headers)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            first = True
            try:
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    if first:
                        fig.ttft_s.append(time.perf_counter() - started)
                        first = False
                    await response.write(chunk)
                await response.write_eof()
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                return response  # the engine hung up mid-stream: the client sees the stream end unfinished
            except ConnectionResetError:
                # The client went away (before the answer's head, or during its events): leaving this block closes
                # the engine's connection, which aborts the request.
                return response
            fig.latency_s.append(time.perf_counter() - started)
            return response
    except aiohttp.ClientConnectorError as exc:
        gone = await _gone(app, engine)
        if gone is not None:
            return gone
        errno = exc.os_error.errno
        reason = os.strerror(errno) if errno and errno > 0 else (exc.os_error.strerror or str(exc.os_error))
        return _unreachable(engine, f"cannot be reached ({reason.lower()})")
    except aiohttp.ServerTimeoutError:
        return _unreachable(engine, f"did not accept a connection within {CONNECT_TIMEOUT_S:g} s")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        gone = await _gone(app, engine)
        if gone is not None:
            return gone
        return _unreachable(engine, f"hung up ({exc})")


async def _send(app: web.Application, url: str, raw: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
    """The request to its engine, up to the answer's headers. An idle pooled connection that the engine
    closes as the router takes it (its keep-alive runs out that moment) fails before any answer: such a
    request, and only one sent on a reused connection, is sent again once, on a new connection. A request
    that failed on a new connection is not (the engine may have run it), nor a refused connection."""
    sent = SimpleNamespace(reused=False)  # set by the session's trace (_note_reuse) when a pooled one is taken
    try:
        return await app[SESSION].post(url, data=raw, headers=headers, trace_request_ctx=sent)
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        if not sent.reused:
            raise
        return await app[FRESH].post(url, data=raw, headers=headers)


async def _note_reuse(_session: aiohttp.ClientSession, context: SimpleNamespace, _params: object) -> None:
    """The session's trace: a request goes on a pooled connection (see :func:`_send`)."""
    if isinstance(context.trace_request_ctx, SimpleNamespace):
        context.trace_request_ctx.reused = True


def _unreachable(engine: Engine, what: str) -> web.Response:
    """``503 engine_unreachable``: what the engine did (``what``) instead of answering."""
    return error(503, f"model {engine.model_id!r}: its engine at {engine.endpoint} {what}", "service_unavailable",
                 "engine_unreachable")


def _gone_error(engine: Engine) -> web.Response:
    return error(503, f"model {engine.model_id!r} is not served: {engine.gone_reason}", "service_unavailable",
                 "engine_gone")


async def _gone(app: web.Application, engine: Engine) -> web.Response | None:
    """After a failed connection: the segment read again, the answer for an engine that is gone, else None."""
    directory = app[DIRECTORY]
    with contextlib.suppress(OSError):
        await directory.refresh(unless_since=time.monotonic())  # failures at once share one scan
    now = directory.engines.get(engine.name, engine)
    return _gone_error(now) if now.state == GONE else None


class Publisher:
    """The figures file (:mod:`.published`): written from a thread, removed once for good. A write under way
    when the router stops ends before the file is removed, and none starts after."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._stopped = False

    def write(self, listen: str, models: dict[str, dict]) -> None:
        with self._lock:
            if not self._stopped:
                published.write(self.directory, listen, models)

    def remove(self) -> None:
        with self._lock:
            self._stopped = True
            published.remove(self.directory)


async def _publish(app: web.Application, publisher: Publisher) -> None:
    """Once the router listens, write the figures where kvctl and the exporter read them every second, until
    cancelled (a router that could not listen writes nothing)."""
    await app[LISTENING].wait()
    while True:
        with contextlib.suppress(OSError):
            await asyncio.to_thread(publisher.write, app[SETTINGS]["listen"], app[FIGURES].by_model())
        await asyncio.sleep(PUBLISH_S)


def make_app(shm_dir: Path | None = None, *, rescan_s: float = 1.0, wake_timeout_s: float = 60.0,
             max_in_flight: int = 0, api_key: str = "") -> web.Application:
    """The router: models from the segments in ``shm_dir`` (None: KVCACHED_SHM_DIR), rescanned every ``rescan_s``;
    at most ``max_in_flight`` requests at a time to the engines of one device (0: no limit); with ``api_key``,
    only requests that carry it (``/health`` aside)."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[openai_errors, authorized])
    app[API_KEY] = api_key.encode()
    app[LISTENING] = asyncio.Event()
    app[ADMISSION] = Admission(max_in_flight)
    app[SETTINGS] = {"wake_timeout_s": wake_timeout_s, "listen": ""}
    app[FIGURES] = Figures()
    app[WAKING] = {}

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_note_reuse)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_S),
            auto_decompress=False, timeout=timeout, trace_configs=[reuse])
        fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                      auto_decompress=False, timeout=timeout)
        app[SESSION], app[FRESH] = session, fresh
        app[DIRECTORY] = directory = Directory(shm_dir, session)
        with contextlib.suppress(OSError):
            await directory.refresh()
        loop = asyncio.get_running_loop()
        publisher = Publisher(shm_dir or settings().shm_dir)
        tasks = [loop.create_task(directory.run(rescan_s)), loop.create_task(_publish(app, publisher))]
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(publisher.remove)
        await session.close()
        await fresh.close()

    app.cleanup_ctx.append(lifetime)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/kvcached/figures", figures)
    app.router.add_post("/v1/{tail:.+}", forward)
    return app


STARTUP_ASK_S = 2.0  # how long the first report waits for the engines' served ids


def serve(host: str, port: int, shm_dir: Path | None = None, *, rescan_s: float = 1.0, wake_timeout_s: float = 60.0,
          max_in_flight: int = 0, api_key: str = "", ready: Callable[[str, Directory], None] | None = None) -> int:
    """Listen on ``host:port`` until SIGINT or SIGTERM, with :func:`kvtop.serve.aioserve.serve`'s limits (a bounded
    request head and wait for it: the wait stops while a request is answered, so a long streamed answer or a slow
    engine is never cut); ``ready`` gets the URL once listening (port 0: the one the system chose) and the models
    found then. Returns the signal that stopped it (kvctl's exit code tells SIGINT from SIGTERM). OSError when
    the address cannot be bound."""
    return asyncio.run(_serve(host, port, shm_dir, rescan_s, wake_timeout_s, max_in_flight, api_key, ready))


async def _serve(host: str, port: int, shm_dir: Path | None, rescan_s: float, wake_timeout_s: float,
                 max_in_flight: int, api_key: str, ready: Callable[[str, Directory], None] | None) -> int:
    app = make_app(shm_dir, rescan_s=rescan_s, wake_timeout_s=wake_timeout_s, max_in_flight=max_in_flight,
                   api_key=api_key)
    served = await aioserve.serve(app, host, port)  # the limits every server of kvtop keeps (aioserve)
    try:
        bound = served.address
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        app[SETTINGS]["listen"] = f"http://{shown}:{bound[1]}"
        app[LISTENING].set()
        if ready is not None:
            await app[DIRECTORY].asked(STARTUP_ASK_S)
            ready(f"http://{shown}:{bound[1]}", app[DIRECTORY])
        stopped: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def stop(sig: int) -> None:
            if not stopped.done():  # the first signal says how it ended
                stopped.set_result(sig)

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        return await stopped
    finally:
        await served.close()
