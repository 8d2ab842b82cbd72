"""A tiny random Llama saved as a local model directory that vLLM loads: nothing is downloaded.

Tests, the example and the benchmark build it once (a second or two) and point vLLM at the
directory; the same seed gives the same weights, so greedy tokens are reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

VOCAB = 512
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def build_tiny_llama(directory: str | Path, *, seed: int = 0, layers: int = 4, hidden: int = 256,
                     heads: int = 4, kv_heads: int = 2, max_positions: int = 4096) -> Path:
    """Write a random Llama (``layers`` x ``hidden``) and a word-level tokenizer to ``directory``.

    Returns the directory. An existing build with the same settings is reused as it is.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    stamp = {"seed": seed, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
             "max_positions": max_positions}
    marker = out / "kvcached-tiny.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    legacy_dtype: dict[str, Any] = {"torch_dtype": "bfloat16"}  # a key the config accepts but its signature omits
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, **legacy_dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Module.to, called as transformers wraps it (mypy reads the wrapped method as unbound).
    model = cast(LlamaForCausalLM, cast(torch.nn.Module, model).to(torch.bfloat16).eval())
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
