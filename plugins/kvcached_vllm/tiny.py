"""Tiny random models saved as local model directories that vLLM loads: nothing is downloaded.

A Llama (full attention, or sliding-window layers beside full ones) and a DeepSeek-V2 (MLA).
Tests, the example and the benchmark build one once (a second or two) and point vLLM at the
directory; the same seed gives the same weights, so greedy tokens are reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

VOCAB = 512
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def build_tiny_llama(directory: str | Path, *, seed: int = 0, layers: int = 4, hidden: int = 256,
                     heads: int = 4, kv_heads: int = 2, max_positions: int = 4096,
                     sliding_window: int | None = None) -> Path:
    """Write a random Llama (``layers`` x ``hidden``) and a word-level tokenizer to ``directory``.

    With ``sliding_window`` (tokens), every other layer attends to that window only (the even ones,
    Gemma/Mistral style: vLLM gives them a KV cache group of their own). Returns the directory. An
    existing build with the same settings is reused as it is.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp: dict[str, Any] = {"seed": seed, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                             "max_positions": max_positions}
    extra: dict[str, Any] = {"torch_dtype": "bfloat16"}  # a key the config accepts but its signature omits
    if sliding_window is not None:
        stamp["sliding_window"] = sliding_window
        # keys vLLM's Llama reads (transformers' Llama keeps them as they are: its weights do not change)
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        extra["sliding_window"] = sliding_window
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, **extra,
    )
    return _save(Path(directory), LlamaForCausalLM, config, stamp, seed)


def build_tiny_mla(directory: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 256,
                   heads: int = 4, max_positions: int = 4096) -> Path:
    """Write a random DeepSeek-V2 with multi-head latent attention (MLA) and the tokenizer to ``directory``.

    Dense layers only (no experts). The latent cache is 512 + 64 = 576 wide, the only width vLLM's
    CPU MLA kernel runs; its blocks are 16 tokens (36 KiB in float32), so kvcached's page must hold
    whole ones: ``KVCACHED_PAGE_SIZE_MB=18``.
    """
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    stamp = {"seed": seed, "layers": layers, "hidden": hidden, "heads": heads, "max_positions": max_positions,
             "shape": "mla"}
    extra: dict[str, Any] = {"torch_dtype": "bfloat16"}
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=layers, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=max_positions,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **extra,
    )
    return _save(Path(directory), DeepseekV2ForCausalLM, config, stamp, seed)


def _save(out: Path, model_class: Any, config: Any, stamp: dict[str, Any], seed: int) -> Path:
    """Random weights for ``config`` in bfloat16 and the word-level tokenizer, saved to ``out`` (reused when
    ``out`` holds the same build)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    marker = out / "kvcached-tiny.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model: Any = model_class(config)
    # Module.to converts in place (called as transformers wraps it: mypy reads the wrapped method as unbound)
    cast(torch.nn.Module, model).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(out)
    marker.write_text(json.dumps(stamp))
    return out


def prompts(count: int, *, length: int = 24, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """``count`` token-id prompts of ``length`` tokens; the first ``shared_prefix`` tokens are common."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(len(SPECIAL), VOCAB) for _ in range(shared_prefix)]
    return [[1] + prefix + [rng.randrange(len(SPECIAL), VOCAB) for _ in range(length - 1 - shared_prefix)]
            for _ in range(count)]
