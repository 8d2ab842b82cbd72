"""``kvctl route``: one OpenAI-compatible front door for every model on the host.

The models are found in their segments (each engine publishes the URL it serves on: the ENDPOINT words),
so engines come and go without a restart; a request goes to the engine serving its ``model``, a sleeping
model is woken by it (bounded), and the router keeps per-model figures.

Built on aiohttp: one well-kept library for both sides (its server and its client share one event loop,
one connection pool and one streaming API), where starlette + uvicorn + httpx would be three libraries,
two of them with their own event-loop and connection-pool layers, for the same job. No HTTP is parsed
here by hand; the server listens through :func:`kvtop.serve.aioserve.serve`, as ``kvctl export`` does, so both keep
the same limits (a bounded request head and wait for it, the backlog, no access log, a ``Server`` header naming
no versions). ``kvcached_core`` never imports this package; only :mod:`.proxy` and :mod:`.directory` import
aiohttp, so a reader of the published figures that serves nothing (``kvctl list``, kvtop) never loads it.

- :mod:`.directory`: the models from their segments (rescanned), the names each engine answers to.
- :mod:`.proxy`: the aiohttp application (``/v1/models``, the passed-through POSTs, errors in OpenAI's shape).
- :mod:`.admission`: with ``--max-in-flight``, the places per device and who waits first (model priority).
- :mod:`.figures`: per-model requests, errors, in flight, TTFT and latency percentiles.
- :mod:`.published`: those figures in a small file per router, for kvctl list/show --json and the exporter.
"""
