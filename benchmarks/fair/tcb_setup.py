"""What one transformers comparison runs: the model's shape, a static share, the trace's lengths and the engines'
batching limits (:class:`Setup`), the small-scale setups per device (:data:`MODELS`; operator scale makes its own,
:mod:`.opscale`), and the elastic engines' warm pools (:data:`WARM_POOL`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .longctx import bounds, draw

PAGE_TOKENS = 256  # transformers' block (page_size): one kvcached block per sector
# elastic engines' warm pools, as the vLLM driver sets them: a shared budget is not held in idle pools
WARM_POOL = {"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "1", "KVCACHED_IDLE_RETURN_S": "1"}


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
