"""``kvtop --demo`` in a real terminal: tmux runs it, capture-pane reads the screen, send-keys types."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import child_env
from procs import end, end_group, group_members, start

from kvcached_core.segment.procinfo import is_alive
from kvcached_core.segment.reader import list_models

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0


# What the terminal the tests run in sets for its children: inside tmux, TMUX and TERM; and GNU readline
# (which pytest imports) exports that terminal's LINES and COLUMNS into the environment every child
# inherits, so kvtop in a pane would draw for the outer terminal's size, not the pane's.
OUTER_TERMINAL = ("TMUX", "TMUX_PANE", "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "LINES", "COLUMNS", "STY", "WINDOW")


class Tmux:
    """One private tmux server (its own socket file, no user config, an environment without the outer
    terminal's) holding one session; ``kill`` ends the panes' processes, the server and its socket."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="kvtop-tmux-"))  # short: a socket path has 107 bytes
        self.socket = str(self.directory / "socket")
        self.session = "kvtop"
        env = {k: v for k, v in child_env().items() if k not in OUTER_TERMINAL}
        self.env = {**env, "TERM": "xterm-256color"}

    def __call__(self, *args: str) -> str:
        proc = start(["tmux", "-S", self.socket, "-f", "/dev/null", *args], stdin=subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            end(proc, grace=1)
            raise AssertionError(f"tmux {' '.join(args)} did not answer within 20 s") from None
        if proc.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {err.strip()}")
        return out

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", self.session)

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", self.session, *keys)

    def wait_for(self, condition: Callable[[str], bool], what: str, timeout: float = TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if condition(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")

    def kill(self) -> None:
        """End what runs in the panes (each pane's shell leads its own process group: SIGTERM, so that
        kvtop stops its demo models, then SIGKILL), then the server; remove the socket."""
        try:
            panes = [int(pid) for pid in self("list-panes", "-a", "-F", "#{pane_pid}").split()]
            server = int(self("display-message", "-p", "#{pid}").strip())
        except AssertionError:  # no server: the test failed before it started one
            panes, server = [], None
        for pane in panes:
            end_group(pane)
        with contextlib.suppress(AssertionError):
            self("kill-server")
        deadline = time.monotonic() + 10
        while server is not None and group_members(server) and time.monotonic() < deadline:
            time.sleep(0.05)  # a server leads its own group (it daemonized); a zombie is not counted
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    server = Tmux()
    yield server
    server.kill()


def title_line(screen: str) -> str:
    return next((line for line in screen.splitlines() if "page map" in line), "")


def test_kvtop_demo_in_tmux(tmux: Tmux, shm_dir: Path, tmp_path: Path) -> None:
    rc_file = tmp_path / "rc"
    kvtop = Path(sys.executable).with_name("kvtop")
    command = [str(kvtop)] if kvtop.exists() else [sys.executable, "-m", "kvtop.app"]
    shell = f"{' '.join(command)} --demo --demo-models 3 --interval 0.25; echo $? > {rc_file}"
    env = child_env()
    tmux("new-session", "-d", "-s", tmux.session, "-x", "132", "-y", "40",
         "-e", f"KVCACHED_SHM_DIR={env['KVCACHED_SHM_DIR']}", "-e", f"KVCACHED_HOST_CAPACITY={env['KVCACHED_HOST_CAPACITY']}",
         "-e", f"PYTHONPATH={env['PYTHONPATH']}", "-e", "TERM=xterm-256color", "sh", "-c", shell)

    names = ("demo-llama-3-8b", "demo-mistral-7b", "demo-qwen2-7b")
    screen = tmux.wait_for(lambda s: all(n in s for n in names) and "page map · demo-" in s, "the demo fleet")
    assert "no NVIDIA GPU: host backend" in screen or "GPU 0" in screen
    assert "page map · demo-llama-3-8b" in title_line(screen)  # first by name is selected
    demo_pids = {m.name: (m.pid, m.start_time) for m in list_models()}
    assert set(demo_pids) == set(names)
    tmux.wait_for(lambda s: "watching 3 models" in s or "appeared" in s, "the event log")

    tmux.keys("j")
    tmux.wait_for(lambda s: "page map · demo-mistral-7b" in title_line(s), "j to select the next model")
    tmux.keys("s")
    tmux.wait_for(lambda s: "sort mapped" in s, "s to sort by mapped bytes")
    tmux.keys("space")
    tmux.wait_for(lambda s: "PAUSED" in s, "space to pause")
    frozen = tmux.screen()
    time.sleep(1.0)  # paused: nothing is read, the clock in the status line stands still
    assert tmux.screen().splitlines()[0] == frozen.splitlines()[0]
    tmux.keys("space")
    tmux.wait_for(lambda s: "PAUSED" not in s, "space to resume")
    tmux.keys("z")
    tmux.wait_for(lambda s: "(zoom)" in title_line(s) or "one page per cell: Z zooms out" in s
                  or "nothing to zoom" in s, "z to zoom the page map (or to say it shows one page per cell already)")
    tmux.keys("?")
    tmux.wait_for(lambda s: "kvtop — keys" in s and "Trim all" in s, "the help screen")
    tmux.keys("Escape")
    tmux.wait_for(lambda s: "kvtop — keys" not in s and "page map" in s, "escape to close the help")
    tmux.keys("t")
    tmux.wait_for(lambda s: "Trim demo-" in s, "the trim confirmation")
    tmux.keys("n")
    tmux.wait_for(lambda s: "Trim demo-" not in s, "n to cancel the trim")

    tmux.keys("q")
    deadline = time.monotonic() + TIMEOUT_S
    while not rc_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rc_file.exists(), "kvtop did not exit after q:\n" + tmux.screen()
    assert rc_file.read_text().strip() == "0"
    assert not [f for f in os.listdir(shm_dir) if f.startswith("kvc.")], "a demo segment was left behind"
    deadline = time.monotonic() + 10
    while any(is_alive(pid, started) for pid, started in demo_pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(pid, started) for pid, started in demo_pids.values()), "a demo model outlived kvtop"


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_kvtop_stops_the_demo_fleet(tmux: Tmux, shm_dir: Path, tmp_path: Path, how: str) -> None:
    """Ctrl-C or SIGTERM (not q) still stops the demo models and removes their segments."""
    import psutil

    rc_file = tmp_path / "rc"
    env = child_env()
    shell = f"{sys.executable} -m kvtop.app --demo --demo-models 2; echo $? > {rc_file}"
    tmux("new-session", "-d", "-s", tmux.session, "-x", "100", "-y", "30",
         "-e", f"KVCACHED_SHM_DIR={env['KVCACHED_SHM_DIR']}", "-e", f"KVCACHED_HOST_CAPACITY={env['KVCACHED_HOST_CAPACITY']}",
         "-e", f"PYTHONPATH={env['PYTHONPATH']}", "-e", "TERM=xterm-256color", "sh", "-c", shell)
    tmux.wait_for(lambda s: "demo-qwen2-7b" in s and "page map · demo-" in s, "the demo fleet")
    demo = [(m.pid, m.start_time) for m in list_models()]
    assert len(demo) == 2
    if how == "ctrl-c":
        tmux.keys("C-c")
    else:
        shell_pid = int(tmux("display-message", "-p", "-t", tmux.session, "#{pane_pid}").strip())
        [kvtop] = [p for p in psutil.Process(shell_pid).children() if "kvtop.app" in " ".join(p.cmdline())]
        kvtop.send_signal(15)
    deadline = time.monotonic() + TIMEOUT_S
    while not rc_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rc_file.exists(), f"kvtop did not exit after {how}:\n" + tmux.screen()
    assert rc_file.read_text().strip() == "0"
    assert not [f for f in os.listdir(shm_dir) if f.startswith("kvc.")]
    assert not any(is_alive(p, s) for p, s in demo)


def test_kill_9_of_kvtop_demo_ends_its_demo_models(tmux: Tmux, shm_dir: Path) -> None:
    """SIGKILL runs no cleanup in kvtop: its models end on their own (parent-death signal, stdin closed)."""
    import psutil

    env = child_env()
    tmux("new-session", "-d", "-s", tmux.session, "-x", "100", "-y", "30",
         "-e", f"KVCACHED_SHM_DIR={env['KVCACHED_SHM_DIR']}", "-e", f"KVCACHED_HOST_CAPACITY={env['KVCACHED_HOST_CAPACITY']}",
         "-e", f"PYTHONPATH={env['PYTHONPATH']}", "-e", "TERM=xterm-256color",
         "sh", "-c", f"{sys.executable} -m kvtop.app --demo --demo-models 2; sleep 600")
    tmux.wait_for(lambda s: "demo-qwen2-7b" in s and "page map · demo-" in s, "the demo fleet")
    demo = [(m.pid, m.start_time) for m in list_models()]
    assert len(demo) == 2
    shell_pid = int(tmux("display-message", "-p", "-t", tmux.session, "#{pane_pid}").strip())
    [kvtop] = [p for p in psutil.Process(shell_pid).children() if "kvtop.app" in " ".join(p.cmdline())]
    kvtop.kill()
    deadline = time.monotonic() + TIMEOUT_S
    while any(is_alive(p, s) for p, s in demo) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(p, s) for p, s in demo), "a demo model outlived kvtop's SIGKILL"
    while [f for f in os.listdir(shm_dir) if f.startswith("kvc.")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [f for f in os.listdir(shm_dir) if f.startswith("kvc.")], "a demo segment was left behind"
