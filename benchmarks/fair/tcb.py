"""The transformers driver: each model one process running transformers' own continuous batching
(``init_continuous_batching``, greedy, ``sdpa``, no CUDA graphs, no async batching, no prefix sharing: the same in
both configurations), random weights built in place (``MODELS`` says which sizes and why).

- **static**: plain transformers, each model with a fixed cache of one share (``ContinuousBatchingConfig.num_blocks``);
- **elastic**: the same engines on kvcached (``kvcached_transformers.cb.install``), one budget shared by every
  model (``KVCACHED_DEVICE_BUDGET`` on a GPU, ``KVCACHED_HOST_CAPACITY`` on CPU), each model's capacity the whole
  budget. The budget is the static caches added up, their two padding blocks each included.

The peak rate comes from a declared rule applied to a measured figure: ``PEAK_RULE`` times the requests per second
one static share serves, measured in this run by a short calibration (``CALIBRATION_FACTOR`` times the requests its
cache holds at once, all submitted together to one static engine).
Counters per run, read in every engine: steps and the requests they carried (transformers' ``schedule_batch``),
steps that left requests waiting, offload rounds; admissions refused by the shared budget and pooled bytes come
from the plugin's ``stats`` where it has one (``n/a`` otherwise).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .longctx import MIX, OUTPUT_TOKENS, Bucket, bounds, draw, scaled
from .method import Answer
from .scale import CPU_SHAPES, GPU_SHAPES, GiB, MiB, Plan, Shape, choose
from .trace import SHAPES

ROOT = Path(__file__).resolve().parents[2]
PEAK_RULE = 2.0  # the peak rate: twice the requests per second one static share serves
CALIBRATION_FACTOR = 3  # calibration: three times the requests a static share holds at once
PAGE_TOKENS = 256  # transformers' block (page_size): one kvcached block per sector


@dataclass(frozen=True)
class Setup:
    """One machine's models, shares and trace; ``why`` says why a static share runs out of KV memory first."""

    device: str
    dtype: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    share_blocks: int  # a static share: blocks of PAGE_TOKENS tokens (+ 2 padding blocks)
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    duration_s: float
    max_batch_tokens: int
    max_requests: int
    threads: int
    why: str
    max_positions: int = 4096
    tie_embeddings: bool = False
    prompt_mix: tuple = ()  # a declared mix of prompt lengths (.longctx); empty: uniform in prompt_tokens

    @property
    def kv_token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (2 if self.dtype == "bfloat16" else 4)

    @property
    def block_bytes(self) -> int:
        return self.kv_token_bytes * PAGE_TOKENS

    def prompt_range(self) -> tuple[int, int]:
        """The shortest and the longest prompt the trace draws."""
        return bounds(self.prompt_mix) if self.prompt_mix else self.prompt_tokens

    def draw_prompt(self, rng: random.Random) -> int:
        return draw(rng, self.prompt_mix) if self.prompt_mix else rng.randint(*self.prompt_tokens)

    @property
    def fits_at_once(self) -> int:
        """Requests of the longest shape one static share holds at once."""
        longest = self.prompt_range()[1] + self.output_tokens[1]
        return max(1, self.share_blocks // -(-longest // PAGE_TOKENS))


MODELS = {
    "cuda": Setup(
        device="cuda", dtype="bfloat16", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
        intermediate=8192, vocab=32000, share_blocks=6, prompt_tokens=(256, 512), output_tokens=(32, 64),
        duration_s=30.0, max_batch_tokens=2048, max_requests=64, threads=2,
        why="Llama-3.2-1B-shaped (16 layers, 8 KV heads of 64, bf16: 32 KiB of KV per token, 8 MiB per block "
            "of 256 tokens). A static share of 6 blocks (48 MiB) holds 2-3 requests at once; on an H200 a "
            "decode step of 3 or of 12 requests costs about the same (measured there: with 64 requests at once, "
            "16x the cache gave 3.1x the tokens/s), so the share's KV memory, not compute, bounds what it serves."),
    "cpu": Setup(
        device="cpu", dtype="float32", layers=2, hidden=256, heads=8, kv_heads=4, head_dim=32,
        intermediate=512, vocab=512, share_blocks=6, prompt_tokens=(96, 320), output_tokens=(8, 24),
        duration_s=24.0, max_batch_tokens=1024, max_requests=32, threads=1,
        why="a tiny Llama (2 layers, 4 KV heads of 32, fp32: 512 KiB per block of 256 tokens); a static share "
            "of 6 blocks holds 3 requests at once. On 2 CPU cores compute grows with the batch, so lending "
            "KV memory buys little here: this run checks the benchmark, the GPU measures the headline."),
}


def share_bytes(setup: Setup) -> int:
    """One static cache, its two padding blocks included."""
    return (setup.share_blocks + 2) * setup.block_bytes


def prompt_ids(row: dict, vocab: int) -> list[int]:
    rng = random.Random(row["seed"])
    return [1] + [rng.randrange(4, vocab) for _ in range(row["prompt_tokens"] - 1)]


# -- one engine per process ------------------------------------------------------------------------
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


def serve(spec: dict, inbox: Any, outbox: Any) -> None:
    """A child: build the model, start continuous batching (on kvcached when elastic), serve requests."""
    os.environ.update(spec["env"])  # before kvcached reads its settings
    sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["setup"].items()}
    fields["prompt_mix"] = tuple(tuple(b) for b in fields["prompt_mix"])
    setup = Setup(**fields)
    torch.set_num_threads(setup.threads)
    config = LlamaConfig(hidden_size=setup.hidden, intermediate_size=setup.intermediate,
                         num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.kv_heads, head_dim=setup.head_dim, vocab_size=setup.vocab,
                         max_position_embeddings=setup.max_positions, tie_word_embeddings=setup.tie_embeddings,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(spec["seed"])
    torch.set_default_dtype(getattr(torch, setup.dtype))  # built in its dtype: no float32 copy of the weights
    with torch.device(setup.device):
        model = LlamaForCausalLM(config).eval()
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
    handle = None
    if spec["elastic"]:
        from kvcached_transformers import cb

        handle = cb.install(model, name=spec["name"], num_blocks=spec["num_blocks"])
    gen = GenerationConfig(max_new_tokens=setup.output_tokens[1], do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_TOKENS, num_blocks=None if spec["elastic"] else spec["num_blocks"],
        max_batch_tokens=setup.max_batch_tokens, max_requests_per_batch=setup.max_requests,
        allow_block_sharing=False, use_async_batching=False, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config)
    manager.start()
    stop = threading.Event()

    def results() -> None:
        while not stop.is_set():
            out = manager.get_result(timeout=0.2)
            if out is None or not out.is_finished():
                continue
            stamps = out.timestamps or []
            outbox.put(("done", spec["name"], out.request_id, stamps[0] if stamps else None,
                        stamps[-1] if stamps else None, len(out.generated_tokens), out.error))

    reader = threading.Thread(target=results, daemon=True)
    reader.start()
    manager.add_request([1, 5, 6, 7], request_id="warm", max_new_tokens=2, record_timestamps=True)
    outbox.put(("ready", spec["name"], None, None, None, 0, None))
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            if msg == "stats":
                outbox.put(("stats", spec["name"], None, {**tally, **plugin_stats(handle), "offloaded": sorted(offloaded)},
                            None, 0, None))
                continue
            rid, ids, new = msg
            manager.add_request(ids, request_id=rid, max_new_tokens=new, record_timestamps=True, eos_token_id=-1)
    finally:
        stop.set()
        manager.stop(block=True, timeout=30)
        if handle is not None:
            handle.close()


def plugin_stats(handle: Any) -> dict:
    """What the plugin's ``stats`` (when it has one) says of admissions refused by the shared budget (by gate) and
    of bytes in its pooled handles; None for each it does not say (static engines: no plugin)."""
    stats = getattr(handle, "stats", None)
    stats = stats() if callable(stats) else stats
    refused = getattr(stats, "refused", None)
    pooled = getattr(stats, "pooled_bytes", None)
    return {"refused": dict(refused) if refused is not None else None,
            "pooled_bytes": int(pooled) if pooled is not None else None}


class Engines:
    """One configuration's engines (child processes) and the queue their answers come back on (a :class:`Side`)."""

    def __init__(self, ctx: Any, setup: Setup, models: int, elastic: bool, shm: Path, seed: int, *,
                 static_blocks: int | None = None, letter: str | None = None) -> None:
        """``static_blocks``: each static engine's cache (default one share); ``letter``: the engines' names'."""
        self.names = [f"{letter or ('e' if elastic else 's')}{m}" for m in range(models)]
        self.elastic = elastic
        self.shm: Path | None = shm if elastic else None
        self.outbox = ctx.Queue()
        self.inboxes = {name: ctx.Queue() for name in self.names}
        budget = models * share_bytes(setup)
        env = {"KVCACHED_SHM_DIR": str(shm), "OMP_NUM_THREADS": str(setup.threads)}
        if elastic:  # warm pools as the vLLM driver sets them: a shared budget is not held in idle pools
            env.update({"KVCACHED_DEVICE_BUDGET" if setup.device == "cuda" else "KVCACHED_HOST_CAPACITY":
                        f"{budget >> 20}MiB", "KVCACHED_MIN_RESERVED_PAGES": "0",
                        "KVCACHED_MAX_RESERVED_PAGES": "1", "KVCACHED_IDLE_RETURN_S": "1"})
        blocks = budget // setup.block_bytes - 2 if elastic else static_blocks or setup.share_blocks
        self.vocab = setup.vocab
        self.procs = [ctx.Process(target=serve, daemon=True, args=(
            {"name": name, "elastic": elastic, "seed": seed + m, "num_blocks": blocks, "env": env,
             "setup": setup.__dict__}, self.inboxes[name], self.outbox)) for m, name in enumerate(self.names)]
        for proc in self.procs:
            proc.start()
        self.arrivals: dict[str, tuple[float, int]] = {}
        self.answers: dict[str, Answer] = {}
        self.stats: list[dict] = []

    def wait_ready(self, timeout: float) -> None:
        waiting, warm = set(self.names), set(self.names)
        deadline = time.monotonic() + timeout
        while waiting or warm:
            msg = self.get(deadline - time.monotonic())
            if msg[0] == "ready":
                waiting.discard(msg[1])
            elif msg[2] == "warm":
                warm.discard(msg[1])

    def get(self, timeout: float) -> tuple:
        if timeout <= 0:
            raise RuntimeError("the engines did not answer in time")
        try:
            return self.outbox.get(timeout=min(timeout, 5.0))
        except queue.Empty:
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"an engine exited ({dead})") from None
            return self.get(timeout - 5.0)

    def keep(self, msg: tuple) -> None:
        kind, _, rid, first, end, n, error = msg
        if kind == "stats":
            self.stats.append(first)
        elif kind == "done" and rid in self.arrivals:
            if error:
                raise RuntimeError(f"request {rid} failed: {error}")
            arrival, model = self.arrivals.pop(rid)
            self.answers[rid] = Answer(model, arrival, first, end, n)

    def submit(self, rid: str, row: dict, arrival: float) -> None:
        model = int(row["model"][1:])
        self.arrivals[rid] = (arrival, model)
        self.inboxes[self.names[model]].put((rid, prompt_ids(row, self.vocab), row["max_tokens"]))
        while True:  # keep the queue short while sending
            try:
                self.keep(self.outbox.get_nowait())
            except queue.Empty:
                return

    def collect(self, rids: set[str], timeout_s: float) -> list[Answer]:
        deadline = time.monotonic() + timeout_s
        while not rids <= set(self.answers) and time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                self.keep(self.get(min(5.0, deadline - time.monotonic())))
        return [self.answers.pop(rid) for rid in rids if rid in self.answers]

    def counters(self) -> dict:
        """Every engine's tally so far, summed (each engine counts from its start)."""
        self.stats = []
        for box in self.inboxes.values():
            box.put("stats")
        deadline = time.monotonic() + 30
        while len(self.stats) < len(self.names):
            self.keep(self.get(deadline - time.monotonic()))
        total: dict = {"preemptions": None}
        for key in ("steps", "step_requests", "waiting_steps", "offload_rounds"):
            total[key] = sum(s[key] for s in self.stats)
        gates = [s["refused"] for s in self.stats if s["refused"] is not None]
        names = sorted({g for x in gates for g in x})
        total["refused"] = {g: sum(x.get(g, 0) for x in gates) for g in names} if gates else None
        pooled = [s["pooled_bytes"] for s in self.stats if s["pooled_bytes"] is not None]
        total["pooled_bytes"] = sum(pooled) if pooled else None
        total["offloaded"] = sorted({rid for s in self.stats for rid in s["offloaded"]})
        return total

    def stop(self) -> None:
        for box in self.inboxes.values():
            with contextlib.suppress(Exception):
                box.put(None)
        deadline = time.monotonic() + 40
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def calibrate(static: Engines, setup: Setup, seed: int) -> dict:
    """Requests per second one static share serves: CALIBRATION_FACTOR x what it holds, submitted at once."""
    from .method import replay

    count = CALIBRATION_FACTOR * setup.fits_at_once
    rng = random.Random(seed - 1)
    rows = [{"t": 0.0, "model": "m0", "prompt_tokens": setup.draw_prompt(rng),
             "max_tokens": rng.randint(*setup.output_tokens), "seed": rng.randrange(1 << 30)} for _ in range(count)]
    started = time.perf_counter()
    result = replay(static, rows, "calibration", timeout_s=300)
    took = time.perf_counter() - started - 0.2
    if result["answered"] < count:
        raise RuntimeError(f"calibration: {result['answered']} of {count} requests answered")
    return {"requests": count, "seconds": round(took, 2), "requests_per_s": round(count / took, 3)}


def check_machine(device: str) -> str | None:
    """Why this machine cannot run the driver (one line), or None."""
    try:
        import torch

        from kvcached_transformers.cb.seams import UnsupportedTransformers, check
    except ImportError as exc:
        return f"{exc.name or exc} is not installed: pip install -e '.[transformers]'"
    try:
        check()
    except UnsupportedTransformers as exc:
        return str(exc)
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no GPU here (torch.cuda.is_available() is False)"
    return None


def machine(device: str) -> dict:
    import platform

    import torch
    import transformers

    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def context() -> Any:
    return mp.get_context("spawn")


@dataclass(frozen=True)
class Operator:
    """``--scale operator`` on one kind of device: what :mod:`.scale` plans with and the trace it serves."""

    dtype: str
    shapes: tuple[Shape, ...]
    activation_bytes: int  # per engine: CUDA context, the working set at max_batch_tokens (logits, masks, MLP)
    margin_bytes: int
    min_share: int
    prompt_mix: tuple[Bucket, ...]
    output_tokens: tuple[int, int]
    durations: dict[str, float]  # the trace's length per shape (a command within 10 minutes, see BENCHMARKS.md)
    max_batch_tokens: int
    max_requests: int
    threads: int
    device_bytes: int | None  # declared (None: the device's free memory, read before starting)


OPERATOR = {
    "cuda": Operator(dtype="bfloat16", shapes=GPU_SHAPES, activation_bytes=5 * GiB // 2, margin_bytes=GiB,
                     min_share=4 * GiB, prompt_mix=MIX, output_tokens=OUTPUT_TOKENS,
                     durations={"ramps": 30.0, "bursty": 25.0, "saturated": 12.0, "steady": 25.0},
                     max_batch_tokens=2048, max_requests=64, threads=2, device_bytes=None),
    "cpu": Operator(dtype="float32", shapes=CPU_SHAPES, activation_bytes=8 * MiB, margin_bytes=4 * MiB,
                    min_share=4 * MiB, prompt_mix=scaled(MIX, 100, 800), output_tokens=(8, 24),
                    durations=dict.fromkeys(SHAPES, 4.0), max_batch_tokens=512, max_requests=32, threads=1,
                    device_bytes=128 * MiB),
}


def device_free_bytes() -> int:
    """The GPU's free memory now, read in a child process (a CUDA context here would stay for the whole run)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[0])"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"reading the device's memory failed: {out.stderr.strip()[-300:]}")
    return int(out.stdout.split()[-1])


def operator_plan(device: str, device_bytes: int | None = None, models: int = 3) -> Plan:
    """The operator-scale plan for ``device``: on ``device_bytes`` when declared, else the declared default
    (CPU) or the GPU's free memory. ValueError when no size fits."""
    op = OPERATOR[device]
    size = device_bytes or op.device_bytes or device_free_bytes()
    return choose(size, op.shapes, dtype=op.dtype, activation_bytes=op.activation_bytes,
                  margin_bytes=op.margin_bytes, min_share=op.min_share, models=models, page_tokens=PAGE_TOKENS)


def operator_setup(device: str, plan: Plan, duration_s: float) -> Setup:
    op, shape = OPERATOR[device], plan.shape
    longest = bounds(op.prompt_mix)[1] + op.output_tokens[1]
    setup = Setup(
        device=device, dtype=op.dtype, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
        kv_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate=shape.intermediate, vocab=shape.vocab,
        share_blocks=plan.share_blocks, prompt_tokens=bounds(op.prompt_mix), output_tokens=op.output_tokens,
        duration_s=duration_s, max_batch_tokens=op.max_batch_tokens, max_requests=op.max_requests,
        threads=op.threads, max_positions=longest + PAGE_TOKENS, tie_embeddings=shape.tie_embeddings,
        prompt_mix=op.prompt_mix,
        why=f"{shape.name}-shaped ({shape.layers} layers, {shape.kv_heads} KV heads of {shape.head_dim}, "
            f"{op.dtype}: {shape.kv_token_bytes(op.dtype) >> 10} KiB of KV per token, "
            f"{plan.block_bytes / MiB:g} MiB per block of {PAGE_TOKENS} tokens), random weights. Prompts from the "
            f"long-context mix {', '.join(f'{w:.0%} {lo}-{hi}' for w, lo, hi in op.prompt_mix)} tokens "
            f"(benchmarks/fair/longctx.py), outputs {op.output_tokens[0]}-{op.output_tokens[1]}: a share of "
            f"{plan.share_blocks} blocks holds {plan.share_blocks // -(-longest // PAGE_TOKENS)} of the longest "
            "requests at once, so KV memory bounds concurrency.")
    assert setup.block_bytes == plan.block_bytes, (setup.block_bytes, plan.block_bytes)
    return setup


class TcbDriver:
    """Both configurations of ``models`` transformers engines (a :class:`.run.Driver`).

    ``scale="operator"``: the setup :func:`operator_plan` makes for the device (printed before starting), the
    long-context trace, names that say the configuration (``static-m0``, ``elastic-m0``...); the configurations in
    turn when the plan says so; on the saturated shape one plain engine given the whole budget (:meth:`alone`);
    ``screenshot``: kvtop's screen saved during the counted elastic runs (:mod:`.screenshot`)."""

    title = "transformers continuous batching, static against elastic"

    def __init__(self, *, device: str, models: int, shape: str, seed: int, share_blocks: int | None = None,
                 duration_s: float | None = None, scale: str = "small", device_bytes: int | None = None,
                 screenshot: Path | None = None) -> None:
        self.plan: Plan | None = None
        if scale == "operator":
            self.plan = operator_plan(device, device_bytes, models)
            setup = operator_setup(device, self.plan, duration_s or OPERATOR[device].durations[shape])
        else:
            setup = MODELS[device]
            if duration_s is not None:
                setup = Setup(**{**setup.__dict__, "duration_s": duration_s})
        if share_blocks is not None:
            setup = Setup(**{**setup.__dict__, "share_blocks": share_blocks})
        self.setup, self.device, self.models, self.shape, self.seed = setup, device, models, shape, seed
        self.scale, self.screenshot = scale, screenshot
        self.together = self.plan is None or self.plan.together
        self.groups: dict[str, Engines] = {}
        self.calibration: dict = {}
        self.peak_rate = 0.0
        self.picture: dict = {}
        self.started_engines: list[str] = []  # when each group's engines were started (in turn: more than once)
        import tempfile

        # named for this process, so that whoever started it can tell its directory from another run's
        self.shm = Path(tempfile.mkdtemp(prefix=f"kvc-tcb-{os.getpid()}-",
                                         dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))

    def _letter(self, config: str) -> str | None:
        return f"{config}-m" if self.scale == "operator" else None

    def _engines(self, config: str) -> Engines:
        group = Engines(context(), self.setup, self.models, config == "elastic", self.shm, self.seed,
                        letter=self._letter(config))
        self.started_engines.append(config)
        return group

    def start(self) -> dict[str, Any]:
        if self.plan is not None:
            for line in self.plan.lines():
                print(line, flush=True)
        for config in ("static", "elastic") if self.together else ("static",):
            self.groups[config] = self._engines(config)
        for group in self.groups.values():
            group.wait_ready(600)
        return self.groups  # the same dict: in turn, :meth:`around` swaps its engines

    @contextlib.contextmanager
    def around(self, slot: Any) -> Any:
        """Before a run: in turn, this configuration's engines up (the other's stopped), outside the run's clock;
        during the counted elastic runs, kvtop's screen saved until one run saw a reclaim."""
        if slot.configuration in ("static", "elastic") and slot.configuration not in self.groups:
            for config in list(self.groups):
                self.groups.pop(config).stop()
            self.groups[slot.configuration] = self._engines(slot.configuration)
            self.groups[slot.configuration].wait_ready(600)
        want = self.screenshot is not None and slot.configuration == "elastic" and slot.kind == "pair" \
            and not self.picture.get("reclaim")
        if not want:
            yield
            return
        from .screenshot import Screenshot

        assert self.screenshot is not None
        with Screenshot(self.shm, self.screenshot) as shot:
            yield
        self.picture = {**shot.result, "run_configuration": "elastic", "pair": slot.pair}
        print(f"kvtop's screen: {self.screenshot} ({self.picture})", flush=True)

    def alone(self) -> Engines:
        """The limit of sharing: static's engines stopped (in turn: elastic's too), then one plain engine whose
        static cache is the whole budget, up before its runs."""
        for config in list(self.groups):
            if config == "static" or not self.together:
                self.groups.pop(config).stop()
        blocks = self.models * share_bytes(self.setup) // self.setup.block_bytes - 2
        group = Engines(context(), self.setup, 1, False, self.shm, self.seed, static_blocks=blocks,
                        letter=self._letter("alone") or "a")
        self.groups["alone"] = group
        self.started_engines.append("alone")
        group.wait_ready(600)
        return group

    def trace(self) -> list[dict]:
        from .trace import make_trace

        self.calibration = calibrate(self.groups["static"], self.setup, self.seed)
        self.peak_rate = round(PEAK_RULE * self.calibration["requests_per_s"], 3)
        return make_trace(shape=self.shape, models=self.models, duration_s=self.setup.duration_s,
                          peak_rate=self.peak_rate, seed=self.seed, prompt_tokens=self.setup.prompt_tokens,
                          output_tokens=self.setup.output_tokens, prompt_mix=self.setup.prompt_mix or None)

    def notes(self) -> dict:
        """Report fields that change as the command runs: kvtop's picture, the engines started."""
        out: dict = {"engine_starts": list(self.started_engines)}
        if self.screenshot is not None:
            p = self.picture
            said = "not taken" if not p else f"not saved ({p['error']})" if "error" in p else \
                (f"taken in pair {p['pair']}'s elastic run, {p['model']} selected, " +
                 ("after a reclaim in that run" if p["reclaim"] else "no reclaim seen in the counted elastic runs: "
                  "the screen as the last one ended"))
            out.update(screenshot=dict(p, path=str(self.screenshot)),
                       screenshot_lines=[f"kvtop's screen ({self.screenshot.name}, 160x50): {said}.", ""])
        return out

    def describe(self) -> dict:
        s, cal = self.setup, self.calibration
        budget = self.models * share_bytes(s)
        plan_lines: list[str] = []
        if self.plan is not None:
            plan_lines = [*("- " + line.removeprefix("plan: ") for line in self.plan.lines()), ""]
            if not self.together:
                plan_lines += ["Both configurations' engines cannot live on this device at once: they ran in "
                               "turn, each configuration's engines started (outside the timed runs) before its "
                               "runs and stopped after them.", ""]
        return {"engine": "transformers", "machine": machine(self.device), "models": self.models,
                "share_bytes": share_bytes(s), "budget_bytes": budget, "setup": s.__dict__,
                "scale": self.scale, "plan": None if self.plan is None else self.plan.to_dict(),
                "together": self.together,
                "calibration": cal, "peak_rate": self.peak_rate, "peak_rule": PEAK_RULE, "duration_s": s.duration_s,
                "timeout_s": s.duration_s * 4 + 60 + (300 if self.scale == "operator" else 0),
                "setup_lines": [
                    f"Models: {s.why}", "", *plan_lines,
                    f"Budget {budget >> 20} MiB: static {self.models} x {s.share_blocks} blocks (+2 padding each), "
                    f"elastic one shared budget. Calibration: one static share served {cal['requests_per_s']} "
                    f"requests/s ({cal['requests']} at once); peak rate {self.peak_rate} requests/s per model (rule: "
                    f"{PEAK_RULE} x that), {s.duration_s:g} s of trace.", ""],
                "counters_note": "requests per step and steps with requests waiting are counted in transformers' "
                                 "scheduler (every step that carried a request); claimed but unused is the "
                                 "elastic segments' reserved pages (sampled every 0.5 s, all models); refused "
                                 "admissions and pooled handles come from the plugin's stats; requests preempted "
                                 "are those transformers' offloading took out of its running requests."}

    def stop(self) -> None:
        for group in self.groups.values():
            group.stop()
        with contextlib.suppress(OSError):
            for leftover in self.shm.iterdir():
                leftover.unlink()
            self.shm.rmdir()
