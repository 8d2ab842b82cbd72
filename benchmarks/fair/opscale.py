"""``--scale operator``: three models of a real Llama shape on one device, each static share what is left after the
engines' weights and measured working memory and the headroom (:mod:`.scale`, :mod:`.profile`), long-context
prompts (:mod:`.longctx`).

:class:`Planner` screens the shapes on their weights alone when it is made (a device nothing could fit is refused at
once, before any process starts), then :meth:`Planner.plan` profiles the candidates and plans from what it measured.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .longctx import MIX, OUTPUT_TOKENS, Bucket, bounds, scaled
from .profile import measure
from .scale import CONFIGS, CPU_SHAPES, DTYPE_BYTES, GPU_SHAPES, GiB, Measured, MiB, Plan, Shape, choose, plan
from .tcb_setup import PAGE_TOKENS, Setup
from .trace import SHAPES


@dataclass(frozen=True)
class Operator:
    """``--scale operator`` on one kind of device: what :mod:`.scale` plans with and the trace it serves."""

    dtype: str
    shapes: tuple[Shape, ...]
    min_share: int
    prompt_mix: tuple[Bucket, ...]
    output_tokens: tuple[int, int]
    durations: dict[str, float]  # the trace's length per shape (BENCHMARKS.md says how they were sized)
    max_batch_tokens: int
    max_requests: int
    threads: int
    device_bytes: int | None  # declared (None: the device's own memory, read before starting)


OPERATOR = {
    "cuda": Operator(dtype="bfloat16", shapes=GPU_SHAPES, min_share=4 * GiB, prompt_mix=MIX,
                     output_tokens=OUTPUT_TOKENS,
                     durations={"ramps": 30.0, "bursty": 25.0, "saturated": 12.0, "steady": 25.0},
                     max_batch_tokens=2048, max_requests=64, threads=2, device_bytes=None),
    "cpu": Operator(dtype="float32", shapes=CPU_SHAPES, min_share=4 * MiB, prompt_mix=scaled(MIX, 100, 800),
                    output_tokens=(8, 24), durations=dict.fromkeys(SHAPES, 4.0), max_batch_tokens=512,
                    max_requests=32, threads=1, device_bytes=256 * MiB),
}


def device_memory() -> tuple[int, int]:
    """The GPU's free and total memory now, read in a child process (a CUDA context here would stay for the whole
    run)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(*torch.cuda.mem_get_info())"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"reading the device's memory failed: {out.stderr.strip()[-300:]}")
    free, total = out.stdout.split()[-2:]
    return int(free), int(total)


def shape_names(device: str) -> list[str]:
    return [s.name for s in OPERATOR[device].shapes]


def setup_for(device: str, shape: Shape, share_blocks: int, duration_s: float) -> Setup:
    """The engines' setup for ``shape`` with static shares of ``share_blocks`` blocks."""
    op = OPERATOR[device]
    longest = bounds(op.prompt_mix)[1] + op.output_tokens[1]
    block_mib = shape.kv_token_bytes(op.dtype) * PAGE_TOKENS / MiB
    return Setup(
        device=device, dtype=op.dtype, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
        kv_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate=shape.intermediate, vocab=shape.vocab,
        share_blocks=share_blocks, prompt_tokens=bounds(op.prompt_mix), output_tokens=op.output_tokens,
        duration_s=duration_s, max_batch_tokens=op.max_batch_tokens, max_requests=op.max_requests,
        threads=op.threads, max_positions=longest + PAGE_TOKENS, tie_embeddings=shape.tie_embeddings,
        prompt_mix=op.prompt_mix,
        why=f"{shape.name}-shaped ({shape.layers} layers, {shape.kv_heads} KV heads of {shape.head_dim}, "
            f"{op.dtype}: {shape.kv_token_bytes(op.dtype) >> 10} KiB of KV per token, "
            f"{block_mib:g} MiB per block of {PAGE_TOKENS} tokens), random weights. Prompts from the "
            f"long-context mix {', '.join(f'{w:.0%} {lo}-{hi}' for w, lo, hi in op.prompt_mix)} tokens "
            f"(benchmarks/fair/longctx.py), outputs {op.output_tokens[0]}-{op.output_tokens[1]}: a share of "
            f"{share_blocks} blocks holds {share_blocks // -(-longest // PAGE_TOKENS)} of the longest "
            "requests at once, so KV memory bounds concurrency.")


class Planner:
    """The operator-scale plan for ``device`` (``model``: one shape by name, else every shape, largest first)."""

    def __init__(self, device: str, *, models: int, model: str | None, device_bytes: int | None) -> None:
        """ValueError (one line) when no shape fits even with no working memory."""
        from kvcached_core.settings import settings

        self.device, self.models = device, models
        self.op = OPERATOR[device]
        self.shapes = tuple(s for s in self.op.shapes if model is None or s.name == model)
        if not self.shapes:
            raise ValueError(f"--model {model}: one of {', '.join(shape_names(device))} on {device}")
        self.declared = device_bytes or self.op.device_bytes
        self.free, self.total = (self.declared, self.declared) if self.declared else device_memory()
        self.headroom = settings().device_headroom.of(self.total)
        self.profiles: dict[str, dict] = {}  # per shape profiled: what its pass measured, as the child gave it
        choose(self.shapes, self._bare, **self._terms())  # the screen: ValueError when nothing could fit

    def _terms(self) -> dict:
        return {"free_bytes": self.free, "total_bytes": self.total, "dtype": self.op.dtype,
                "headroom_bytes": self.headroom, "min_share": self.op.min_share, "models": self.models,
                "page_tokens": PAGE_TOKENS}

    def _bare(self, shape: Shape) -> Measured:
        return Measured(self.total, self.free, 0, shape.params() * DTYPE_BYTES[self.op.dtype],
                        dict.fromkeys(CONFIGS, 0))

    def plan(self, *, seed: int, shm: Path, logs: Path, duration_s: float) -> Plan:
        """Profile the candidate shapes (each in a child process, alone on the device) and plan from what they
        measured. RuntimeError when the measured plan fits no shape, or a profiling pass fails."""
        def measured(shape: Shape) -> Measured:
            print(f"profiling {shape.name}-shaped engines (a pass at max_batch_tokens "
                  f"{self.op.max_batch_tokens} with prompts of {bounds(self.op.prompt_mix)[1]} tokens)...", flush=True)

            def elastic_budget(static: Measured) -> int:  # the largest budget a plan could give, in turn
                return plan(static, shape, dtype=self.op.dtype, headroom_bytes=self.headroom, models=self.models,
                            together=False, page_tokens=PAGE_TOKENS).budget_bytes

            found, figures = measure(setup_for(self.device, shape, 0, duration_s), models=self.models, seed=seed,
                                     shm=shm, logs=logs, declared_bytes=self.declared, elastic_budget=elastic_budget)
            self.profiles[shape.name] = figures
            return found

        try:
            return choose(self.shapes, measured, **self._terms())
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
