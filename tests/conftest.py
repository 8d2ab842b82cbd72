"""Shared fixtures: every test gets its own segment directory, and helpers to run allocators in children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from fake_cuda import fake_cuda  # noqa: F401 - the fake CUDA driver fixture, for every test module
from procs import Processes

from kvcached_core.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def shm_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private KVCACHED_SHM_DIR (on /dev/shm when possible, as in production)."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.getbasetemp()
    directory = Path(os.path.realpath(base)) / f"kvc-test-{os.getpid()}-{time.monotonic_ns()}"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(directory))
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY", "2GiB")
    monkeypatch.delenv("KVCACHED_IPC_NAME", raising=False)
    yield directory
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)
    return value


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: kill() returns before the signal takes effect,
    and an allocator poked by a controller answers within microseconds."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "T"

    wait_for(stopped, what=f"pid {pid} to stop")


def kvctl(*args: str):  # a click Result
    """Run ``kvctl ARGS`` in process with click's CliRunner; an internal traceback fails the test."""
    from click.testing import CliRunner

    from kvtop.cli import main

    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.stderr, result.stderr
    return result


def configured(overrides: Mapping[str, str]) -> Settings:
    """The test's settings with ``overrides`` (``{"KVCACHED_...": value}``), for ``KVCacheManager(settings=...)``:
    an in-process allocator is configured by what it is passed, not by changing os.environ."""
    return Settings.from_env({**os.environ, **overrides})


def child_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(overrides or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def procs():
    """Start child processes with ``procs.start(command, **popen_kwargs)``: default signal dispositions, a
    session of their own; each one's process group is ended at teardown, whether the test passed or not."""
    started = Processes()
    yield started
    started.end_all()


@pytest.fixture
def spawn_allocator():
    """Start ``KVCacheManager(**kwargs)`` in a child process that runs ``script`` then waits for stdin to close.

    The child prints READY once its segment exists; ``env``: variables for its environment beside the test's.
    Returns the Popen; it is killed at teardown.
    """
    procs: list[subprocess.Popen] = []

    def start(name: str = "m1", script: str = "", env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        params = dict(num_blocks=512, block_bytes=64 * 1024, num_layers=2, page_size=256 * 1024)
        params.update(kwargs)
        code = textwrap.dedent(f"""
            import sys
            from kvcached_core import KVCacheManager
            m = KVCacheManager({name!r}, name={name!r}, **{params!r})
        """) + textwrap.dedent(script) + textwrap.dedent("""
            print("READY", flush=True)
            for line in sys.stdin:
                exec(line)
                print("OK", flush=True)
            m.close()
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=child_env(env), text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.strip() == "READY", f"allocator child failed to start: {line!r}"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def send(proc: subprocess.Popen, statement: str) -> None:
    """Run one line of Python in an allocator child and wait for it to finish."""
    proc.stdin.write(statement + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "OK"


def wait_heartbeat_late(path: Path, timeout: float = 10.0) -> None:
    """Wait until the segment at ``path`` has a late heartbeat: ``kvctl clean`` never removes a fresh one."""
    import time as _time

    from kvcached_core.segment import layout as _L
    from kvcached_core.segment.liveness import heartbeat_late

    deadline = _time.monotonic() + timeout
    while not heartbeat_late(_L.U64.unpack_from(path.read_bytes(), _L.HEARTBEAT_OFF)[0], _time.time_ns()):
        if _time.monotonic() > deadline:
            raise AssertionError(f"the heartbeat of {path} stayed fresh for {timeout} s")
        _time.sleep(0.1)
