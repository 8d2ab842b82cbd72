"""kvtop --replay's n / N and e: every event the log shows is a stop, and e narrows the stops to some kinds.

The recording is the fake fleet's script (``tests/fakes.py``) carried on for twelve more samples, so that it holds
an event of every recorded kind (``kvtop.record.reading.EVENT_KINDS``), each derived by the recorder from the
frames as kvtop's log derives them: a sleep asked, the model asleep, woken by a request; a policy; a limit applied,
one in conflict, an upstream row's total; a model appearing, late, beating again; one gone; a problem file.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fakes import FAKE_T0, sample_fleet
from test_kvtop_replay import at_moment, drive, replay_app, said, until, utc  # noqa: F401 - utc: the zone fixture
from textual.pilot import Pilot

from kvcached_core import ModelSnapshot, Problem
from kvcached_core.segment.snapshot import SleepInfo
from kvtop.frames.source import Frame
from kvtop.record.reading import EVENT_KINDS, Recording
from kvtop.record.recorder import Recorder
from kvtop.replay.source import EVENT_FILTERS

GiB = 1 << 30
SLEEPY = "qwen2-7b"


def sleep(state: str, revision: int) -> SleepInfo:
    return SleepInfo(capable=True, state=state, acked_revision=revision, after_idle_s=None,
                     slept_bytes=3 * GiB if state != "draining" else 0, took_s=0.5 if state != "draining" else 0.0)


def story() -> list[tuple[tuple[ModelSnapshot, ...], tuple[Problem, ...]]]:
    """The fake fleet's six samples (start, stale, a deferred limit and a reclaim, a trim), then one event a sample."""
    source = sample_fleet(big_pages=20_000)
    steps: list[tuple[tuple[ModelSnapshot, ...], tuple[Problem, ...]]] = [(scan, ()) for scan in source.script]
    models = {m.name: m for m in source.script[-1]}
    models[SLEEPY] = replace(models[SLEEPY], sleep=sleep("awake", 0))
    steps[-1] = (tuple(models.values()), ())
    problems: tuple[Problem, ...] = ()

    def change(name: str, **fields: object) -> None:
        models[name] = replace(models[name], **fields)

    phi = replace(models["llama-3-8b"], name="phi-3-mini", path="/dev/shm/kvc.phi-3-mini", pid=1205)
    for what in ("sleep asked", "asleep", "woken by a request", "policy", "limit applied", "limit conflict",
                 "upstream total", "appeared", "late", "beating again", "gone", "problem"):
        if what == "sleep asked":
            change(SLEEPY, sleep=sleep("draining", 1))
        elif what == "asleep":
            change(SLEEPY, sleep=sleep("asleep", 1))
        elif what == "woken by a request":
            change(SLEEPY, sleep=sleep("awake", 1))
        elif what == "policy":
            pressure = models["llama-3-8b"].pressure
            assert pressure is not None
            change("llama-3-8b", pressure=replace(pressure, policy_revision=2, priority=20))
        elif what == "limit applied":
            change("llama-3-8b", limit_bytes=40 * GiB, requested_limit=40 * GiB, limit_status="applied",
                   limit_revision=1, applied_revision=1)
        elif what == "limit conflict":
            change("deepseek-v3-100k", limit_bytes=None, requested_limit=GiB, limit_status="conflict",
                   limit_revision=1, applied_revision=1)
        elif what == "upstream total":
            change("kvcached_vllm_3311", limit_bytes=20 * GiB)
        elif what == "appeared":
            models["phi-3-mini"] = phi
        elif what == "late":
            change("phi-3-mini", late=True)
        elif what == "beating again":
            change("phi-3-mini", late=False)
        elif what == "gone":
            del models["mistral-7b"]
        else:
            problems = (Problem("/dev/shm/kvc.broken", "corrupt", "bad magic"),)
        steps.append((tuple(models.values()), problems))
    return steps


def record_story(directory: Path) -> None:
    """The story written as a recording, a second a sample from FAKE_T0 (as the fake fleet's own recording)."""
    source = sample_fleet(big_pages=20_000)
    recorder = Recorder(directory, gpus=False)
    for step, (scan, problems) in enumerate(story()):
        at = FAKE_T0 + step
        models = tuple(replace(m, read_ns=int(at * 1e9), heartbeat_ns=int(at * 1e9)) for m in scan)
        recorder.write(Frame(models, problems, (), source.gpu_note, source.host_capacity, None, at, source.host))
    recorder.close()


def test_every_recorded_kind_is_in_one_narrower_choice() -> None:
    narrower = [kind for _label, kinds in EVENT_FILTERS[1:] for kind in kinds or ()]
    assert EVENT_FILTERS[0][1] is None
    assert sorted(narrower) == sorted(EVENT_KINDS), "each recorded kind in exactly one of e's choices"


def test_n_and_N_stop_at_every_event_the_log_shows(tmp_path: Path) -> None:
    record_story(tmp_path / "rec")
    with Recording.open(tmp_path / "rec") as rec:
        events = rec.events(rec.start, rec.end)
    assert {e.kind for e in events} == set(EVENT_KINDS), "the story holds an event of every kind"
    stops = sorted({e.at - FAKE_T0 for e in events})
    assert stops == [0, 3, 4, 5, *range(6, 18)]  # the fleet's own (start, stale, limit and reclaim, trim), then one a sample
    app = replay_app(tmp_path / "rec")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0), "the first sample")
        for stop in stops[1:]:
            await pilot.press("n")
            await until(pilot, lambda s=stop: at_moment(app, s), f"the events at +{stop} s")
            first = next(e for e in events if e.at == FAKE_T0 + stop)
            assert said(app, first.text), f"+{stop} s: the notification names {first.text!r}"
        await pilot.press("n")
        await until(pilot, lambda: said(app, "no later event"), "nothing later")
        for stop in reversed(stops[:-1]):
            await pilot.press("N")
            await until(pilot, lambda s=stop: at_moment(app, s), f"back to +{stop} s")
        await pilot.press("N")
        await until(pilot, lambda: said(app, "no earlier event"), "nothing earlier")

    drive(app, script)


def test_e_narrows_the_stops_to_one_kind(tmp_path: Path) -> None:
    record_story(tmp_path / "rec")
    app = replay_app(tmp_path / "rec")
    choice = [label for label, _ in EVENT_FILTERS].index("sleeps and wakes")

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: at_moment(app, 0), "the first sample")
        for _ in range(choice):
            await pilot.press("e")
        await until(pilot, lambda: said(app, "n / N stop at sleeps and wakes"), "the choice said")
        for stop in (6, 7, 8):  # sleep asked, asleep, woken: the trim, the reclaim and the limits pass by
            await pilot.press("n")
            await until(pilot, lambda s=stop: at_moment(app, s), f"the sleep's event at +{stop} s")
        await pilot.press("n")
        await until(pilot, lambda: said(app, "no later event of sleeps and wakes"), "no later sleep")
        assert at_moment(app, 8)
        for _ in range(len(EVENT_FILTERS) - choice):  # round to every event again
            await pilot.press("e")
        await until(pilot, lambda: app.event_filter == 0, "every event again")
        await pilot.press("n")
        await until(pilot, lambda: at_moment(app, 9), "the policy, next of every kind")

    drive(app, script)
