"""The event log names the kind of late a model is: a heartbeat that stopped, or a process stopped inside a publish
(segment/stuck.py: its figures are then the last known, and the log says how old), and what ends each."""

from __future__ import annotations

from dataclasses import replace

from fakes import fake_model
from test_frozen_publish import parked, resume

import kvcached_core as kc
from kvtop.frames.events import diff


def test_a_model_stopped_inside_a_publish_is_logged_as_such_and_then_publishing_again(spawn_allocator, shm_dir):
    proc = parked(spawn_allocator, shm_dir, words=0)
    try:
        stopped = kc.snapshot("frozen")
        assert stopped.late and stopped.figures_age_s is not None
        on_time = replace(stopped, late=False, figures_ns=0)  # the same model a refresh earlier, publishing
        (went,) = diff((on_time,), (stopped,), 1.0)
        assert went.kind == "late" and went.level == "warn"
        assert went.text.startswith(f"late: its process (pid {proc.pid}) stays inside a publish (stopped, or held "
                                    "by a debugger); its figures are the last known, "), went.text
        assert went.text.endswith(" s old") and "heartbeat" not in went.text
        resume(proc)
        after = kc.snapshot("frozen")
        (back,) = diff((stopped,), (after,), 2.0)
        assert (back.kind, back.text, back.level) == ("live", "publishing again", "good")
    finally:
        proc.kill()


def test_a_late_heartbeat_keeps_its_words_and_a_change_of_kind_is_logged_again() -> None:
    on_time = fake_model("m", read_ns=10_000_000_000)
    beating_late = replace(on_time, late=True)
    stuck = replace(on_time, late=True, figures_ns=7_500_000_000)  # its figures 2.5 s old at this read
    (went,) = diff((on_time,), (beating_late,), 1.0)
    assert went.text == "late: pid 4242 runs but its heartbeat stopped (stopped or overloaded)"
    (turned,) = diff((beating_late,), (stuck,), 2.0)
    assert turned.kind == "late" and "stays inside a publish" in turned.text and turned.text.endswith("2.5 s old")
    assert diff((stuck,), (replace(stuck, read_ns=11_000_000_000),), 3.0) == []  # still stuck: said once
    (back,) = diff((beating_late,), (on_time,), 4.0)
    assert back.text == "beating again"
