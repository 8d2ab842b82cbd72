"""A demo model's OpenAI-compatible server: a toy generator behind the routes a real engine serves.

Each demo model (:mod:`kvtop.demo.fleet`) serves on 127.0.0.1 at a port the system picks and publishes the
address in its segment, as a real engine does, so ``kvctl route`` finds it:

- ``GET /v1/models``: the model's name;
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: deterministic words (the same prompt gives the
  same text), ``max_tokens`` of them (16 when absent), streamed in OpenAI's server-sent events with
  ``"stream": true``;
- ``GET /health``: 200.

A request is traffic as the simulated one is: its prompt's blocks are allocated at once
(:data:`TOKENS_PER_BLOCK` tokens a block), one more block as each fills while it generates, all freed when
it ends; the model's traffic figures (running, finished, tokens) count it. A request for a sleeping model
wakes it first, as a serving engine's first request does. The server runs its own event loop in a thread
beside the model's simulated traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

if TYPE_CHECKING:
    from kvcached_core import KVCacheManager

TOKENS_PER_BLOCK = 16
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS = 4096
TOKEN_S = 0.01  # the time one token takes to generate
WORDS = ("page", "block", "cache", "memory", "model", "token", "limit", "trim", "sleep", "wake", "pool",
         "map", "device", "prefix", "budget", "request", "engine", "kernel", "segment", "router")


def words(prompt: str, count: int) -> list[str]:
    """``count`` words, the same for the same prompt."""
    seed = hashlib.sha256(prompt.encode()).digest()
    out = []
    for i in range(count):
        if i and i % 32 == 0:
            seed = hashlib.sha256(seed).digest()
        out.append(WORDS[seed[i % 32] % len(WORDS)])
    return out


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


@web.middleware
async def _openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (no such path, a method the path does not take) in OpenAI's error shape, as every
    other answer of the server."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        where = f"{request.method} {request.path}"
        if isinstance(exc, web.HTTPMethodNotAllowed):
            response = _error(405, f"Invalid method ({where}): {request.path} takes "
                              f"{', '.join(sorted(exc.allowed_methods))}")
            response.headers["Allow"] = exc.headers.get("Allow", "")
            return response
        if isinstance(exc, web.HTTPNotFound):
            return _error(404, f"Invalid URL ({where})", "NotFoundError")
        return _error(exc.status, f"{exc.reason} ({where})")


class DemoEngine(Protocol):
    """What the server needs of its demo model (kvtop.demo.DemoEngine): its allocator, and a request's blocks."""

    manager: KVCacheManager

    def take_request(self, blocks: int) -> list[int] | None: ...


class Traffic:
    """What the server's requests add to the model's traffic figures (published in its segment)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.finished = self.prompt_tokens = self.generated_tokens = 0
        self.last_request_ns = 0


class DemoServer:
    """The OpenAI-compatible server of one demo model (``demo``), in a thread; ``start`` publishes its URL."""

    def __init__(self, model: str, demo: DemoEngine) -> None:
        self.model, self.demo = model, demo
        self.traffic = Traffic()
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> DemoServer:
        """Listen on 127.0.0.1 (a free port) and publish the address in the model's segment; OSError when it
        cannot listen."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="demo-server", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        self.demo.manager.publish_endpoint(self.url)
        return self

    async def _listen(self) -> None:
        app = web.Application(middlewares=[_openai_errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        """Stop serving (requests in flight are cut) and end the thread."""
        loop, runner, thread = self._loop, self._runner, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)

    def __enter__(self) -> DemoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- routes ---------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "kvtop-demo"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        if body.get("model") != self.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
        prompt = _prompt(body, chat)
        if prompt is None:
            what = "'messages' (a list of {role, content})" if chat else "'prompt' (a string or a list of strings)"
            return _error(400, f"the request has no {what}", param="messages" if chat else "prompt")
        max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS:
            return _error(400, f"max_tokens must be a whole number from 1 to {MAX_TOKENS}, not {max_tokens!r}",
                          param="max_tokens")
        prompt_tokens = max(1, len(prompt.split()))
        blocks = await asyncio.to_thread(self._begin, prompt_tokens)
        if blocks is None:
            return _error(503, f"model {self.model!r} has no room for the prompt's KV blocks now", "server_error")
        reply = Reply(self, chat, words(prompt, max_tokens), prompt_tokens, blocks)
        try:
            if body.get("stream") is True:
                return await reply.stream(request)
            return web.json_response(await reply.whole())
        finally:
            await asyncio.to_thread(self._end, reply)

    # -- the model's side -------------------------------------------------------------------------
    def _begin(self, prompt_tokens: int) -> list[int] | None:
        """The request arrives: the model woken if asleep, the prompt's blocks allocated (None: no room)."""
        blocks = self.demo.take_request(-(-prompt_tokens // TOKENS_PER_BLOCK))
        if blocks is not None:
            t = self.traffic
            with t.lock:
                t.running += 1
                t.prompt_tokens += prompt_tokens
                t.last_request_ns = time.time_ns()
                self._publish()
        return blocks

    def grow(self, reply: Reply) -> bool:
        """One more token: a new block when the last one is full; False when no block can be had."""
        if reply.generated % TOKENS_PER_BLOCK == 0 and reply.generated:
            got = self.demo.manager.alloc(1)
            if got is None:
                return False
            reply.blocks += got
        reply.generated += 1
        return True

    def _end(self, reply: Reply) -> None:
        self.demo.manager.free(reply.blocks)
        t = self.traffic
        with t.lock:
            t.running -= 1
            t.finished += 1
            t.generated_tokens += reply.generated
            self._publish()

    def _publish(self) -> None:
        t = self.traffic
        self.demo.manager.publish_traffic(t.running, 0, t.finished, t.prompt_tokens, t.generated_tokens, 0,
                                          t.last_request_ns)


def _prompt(body: dict[str, Any], chat: bool) -> str | None:
    """The request's text (a chat's messages' contents joined), None when it has none of the right form."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: their text ones
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                return None
            parts.append(content)
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompt = "\n".join(prompt)
    return prompt if isinstance(prompt, str) else None


class Reply:
    """One request's answer, as a whole body or as server-sent events in OpenAI's shape."""

    def __init__(self, server: DemoServer, chat: bool, text: list[str], prompt_tokens: int, blocks: list[int]):
        self.server, self.chat, self.text = server, chat, text
        self.prompt_tokens, self.blocks = prompt_tokens, blocks
        self.generated = 0
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    async def _tokens(self) -> AsyncIterator[str]:
        for i, word in enumerate(self.text):
            await asyncio.sleep(TOKEN_S)
            if not await asyncio.to_thread(self.server.grow, self):
                return
            yield word if i == 0 else " " + word

    def _finish_reason(self) -> str:
        return "length"  # the toy never says a stop word: it runs to max_tokens (or out of blocks)

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model}

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
                "total_tokens": self.prompt_tokens + self.generated}

    async def whole(self) -> dict[str, Any]:
        text = "".join([piece async for piece in self._tokens()])
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self._finish_reason()}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self._usage()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self._finish_reason()}
        return {**self._head("text_completion"), "choices": [choice], "usage": self._usage()}

    def _chunk(self, piece: str | None, finish: str | None, first: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if piece is not None:
                delta["content"] = piece
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            event = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            event = {**self._head("text_completion"), "choices": [choice]}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        if self.chat:
            await response.write(self._chunk("", None, first=True))
        async for piece in self._tokens():
            await response.write(self._chunk(piece, None))
        await response.write(self._chunk(None if self.chat else "", self._finish_reason()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
