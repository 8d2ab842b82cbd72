"""One transformers engine in its own process (the child side of :mod:`.tcb_engines`): the model built in place,
transformers' continuous batching started on it (on kvcached when elastic), requests served from an inbox, answers
and counters put on an outbox.

Messages on the outbox are tuples ``(kind, engine, request id, first, end, tokens, error)``:

- ``ready``: the engine is up (``first``: ``{"working_bytes": ...}``, what its profiling pass measured at operator
  scale, else None); its warm-up request's ``done`` follows;
- ``done``: a request ended (``first``/``end``: its first and last token's ``time.perf_counter``; ``error``: the
  engine's error when it failed);
- ``stats``: the engine's counters (a dict in ``first``), asked with ``"stats"`` on the inbox;
- ``died``: the engine cannot serve any more (its generation loop stopped, or the process failed), with its own
  error line in ``error``; the process then ends by itself.

The engine's stdout and stderr go to its log file (``spec["log"]``), so that tracebacks and library warnings stay
out of the benchmark's own output; the error line is what the harness prints.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from .passes import Meter, fill_pass, measure_pass, wait_warm
from .tcb_errors import error_line, loop_error
from .tcb_setup import PAGE_TOKENS, Setup

ROOT = Path(__file__).resolve().parents[2]


def log_to(path: str | None) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to ``path``."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def count_steps(tally: dict[str, int]) -> None:
    """Wrap every transformers scheduler's ``schedule_batch``: steps scheduled, the requests they carry, and steps
    that left requests waiting (the plugin wraps each instance's bound method, so it sees this one's count too)."""
    from transformers.generation.continuous_batching import scheduler

    def wrap(cls: Any) -> None:
        inner = cls.schedule_batch

        def schedule_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = inner(self, *args, **kwargs)
            batch = out[0] if isinstance(out, tuple) else out
            if batch:
                tally["steps"] += 1
                tally["step_requests"] += len(batch)
                tally["waiting_steps"] += bool(self.waiting_requests)
            return out

        cls.schedule_batch = schedule_batch

    for cls in scheduler.Scheduler.__subclasses__():
        if "schedule_batch" in vars(cls):
            wrap(cls)


def plugin_stats(handle: Any) -> dict:
    """What the plugin's ``stats`` (when it has one) says of admissions refused by the shared budget (by gate) and
    of bytes in its pooled handles; None for each it does not say (static engines: no plugin)."""
    stats = getattr(handle, "stats", None)
    stats = stats() if callable(stats) else stats
    refused = getattr(stats, "refused", None)
    pooled = getattr(stats, "pooled_bytes", None)
    return {"refused": dict(refused) if refused is not None else None,
            "pooled_bytes": int(pooled) if pooled is not None else None}


def setup_of(spec: dict) -> Any:
    """The :class:`.tcb_setup.Setup` a spec carries (as plain fields, so that it crosses to a spawned process)."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["setup"].items()}
    fields["prompt_mix"] = tuple(tuple(b) for b in fields["prompt_mix"])
    return Setup(**fields)


def build_model(setup: Any, seed: int) -> Any:
    """The Llama-shaped model of ``setup`` with random weights, built in place on its device and dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(setup.threads)
    config = LlamaConfig(hidden_size=setup.hidden, intermediate_size=setup.intermediate,
                         num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.kv_heads, head_dim=setup.head_dim, vocab_size=setup.vocab,
                         max_position_embeddings=setup.max_positions, tie_word_embeddings=setup.tie_embeddings,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    # cuDNN's SDPA kernel failed at execution on an H100 (torch 2.11, `mha_graph.execute(...).is_good()`) in a static
    # engine's first calibration request beside two others; the memory-efficient kernel takes the same masked
    # attention. Both configurations run the same kernels, so the comparison stays like for like.
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(seed)
    torch.set_default_dtype(getattr(torch, setup.dtype))  # built in its dtype: no float32 copy of the weights
    with torch.device(setup.device):
        return LlamaForCausalLM(config).eval()


def start_batching(model: Any, setup: Any, *, elastic: bool, num_blocks: int, name: str) -> tuple[Any, Any]:
    """transformers' continuous batching on ``model`` (greedy, ``sdpa``, no CUDA graphs, no async batching, no prefix
    sharing), on kvcached when ``elastic``: its manager, started, and the plugin's handle (None when static)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    handle = None
    if elastic:
        from kvcached_transformers import cb

        handle = cb.install(model, name=name, num_blocks=num_blocks)
    gen = GenerationConfig(max_new_tokens=setup.output_tokens[1], do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_TOKENS, num_blocks=None if elastic else num_blocks,
        max_batch_tokens=setup.max_batch_tokens, max_requests_per_batch=setup.max_requests,
        allow_block_sharing=False, use_async_batching=False, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    manager.start()
    return manager, handle


def warm_pass(spec: dict, setup: Any, manager: Any, handle: Any) -> int | None:
    """At operator scale (``spec["profile_pass"]``: the blocks it fills, one share), a profiling pass as the
    engine's warm-up (see :mod:`.profile`): its working memory, measured; None otherwise."""
    if not spec.get("profile_pass"):
        return None
    wait_warm(manager)
    p = fill_pass(spec["profile_pass"], setup, spec["seed"])
    return measure_pass(manager, handle, Meter(setup.device, device_figures=False), p)


def serve(spec: dict, inbox: Any, outbox: Any) -> None:
    """A child: build the model, start continuous batching, serve requests until ``None`` comes on the inbox.
    Whatever stops it from serving is said once (``died``) before it ends."""
    log_to(spec.get("log"))
    os.environ.update(spec["env"])  # before kvcached reads its settings
    sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]
    name = spec["name"]
    try:
        _serve(spec, inbox, outbox)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the harness says it
        pass
    except Exception as exc:
        outbox.put(("died", name, None, None, None, 0, error_line(exc)))
        raise


def _serve(spec: dict, inbox: Any, outbox: Any) -> None:
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    name = spec["name"]
    setup = setup_of(spec)
    model = build_model(setup, spec["seed"])
    tally = {"steps": 0, "step_requests": 0, "waiting_steps": 0, "offload_rounds": 0}
    offloaded: set[str] = set()  # the requests transformers offloaded (preempted) at least once
    count_steps(tally)
    offload = OffloadingManager.offload_requests

    def counted(self: Any) -> bool:  # rounds in which transformers offloaded (here: restarted) requests
        active = set(getattr(self.scheduler, "active_requests", None) or ())
        done = offload(self)
        tally["offload_rounds"] += bool(done)
        offloaded.update(active - set(getattr(self.scheduler, "active_requests", None) or ()))
        return done

    OffloadingManager.offload_requests = counted  # type: ignore[method-assign]
    manager, handle = start_batching(model, setup, elastic=spec["elastic"], num_blocks=spec["num_blocks"], name=name)
    working = warm_pass(spec, setup, manager, handle)
    stop = threading.Event()

    def results() -> None:
        while not stop.is_set():
            out = manager.get_result(timeout=0.2)
            if out is None:
                if not manager.is_running() and not stop.is_set():  # the loop died: say why, then end
                    outbox.put(("died", name, None, None, None, 0, loop_error(manager)))
                    inbox.put(None)
                    return
                continue
            if not out.is_finished():
                continue
            stamps = out.timestamps or []
            outbox.put(("done", name, out.request_id, stamps[0] if stamps else None,
                        stamps[-1] if stamps else None, len(out.generated_tokens), out.error))

    reader = threading.Thread(target=results, daemon=True)
    reader.start()
    manager.add_request([1, 5, 6, 7], request_id="warm", max_new_tokens=2, record_timestamps=True)
    outbox.put(("ready", name, None, {"working_bytes": working}, None, 0, None))
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            if msg == "stats":
                outbox.put(("stats", name, None, {**tally, **plugin_stats(handle), "offloaded": sorted(offloaded)},
                            None, 0, None))
                continue
            rid, ids, new = msg
            manager.add_request(ids, request_id=rid, max_new_tokens=new, record_timestamps=True, eos_token_id=-1)
    finally:
        stop.set()
        manager.stop(block=True, timeout=30)
        if handle is not None:
            handle.close()
