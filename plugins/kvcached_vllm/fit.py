"""Requests that can never fit: ended as vLLM ends a request at its length cap, not retried forever.

A limit set from outside (``kvctl limit``) or a device budget can leave a model less KV memory than one
request needs. vLLM would keep such a request waiting at the head of its queue (holding every request
behind it), or, once it runs and grows past the limit, preempt the others and itself and recompute them
without end. After every step the scheduler here ends each request whose tokens need more blocks than
the model could ever hold (``KVCacheManager.max_blocks``), with vLLM's own ``length`` finish reason: the
client gets the tokens generated so far, as at ``--max-model-len``, and the engine log says why.
"""

from __future__ import annotations

import logging
from itertools import chain, islice
from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from kvcached_core import KVCacheManager

log = logging.getLogger(__name__)

LOOK = 4096  # requests looked at per step, at most (running first, then the head of the queue)


def unfit(scheduler: Any, manager: KVCacheManager, placeholders: int) -> list[Any]:
    """The scheduler's requests whose tokens need more blocks than the model could ever give them."""
    most = manager.max_blocks() - placeholders
    size = scheduler.block_size
    if most * size >= scheduler.max_model_len:
        return []  # every request vLLM accepts fits: the usual case, one comparison a step
    return [r for r in islice(chain(scheduler.running, scheduler.waiting), LOOK) if -(-r.num_tokens // size) > most]


def end_unfit(scheduler: Any, manager: KVCacheManager, placeholders: int,
              outputs: dict[int, EngineCoreOutputs]) -> None:
    """End the requests that can never fit (see the module's docstring); their outputs join this step's."""
    requests = unfit(scheduler, manager, placeholders)
    if not requests:
        return
    most = manager.max_blocks() - placeholders
    for request in requests:
        log.warning("kvcached: request %s needs %d tokens of KV, more than model %r can ever hold (%d blocks of %d "
                    "tokens under its limit and the device budget): ended as 'length'", request.request_id,
                    request.num_tokens, manager.name, most, scheduler.block_size)
    ended = scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_LENGTH_CAPPED)
    for request in ended:
        step = outputs.get(request.client_index)
        if step is None:
            step = outputs[request.client_index] = EngineCoreOutputs(outputs=[])
        mine = next((o for o in step.outputs if o.request_id == request.request_id), None)
        if mine is not None:  # it produced a token this step: that output now says it is the last
            mine.finish_reason = request.get_finished_reason()
        else:
            step.outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                 finish_reason=request.get_finished_reason()))
