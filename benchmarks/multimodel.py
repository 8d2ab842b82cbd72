"""Several models sharing one KV budget against static fixed shares: the command line of one harness.

    python -m benchmarks multimodel [--engine vllm|transformers] [--device cpu|cuda] [--shape SHAPE] [--single]
                                    [--pairs N] [--seed N] [--share BLOCKS|SIZE] [--quick] [--duration SEC]
                                    [--scale small|operator] [--model SHAPE] [--device-memory SIZE]
                                    [--time-limit SEC] [--screenshot PATH] [--out DIR] [--no-write]

Both configurations replay the same trace with the same method (``benchmarks/fair/``, written once; each engine a
driver): every engine of both configurations up throughout; one discarded warm-up replay per configuration, then
``--pairs`` ABBA pairs (S E, E S, ...); per pair the ratios p99 TTFT static/elastic, throughput elastic/static and
the mean decode time per output token (TPOT) static/elastic, their median and range; every run listed with the counters that explain it (requests per step, steps with
requests waiting, admissions refused by the budget and by which gate, bytes claimed but unused, offload rounds or
preemptions, reclaims given and taken). Shapes (``--shape``): ramps (staggered peaks), bursty, saturated and steady
(every model at its static share's capacity all along: elastic has nothing to win). ``--single``: one model,
elastic with a budget equal to one static share, against plain static: the cost of the allocator alone.

- ``--engine transformers`` (``benchmarks/fair/tcb.py``): transformers' continuous batching, one process per
  model, the peak rate calibrated on a static share in the run;
- ``--engine vllm`` (``benchmarks/fair/vllm.py``, the default): real vLLM servers on the tiny Llama (CPU).

The peak rate (transformers, ``benchmarks/fair/load.py``): twice what one static share serves and, at operator
scale, high enough that at the peak the KV of the requests in flight reaches twice a share (steady excepted: each
model at its share's capacity); both figures measured in the run, the rule printed.

``--scale operator`` (transformers): the largest Llama shape (or ``--model``'s) whose engines of both configurations
fit the device at once, else in turn; each static share what is left of the device's free memory after every
engine's weights, CUDA context and working-memory peak, measured by a profiling pass at ``max_batch_tokens`` with
the longest prompts, and the headroom (``KVCACHED_DEVICE_HEADROOM``) (``benchmarks/fair/scale.py``,
``benchmarks/fair/profile.py``; the plan is printed before the engines start; ``--device-memory`` declares the
device's size instead of reading it), long-context prompts (``benchmarks/fair/longctx.py``); on the saturated shape
a third configuration, one plain engine given the whole budget. ``--screenshot PATH``: kvtop's screen (SVG, 160x50)
saved during the counted elastic runs, once a reclaim has happened (needs textual; nothing else here does).

An engine that dies (at its start, in calibration, in a run) ends the command within seconds with its own error line
(its log kept and named); every run checks that each request was answered with at least one token.

Results go to ``benchmarks/results/multimodel-<engine>-...{json,md,png}`` (or ``--out``), rewritten after every
run. Exit status: 0 every request answered, 1 a failure (an engine died, a request unanswered), 2 bad usage,
130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

from .fair import report as rep
from .fair.trace import SHAPES

RESULTS = Path(__file__).resolve().parent / "results"
PREFIX = {"on": (True,), "off": (False,), "both": (True, False)}
DEFAULT_SEED = 31


def share_blocks(text: str | None, block_bytes: int) -> int | None:
    """``--share``: a block count, or a size (``48MiB``) in whole blocks of ``block_bytes``; ValueError if neither."""
    if text is None:
        return None
    if text.isdigit():
        blocks = int(text)
    else:
        from kvcached_core.sizes import parse_size

        size = parse_size(text)
        if size is None:
            raise ValueError(text)
        blocks = size // block_bytes
    if blocks < 1:
        raise ValueError(text)
    return blocks


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks multimodel", description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with --engine transformers")
    p.add_argument("--shape", choices=SHAPES, default="ramps", help="the trace's shape (default ramps)")
    p.add_argument("--single", action="store_true",
                   help="one model, elastic with one static share's budget, against static: the allocator's cost")
    p.add_argument("--pairs", type=int, default=4, help="ABBA pairs after the warm-ups (default 4)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"the trace's and the weights' seed ({DEFAULT_SEED})")
    p.add_argument("--share", metavar="BLOCKS|SIZE", help="a static share: blocks, or a size such as 48MiB")
    p.add_argument("--quick", action="store_true", help="a shorter trace (transformers: half; vLLM: two models, a "
                   "third of the time)")
    p.add_argument("--duration", type=float, metavar="SEC", help="the trace's length in seconds (--quick halves it "
                   "with transformers)")
    p.add_argument("--scale", choices=("small", "operator"), default="small",
                   help="transformers: today's small shares, or operator scale (real model sizes, long prompts)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="--scale operator: plan for a device of this size (such as 80GiB) instead of the one here")
    p.add_argument("--model", metavar="SHAPE",
                   help="--scale operator: this model shape only (such as Llama-3.1-8B) instead of the largest that "
                        "fits")
    p.add_argument("--time-limit", type=float, metavar="SEC",
                   help="no pair starts that would not end within SEC seconds of the command's start (judged by the "
                        "longest run so far); the report says what was left out")
    p.add_argument("--screenshot", type=Path, metavar="PATH",
                   help="transformers: save kvtop's screen (SVG, 160x50) during the counted elastic runs (needs "
                        "textual)")
    p.add_argument("--out", type=Path, metavar="DIR", help="write the report here instead of benchmarks/results/")
    p.add_argument("--no-write", action="store_true", help="print the report only")
    p.add_argument("--plot", type=Path, metavar="JSON", help="draw the picture of a written report again")
    p.add_argument("--prefix", choices=sorted(PREFIX), default="on",
                   help="vLLM: prefix caching in both configurations: on (the default), off, or both (one run each)")
    p.add_argument("--trace", type=Path, help="replay this trace file instead (JSON, its 'requests' rows of t, model, "
                   "prompt_tokens, max_tokens, seed; transformers: no calibration, no rule)")
    p.add_argument("--make-trace", action="store_true", help="vLLM: write the recorded trace again (fixed seed)")
    p.add_argument("--keep-logs", action="store_true", help="vLLM: keep the engines' logs (their folder is printed)")
    return p


def stem(args: argparse.Namespace) -> Path | None:
    if args.no_write:
        return None
    name = f"multimodel-{args.engine}" + (f"-{args.device}" if args.engine == "transformers" else "")
    name += ("-operator" if args.engine == "transformers" and args.scale == "operator" else "")
    name += f"-{args.shape}" + ("-single" if args.single else "") + ("-quick" if args.quick else "")
    return (args.out or RESULTS) / name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    if args.plot:
        return 0 if rep.replot(args.plot) else 1
    if args.pairs < 1:
        p.error("--pairs must be 1 or more")
    if args.duration is not None and not args.duration > 0:
        p.error("--duration must be more than 0 seconds")
    if args.time_limit is not None and not args.time_limit > 0:
        p.error("--time-limit must be more than 0 seconds")
    command = " ".join(["python -m benchmarks multimodel", *argv])
    from .fair.run import run

    if args.engine == "transformers":
        from .fair import tcb

        problem = tcb.check_machine(args.device)
        if problem:
            print(f"multimodel: {problem}", file=sys.stderr)
            return 2
        setup = tcb.MODELS[args.device]
        device_bytes = None
        if args.device_memory is not None:
            from kvcached_core.sizes import SizeError, parse_size

            try:
                device_bytes = parse_size(args.device_memory)
            except SizeError:
                device_bytes = None
            if not device_bytes:
                p.error(f"--device-memory {args.device_memory}: a size such as 80GiB")
            if args.scale != "operator":
                p.error("--device-memory goes with --scale operator")
        if args.scale == "operator" and args.share is not None:
            p.error("--share goes with --scale small: operator scale plans its shares")
        if args.model is not None and args.scale != "operator":
            p.error("--model goes with --scale operator")
        if args.screenshot is not None and importlib.util.find_spec("textual") is None:
            p.error("--screenshot needs textual (kvtop's screen), which is not installed here: leave it out")
        try:
            blocks = share_blocks(args.share, setup.block_bytes)
        except ValueError:
            p.error(f"--share {args.share}: a block count or a size such as 48MiB, at least one block "
                    f"({setup.block_bytes >> 10} KiB)")
        duration = args.duration or (None if args.scale == "operator" else setup.duration_s)
        if duration is not None and args.quick:
            duration /= 2
        try:
            driver = tcb.TcbDriver(device=args.device, models=1 if args.single else 3, shape=args.shape,
                                   seed=args.seed, share_blocks=blocks, duration_s=duration, scale=args.scale,
                                   device_bytes=device_bytes, screenshot=args.screenshot, model=args.model,
                                   trace_file=args.trace)
        except ValueError as exc:
            print(f"multimodel: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:
            print(f"multimodel: {exc}", file=sys.stderr)
            return 1
        return run(driver, pairs=args.pairs, seed=args.seed, shape=args.shape, single=args.single,
                   command=command, stem=stem(args), time_limit_s=args.time_limit)
    return vllm_main(p, args, command)


def vllm_main(p: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> int:
    from .fair import vllm
    from .fair.run import run

    if args.make_trace:
        vllm.TRACE.parent.mkdir(exist_ok=True)
        vllm.TRACE.write_text(json.dumps({"seed": 24, "models": 3, "duration_s": 150.0,
                                          "system_prompt_tokens": vllm.SYSTEM_PROMPT_TOKENS,
                                          "requests": vllm.make_trace()}) + "\n")
        return 0
    try:
        blocks = share_blocks(args.share, vllm.BLOCK_BYTES)
    except ValueError:
        p.error(f"--share {args.share}: a block count or a size such as 32MiB, at least one block")
    if importlib.util.find_spec("vllm") is None:
        print(vllm.INSTALL_HINT, file=sys.stderr)
        return 1
    code = 0
    for on in PREFIX[args.prefix]:
        tmp = Path(tempfile.mkdtemp(prefix="kvcached-multimodel-"))  # kept on failure: the engines' logs
        driver = vllm.VllmDriver(workdir=tmp, shape=args.shape, seed=args.seed, single=args.single, quick=args.quick,
                                 prefix_caching=on, share_blocks=blocks, trace_file=args.trace,
                                 duration_s=args.duration)
        where = stem(args)
        if where is not None and not on:
            where = where.with_name(where.name + "-prefix-off")
        code = max(code, run(driver, pairs=args.pairs, seed=args.seed, shape=args.shape, single=args.single,
                             command=command, stem=where, time_limit_s=args.time_limit))
        if code == 0 and not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"engine logs: {tmp}", file=sys.stderr)
        if code:
            break
    return code


if __name__ == "__main__":
    raise SystemExit(main())
