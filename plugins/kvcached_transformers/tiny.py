"""A small, randomly initialised Llama-style model built from a config: nothing is downloaded."""

from __future__ import annotations

from typing import cast

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BOS, EOS, PAD = 1, 2, 0


def tiny_llama_config(*, vocab_size: int = 512, hidden_size: int = 256, layers: int = 4, heads: int = 8,
                      kv_heads: int = 4, intermediate_size: int = 512, max_positions: int = 4096) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads, max_position_embeddings=max_positions,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
    )


def tiny_llama(*, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", **config_kwargs: int) -> LlamaForCausalLM:
    """The same weights for the same seed and config, in eval mode."""
    config = tiny_llama_config(**config_kwargs)
    config.name_or_path = "tiny-llama"
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Module.to, called as transformers wraps it (mypy reads the wrapped method as unbound).
    return cast(LlamaForCausalLM, cast(torch.nn.Module, model).to(device=device, dtype=dtype).eval())


def random_prompts(count: int, *, seed: int = 0, min_len: int = 3, max_len: int = 40,
                   vocab_size: int = 512) -> list[list[int]]:
    """``count`` prompts of different lengths (BOS then random tokens above the special ids)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, count).round().long().tolist()
    order = torch.randperm(count, generator=gen).tolist()
    return [[BOS] + torch.randint(3, vocab_size, (lengths[i] - 1,), generator=gen).tolist() for i in order]
