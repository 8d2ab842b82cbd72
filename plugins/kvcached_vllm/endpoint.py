"""Where vLLM's OpenAI-compatible server listens, published in the model's segment (``kvctl route`` reads it).

The API server (vLLM's main process) binds its socket in ``setup_server`` before it starts the EngineCore,
whose :class:`~kvcached_core.KVCacheManager` owns the segment; the EngineCore never learns the API port
itself. So the wrapper here takes the bound socket's address (the real port, ``--port 0`` included; an
unspecified ``--host`` becomes the loopback address a local client reaches) and hands it on in
``KVCACHED_ENDPOINT``, which the EngineCore inherits and every manager publishes at start. An
``KVCACHED_ENDPOINT`` set by the operator (a server behind a proxy) is left as it is; a server on a unix
socket (``--uds``) publishes none.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
import sys
from typing import Any

from kvcached_core.engines import endpoint_problem
from kvcached_core.settings import settings

log = logging.getLogger("kvcached_vllm")

ENV = "KVCACHED_ENDPOINT"
# The modules that hold vLLM's setup_server by name (each imported it with ``from ... import``).
HOLDERS = ("vllm.entrypoints.launchers.launcher", "vllm.entrypoints.launchers.api_server.entry",
           "vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server")


def url_of(sock: socket.socket, args: Any) -> str | None:
    """The URL a local client reaches vLLM's server on, from its bound ``sock`` and its arguments."""
    if getattr(args, "uds", None):
        return None
    host, port = sock.getsockname()[:2]
    given = getattr(args, "host", None) or ""
    try:
        unspecified = not given or ipaddress.ip_address(given).is_unspecified
    except ValueError:  # a host name: what the operator named is what clients use
        unspecified = False
    if unspecified:
        host = "::1" if sock.family == socket.AF_INET6 else "127.0.0.1"
    elif not _is_ip(given):
        host = given
    scheme = "https" if getattr(args, "ssl_keyfile", None) and getattr(args, "ssl_certfile", None) else "http"
    url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    return url if endpoint_problem(url) is None else None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def install() -> None:
    """Wrap vLLM's ``setup_server`` wherever it is held (idempotent; a vLLM without it publishes no endpoint)."""
    launcher = sys.modules.get(HOLDERS[0])
    original = getattr(launcher, "setup_server", None)
    if original is None or getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def setup_server(args: Any, *rest: Any, **kwargs: Any) -> Any:
        listen_address, sock = original(args, *rest, **kwargs)
        url = url_of(sock, args)
        if ENV not in settings().given and url is not None:
            os.environ.update({ENV: url})  # the EngineCore, started after this, inherits it
            log.info("kvcached: the model's segment will say it is served on %s", url)
        return listen_address, sock

    setup_server._kvcached = True  # type: ignore[attr-defined]
    for name in HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "setup_server", None) is original:
            module.setup_server = setup_server  # type: ignore[attr-defined]
