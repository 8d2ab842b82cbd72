"""One offline vLLM run (``vllm.LLM``) for the tests: greedy tokens, and what kvcached saw.

Run as a script with a job file; vLLM spawns its processes, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(spec_path: str) -> None:
    job = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], max_model_len=job["max_model_len"], enforce_eager=True, dtype=job["dtype"],
              seed=0, enable_prefix_caching=True)
    # logprobs=0: the sampled token's log-probability, a figure the KV cache's every byte feeds
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=0 if job.get("logprobs") else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    from kvcached_core.segment.reader import list_models  # every segment in KVCACHED_SHM_DIR, plugin on or off

    def look() -> list[dict]:
        return [{"name": m.name, "model": m.model, "engine": m.engine, "pid": m.pid, "device": m.device,
                 "backend": m.backend, "blocks_used": m.blocks_used, "blocks_cached": m.blocks_cached,
                 "num_layers": m.num_layers, "page_size": m.page_size,
                 "groups": None if m.groups is None else [g.to_dict() for g in m.groups]}
                for m in list_models()]

    # the figures once they stopped moving: the allocator publishes the last frees of a step a moment later
    seen, deadline = look(), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = look()
        if again == seen:
            break
        seen = again
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "models": seen, "pid": os.getpid()}
    if job.get("logprobs"):
        result["logprobs"] = [[step[token].logprob
                               for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                              for o in outs]
    with open(job["out"], "w") as fh:
        json.dump(result, fh)
    del llm


if __name__ == "__main__":
    main(sys.argv[1])
