"""The demo workload: simulated models in child processes (:mod:`.fleet`), each with a toy OpenAI-compatible
endpoint (:mod:`.serve`). A client of kvcached_core's public API, as an engine is; nothing else of kvtop."""
