"""The transformers driver: each model one process running transformers' own continuous batching
(``init_continuous_batching``, greedy, ``sdpa``, no CUDA graphs, no async batching, no prefix sharing: the same in
both configurations), random weights built in place (``MODELS`` says which sizes and why).

- **static**: plain transformers, each model with a fixed cache of one share (``ContinuousBatchingConfig.num_blocks``);
- **elastic**: the same engines on kvcached (``kvcached_transformers.cb.install``), one budget shared by every
  model (``KVCACHED_DEVICE_BUDGET`` on a GPU, ``KVCACHED_HOST_CAPACITY`` on CPU), each model's capacity the whole
  budget. The budget is the static caches added up, their two padding blocks each included.

The peak rate comes from declared rules applied to figures measured in the run (:mod:`.load`): the requests per
second one static share serves and a request's service time there, measured by a short calibration
(``CALIBRATION_FACTOR`` times the requests its cache holds at once, all submitted together to one static engine):
twice that rate, and at operator scale at least the rate at which the KV of the requests in flight reaches twice a
share at the peak (steady excepted; the small scale's recorded results were made with the rate rule alone).
Counters per run, read in every engine: steps and the requests they carried (transformers' ``schedule_batch``),
steps that left requests waiting, offload rounds; admissions refused by the shared budget and pooled bytes come
from the plugin's ``stats`` where it has one (``n/a`` otherwise).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from .load import request_kv_bytes, traffic
from .opscale import OPERATOR, Planner, setup_for
from .scale import Plan
from .tcb_engines import Engines, context
from .tcb_setup import MODELS, PAGE_TOKENS, WARM_POOL, Setup, share_bytes

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION_FACTOR = 3  # calibration: three times the requests a static share holds at once


# -- one configuration's engines -------------------------------------------------------------------
def start_engines(setup: Setup, models: int, elastic: bool, shm: Path, seed: int, logs: Path, *,
                  static_blocks: int | None = None, letter: str | None = None, profile_pass: int = 0) -> Engines:
    """``models`` engines of one configuration, starting (each a child process, :mod:`.tcb_child`). Elastic: one
    budget of ``models`` static shares shared by all, each engine's capacity the whole budget; static:
    ``static_blocks`` each (default one share). ``letter``: the engines' names' prefix; ``profile_pass``: the
    requests of the profiling pass each runs as its warm-up (:mod:`.profile`; 0: none)."""
    names = [f"{letter or ('e' if elastic else 's')}{m}" for m in range(models)]
    budget = models * share_bytes(setup)
    env = {"KVCACHED_SHM_DIR": str(shm), "OMP_NUM_THREADS": str(setup.threads)}
    if elastic:
        env.update({"KVCACHED_DEVICE_BUDGET" if setup.device == "cuda" else "KVCACHED_HOST_CAPACITY":
                    f"{budget >> 20}MiB", **WARM_POOL})
    blocks = budget // setup.block_bytes - 2 if elastic else static_blocks or setup.share_blocks
    specs = [{"name": name, "elastic": elastic, "seed": seed + m, "num_blocks": blocks, "env": env,
              "setup": setup.__dict__, "profile_pass": profile_pass} for m, name in enumerate(names)]
    return Engines(context(), names, specs, shm=shm if elastic else None, vocab=setup.vocab, logs=logs)


def calibrate(static: Engines, setup: Setup, seed: int) -> dict:
    """Requests per second one static share serves (CALIBRATION_FACTOR x what it holds, submitted at once), and the
    service time of a request there: the shortest time to a first token (a prefill that did not queue) plus the
    mean time from first token to last."""
    from .method import START_DELAY_S, replay

    count = CALIBRATION_FACTOR * setup.fits_at_once
    rng = random.Random(seed - 1)
    rows = [{"t": 0.0, "model": "m0", "prompt_tokens": setup.draw_prompt(rng),
             "max_tokens": rng.randint(*setup.output_tokens), "seed": rng.randrange(1 << 30)} for _ in range(count)]
    started = time.perf_counter()
    result = replay(static, rows, "calibration", timeout_s=300)  # RunFailed unless every request is answered
    took = time.perf_counter() - started - START_DELAY_S
    ttfts = [ttft for _, _, ttft in result["ttft_by_arrival"] if ttft is not None]
    service = min(ttfts) + result["decode_s_mean"]  # a request's prefill unqueued, then its decode at the share's load
    return {"requests": count, "seconds": round(took, 2), "requests_per_s": round(count / took, 3),
            "service_s": round(service, 3)}


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


class TcbDriver:
    """Both configurations of ``models`` transformers engines (a :class:`.run.Driver`).

    ``scale="operator"``: the setup :func:`operator_plan` makes for the device (printed before starting), the
    long-context trace, names that say the configuration (``static-m0``, ``elastic-m0``...); the configurations in
    turn when the plan says so; on the saturated shape one plain engine given the whole budget (:meth:`alone`);
    ``screenshot``: kvtop's screen saved during the counted elastic runs (:mod:`.screenshot`)."""

    title = "transformers continuous batching, static against elastic"

    def __init__(self, *, device: str, models: int, shape: str, seed: int, share_blocks: int | None = None,
                 duration_s: float | None = None, scale: str = "small", device_bytes: int | None = None,
                 screenshot: Path | None = None, model: str | None = None, trace_file: Path | None = None) -> None:
        """ValueError (one line, nothing started) when ``trace_file`` is no trace, or at operator scale when no model
        shape could fit the device. ``trace_file``: replay it as recorded instead of a calibrated shape."""
        from .trace import read_trace

        self.trace_file = trace_file
        self.recorded = None if trace_file is None else read_trace(trace_file, models)
        self.plan: Plan | None = None
        self.planner: Planner | None = None
        self.duration_s = duration_s
        if scale == "operator":
            self.planner = Planner(device, models=models, model=model, device_bytes=device_bytes)
            self.duration_s = duration_s or OPERATOR[device].durations[shape]
            setup = setup_for(device, self.planner.shapes[0], 0, self.duration_s)  # until start() plans
        else:
            setup = MODELS[device]
            if duration_s is not None:
                setup = Setup(**{**setup.__dict__, "duration_s": duration_s})
        if share_blocks is not None:
            setup = Setup(**{**setup.__dict__, "share_blocks": share_blocks})
        self.setup, self.device, self.models, self.shape, self.seed = setup, device, models, shape, seed
        self.scale, self.screenshot = scale, screenshot
        self.together = True
        self.groups: dict[str, Engines] = {}
        self.calibration: dict = {}
        self.traffic: dict = {}
        self.traffic_lines: list[str] = []
        self.peak_rate = 0.0
        self.picture: dict = {}
        self.started_engines: list[str] = []  # when each group's engines were started (in turn: more than once)
        self.engine_working: dict[str, list[int | None]] = {}  # per engine, what each start's warm-up pass measured
        import tempfile

        # named for this process, so that whoever started it can tell its directory from another run's
        self.shm = Path(tempfile.mkdtemp(prefix=f"kvc-tcb-{os.getpid()}-",
                                         dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
        self.logs = Path(tempfile.mkdtemp(prefix=f"kvc-tcb-logs-{os.getpid()}-"))  # the engines' output, kept
        # when the command fails

    def _letter(self, config: str) -> str | None:
        return f"{config}-m" if self.scale == "operator" else None

    def _engines(self, config: str) -> Engines:
        group = start_engines(self.setup, self.models, config == "elastic", self.shm, self.seed, self.logs,
                              letter=self._letter(config), profile_pass=self._pass_requests())
        self.started_engines.append(config)
        return group

    def _pass_requests(self) -> int:
        """At operator scale, the blocks of the profiling pass each engine runs as its warm-up: one share's (0: no
        pass)."""
        return 0 if self.plan is None else self.setup.share_blocks

    def _ready(self, group: Engines) -> None:
        group.wait_ready(600)
        if self.plan is not None:  # operator scale: each engine ran a profiling pass as its warm-up
            for name, working in group.working.items():
                self.engine_working.setdefault(name, []).append(working)
            from kvcached_core.sizes import format_bytes

            print("engines up: " + ", ".join(f"{n} (working peak {format_bytes(w) if w is not None else 'n/a'} at its "
                                             "warm-up pass)" for n, w in group.working.items()), flush=True)

    def start(self) -> dict[str, Any]:
        if self.planner is not None:
            assert self.duration_s is not None
            self.plan = self.planner.plan(seed=self.seed, shm=self.shm, logs=self.logs, duration_s=self.duration_s)
            self.setup = setup_for(self.device, self.plan.shape, self.plan.share_blocks, self.duration_s)
            self.together = self.plan.together
            for line in self.plan.lines():
                print(line, flush=True)
        for config in ("static", "elastic") if self.together else ("static",):
            self.groups[config] = self._engines(config)
        for group in self.groups.values():
            self._ready(group)
        return self.groups  # the same dict: in turn, :meth:`around` swaps its engines

    @contextlib.contextmanager
    def around(self, slot: Any) -> Any:
        """Before a run: in turn, this configuration's engines up (the other's stopped), outside the run's clock;
        during the counted elastic runs, kvtop's screen saved until one run saw a reclaim."""
        if slot.configuration in ("static", "elastic") and slot.configuration not in self.groups:
            for config in list(self.groups):
                self.groups.pop(config).stop()
            self.groups[slot.configuration] = self._engines(slot.configuration)
            self._ready(self.groups[slot.configuration])
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
        group = start_engines(self.setup, 1, False, self.shm, self.seed, self.logs, static_blocks=blocks,
                              letter=self._letter("alone") or "a", profile_pass=self._pass_requests())
        self.groups["alone"] = group
        self.started_engines.append("alone")
        self._ready(group)
        return group

    def trace(self) -> list[dict]:
        from .trace import make_trace

        s = self.setup
        if self.recorded is not None:
            self.traffic = {"trace_file": str(self.trace_file)}
            self.traffic_lines = [f"traffic: the {len(self.recorded)} requests of {self.trace_file}, as recorded (no "
                                  "calibration, no rule)"]
            print(self.traffic_lines[0], flush=True)
            return self.recorded
        self.calibration = cal = calibrate(self.groups["static"], s, self.seed)
        print(f"calibration: one static share served {cal['requests_per_s']} requests/s ({cal['requests']} at once); "
              f"service time {cal['service_s']} s (shortest time to first token + mean decode time)", flush=True)

        def make(rate: float) -> list[dict]:
            return make_trace(shape=self.shape, models=self.models, duration_s=s.duration_s, peak_rate=rate,
                              seed=self.seed, prompt_tokens=s.prompt_tokens, output_tokens=s.output_tokens,
                              prompt_mix=s.prompt_mix or None)

        found = traffic(make, share_rate=cal["requests_per_s"], service_s=cal["service_s"],
                        share_bytes=share_bytes(s), kv_of=lambda row: request_kv_bytes(row, s.block_bytes, PAGE_TOKENS),
                        memory_rule=self.scale == "operator", steady=self.shape == "steady")
        self.traffic, self.peak_rate = found.to_dict(), found.peak_rate
        self.traffic_lines = found.lines()
        for line in self.traffic_lines:
            print(line, flush=True)
        return found.trace

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
                "calibration": cal, "peak_rate": self.peak_rate, "traffic": self.traffic, "duration_s": s.duration_s,
                "engine_working": self.engine_working,
                "timeout_s": s.duration_s * 4 + 60 + (300 if self.scale == "operator" else 0),
                "setup_lines": [
                    f"Models: {s.why}", "", *plan_lines,
                    f"Budget {budget >> 20} MiB: static {self.models} x {s.share_blocks} blocks (+2 padding each), "
                    f"elastic one shared budget. " + (f"Calibration: one static share served {cal['requests_per_s']} "
                    f"requests/s ({cal['requests']} at once), a request's service time {cal['service_s']} s. "
                    f"{s.duration_s:g} s of trace." if cal else ""), "",
                    *(f"- {line.removeprefix('traffic: ')}" for line in self.traffic_lines), "",
                    *self._working_lines()],
                "counters_note": "requests per step and steps with requests waiting are counted in transformers' "
                                 "scheduler (every step that carried a request); claimed but unused is the "
                                 "elastic segments' reserved pages (sampled every 0.5 s, all models); refused "
                                 "admissions and pooled handles come from the plugin's stats; requests preempted "
                                 "are those transformers' offloading took out of its running requests."}

    def _working_lines(self) -> list[str]:
        """The working memory each engine's warm-up pass measured, every start (operator scale)."""
        if not self.engine_working:
            return []
        from kvcached_core.sizes import format_bytes

        said = "; ".join(f"{name} {', '.join(format_bytes(w) if w is not None else 'n/a' for w in ws)}"
                         for name, ws in self.engine_working.items())
        return [f"Working memory each engine's warm-up pass measured (at every start): {said}.", ""]

    def stop(self, failed: bool = False) -> None:
        for group in self.groups.values():
            group.stop()
        if not failed:
            shutil.rmtree(self.logs, ignore_errors=True)
        with contextlib.suppress(OSError):
            for leftover in self.shm.iterdir():
                leftover.unlink()
            self.shm.rmdir()
