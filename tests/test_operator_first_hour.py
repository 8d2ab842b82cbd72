"""What a new operator meets in the first hour: sizes without units, a mistyped segment directory,
a demo that cannot start or whose parent is killed, and files left behind."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import child_env, kvctl, send, wait_for
from procs import Processes
from textual.pilot import Pilot

import kvcached_core as kc
from kvcached_core.backends.ledger import LOCK_NAME
from kvcached_core.segment.procinfo import is_alive
from kvtop.cli import COMMANDS as KVCTL_COMMANDS
from kvtop.frames.source import LiveSource
from kvtop.screen.dashboard import KvtopApp
from kvtop.screen.widgets import LimitScreen

MiB = 1024 * 1024
SMALL = dict(num_blocks=64, block_bytes=1 << 16, num_layers=1, page_size=1 << 18)
KVTOP = [sys.executable, "-m", "kvtop.app"]
KVCTL = [sys.executable, "-m", "kvtop.cli"]
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def drive(app: KvtopApp, script: Callable[[Pilot], object], size: tuple[int, int] = (140, 44)) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await script(pilot)  # type: ignore[misc]

    asyncio.run(main())


async def until(pilot: Pilot, condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def without_root_override() -> None:
    """preexec_fn: as root, drop the capabilities that ignore file modes, so 0555 means read-only."""
    if os.getuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


# -- sizes ---------------------------------------------------------------------------------

def test_a_bare_number_in_kvtops_limit_dialog_is_refused_with_a_hint(spawn_allocator) -> None:
    spawn_allocator("m1")
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frame and app.frame.model("m1"), "m1 on screen")
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, LimitScreen), "the limit dialog")
        await pilot.press("4", "enter")
        await pilot.pause(0.2)
        assert isinstance(app.screen, LimitScreen), "a bare 4 was accepted"
        assert "4 what? 4GiB, 4MiB; 4B for bytes" in str(app.screen.query_one("#error").render())
        await pilot.press("backspace", *"100KiB")
        await pilot.pause(0.1)
        preview = str(app.screen.query_one("#preview").render())
        assert "0 page bundles" in preview and "rounds down to 0" in preview
        await pilot.press("escape")

    drive(app, script)
    assert kc.snapshot("m1").limit_revision == 0  # nothing was written


def test_a_limit_below_one_page_bundle_warns_that_it_rounds_down_to_zero(spawn_allocator) -> None:
    spawn_allocator("m1")  # 1 MiB page bundles, 2 GiB host capacity: 0.01% is about 210 KiB
    result = kvctl("limit", "m1", "0.01%", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ("kvctl: warning: m1: 209.7 KiB is less than one page bundle (1.0 MiB): "
                             "the limit rounds down to 0 and the model can take no pages\n")
    assert json.loads(result.stdout)[0]["effective_limit"] == 0
    quiet = kvctl("limit", "m1", "1MiB")  # one whole bundle: no warning
    assert quiet.exit_code == 0 and quiet.stderr == ""


# -- the segment directory -----------------------------------------------------------------

# Each kvctl command, as an operator would type it; a command registered without an entry here fails
# test_every_command_is_tried_on_an_unusable_directory.
TRIED = {
    "list": [("list",), ("list", "--json"), ("list", "--all")],
    "show": [("show", "llama")],
    "frag": [("frag",), ("frag", "llama")],
    "limit": [("limit", "llama", "4GiB"), ("limit", "--all", "none")],
    "trim": [("trim", "llama"), ("trim", "--all")],
    "compact": [("compact", "llama")],
    "policy": [("policy", "llama"), ("policy", "llama", "--priority", "3")],
    "sleep": [("sleep", "llama"), ("sleep", "llama", "--after-idle", "5m")],
    "wake": [("wake", "llama")],
    "watch": [("watch", "--count", "1"), ("watch", "--format", "json", "--count", "1")],
    "clean": [("clean",), ("clean", "--dry-run")],
    "demo": [("demo", "--duration", "1")],
    "export": [("export", "--port", "0")],
    "route": [("route", "--listen", "127.0.0.1:0")],
    "record": [("record", "--duration", "1s")],
    "report": [],  # reads a recording, never the segment directory (tests/test_kvctl_report.py: its bad files)
}
REGISTERED = set(KVCTL_COMMANDS)
COMMANDS = [args for name, tried in TRIED.items() if name in REGISTERED for args in tried]


def test_every_command_is_tried_on_an_unusable_directory() -> None:
    assert not REGISTERED - set(TRIED), f"add {sorted(REGISTERED - set(TRIED))} to TRIED"


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a) for a in COMMANDS])
@pytest.mark.parametrize("what", ["missing", "a-file"])
def test_every_command_says_the_segment_directory_is_unusable(args, what, monkeypatch, tmp_path) -> None:
    where = tmp_path / "shm-typo"
    if what == "a-file":
        where.write_text("not a directory\n")
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(where))
    result = kvctl(*args)
    said = "does not exist" if what == "missing" else "is not a directory"
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stderr == f"kvctl: segment directory KVCACHED_SHM_DIR={where} {said}\n"
    assert result.stdout == ""


def test_kvtop_says_the_segment_directory_is_missing(monkeypatch, tmp_path) -> None:
    where = tmp_path / "nowhere"
    env = {**child_env(), "KVCACHED_SHM_DIR": str(where)}
    once = subprocess.run([*KVTOP, "--once"], capture_output=True, text=True, env=env, timeout=60)
    assert (once.returncode, once.stdout) == (1, "")
    assert once.stderr == f"kvtop: segment directory KVCACHED_SHM_DIR={where} does not exist\n"

    monkeypatch.setenv("KVCACHED_SHM_DIR", str(where))
    app = KvtopApp(LiveSource(), interval=0.2)

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frame is not None, "a first frame")
        await pilot.pause(0.1)
        line = str(app.status_line.render())
        assert f"segment directory KVCACHED_SHM_DIR={where} does not exist" in line
        assert "0 models" not in line
        where.mkdir()  # created later: the line says what is true again
        await until(pilot, lambda: "0 models, 0 live" in str(app.status_line.render()), "the directory to appear")

    drive(app, script)


@pytest.mark.parametrize("what", ["missing", "a-file", "read-only", "proc"])
@pytest.mark.parametrize("tool", ["kvctl demo", "kvtop --demo"])
def test_a_demo_on_an_unusable_directory_is_one_line(tool, what, tmp_path) -> None:
    where = {"missing": tmp_path / "nowhere", "a-file": tmp_path / "file", "read-only": tmp_path / "ro",
             "proc": Path("/proc")}[what]
    if what == "a-file":
        where.write_text("x")
    if what == "read-only":
        where.mkdir(mode=0o555)
    command = [*KVCTL, "demo", "--duration", "5"] if tool == "kvctl demo" else [*KVTOP, "--demo", "--once"]
    env = {**child_env(), "KVCACHED_SHM_DIR": str(where)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60,
                          preexec_fn=without_root_override if what == "read-only" else None)
    prog = tool.split()[0]
    says = {"missing": f"segment directory KVCACHED_SHM_DIR={where} does not exist",
            "a-file": f"segment directory KVCACHED_SHM_DIR={where} is not a directory",
            "read-only": f"segment directory KVCACHED_SHM_DIR={where} is not writable",
            "proc": "did not start: cannot create segment /proc/kvc.demo-" if os.getuid() == 0  # passes access()
            else f"segment directory KVCACHED_SHM_DIR={where} is not writable"}[what]
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: ") and says in lines[0], done.stderr
    assert done.stdout == ""
    if what == "read-only":
        assert os.listdir(where) == []


# -- the demo's children -------------------------------------------------------------------

def demo_models(shm_dir: Path, count: int) -> list[tuple[int, int]]:
    def found() -> list[kc.ModelSnapshot] | None:
        models = [m for m in kc.list_models() if m.status == "live"]
        return models if len(models) == count else None

    return [(m.pid, m.start_time) for m in wait_for(found, 60, f"{count} demo models")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_demo_models_end_with_kvctl_demo_whatever_the_signal(sig, shm_dir: Path, procs: Processes) -> None:
    proc = procs.start([*KVCTL, "demo", "--models", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=child_env(), text=True)
    assert proc.stdout.readline().startswith("demo: 2 simulated models running")
    children = demo_models(shm_dir, 2)
    proc.send_signal(sig)  # to kvctl demo alone: its models must follow by themselves
    proc.wait(timeout=30)
    wait_for(lambda: not any(is_alive(pid, started) for pid, started in children), 15, "the demo models to end")
    wait_for(lambda: not [f for f in os.listdir(shm_dir) if f.startswith("kvc.")], 5, "their segments to go")
    assert "Traceback" not in proc.stderr.read()


def test_a_demo_model_whose_parent_is_gone_before_it_starts_ends_at_once(shm_dir: Path, procs: Processes) -> None:
    """The stdin watchdog covers what PR_SET_PDEATHSIG cannot: a parent gone before the child's prctl."""
    child = procs.start([sys.executable, "-m", "kvtop.demo.fleet", "orphan", "vllm", "1", "0", ""],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), text=True)
    assert child.stdout.readline() == "ready\n"
    assert (shm_dir / "kvc.orphan").exists()
    child.stdin.close()  # what the kernel does to the pipe when the parent dies
    assert child.wait(timeout=15) == 0
    assert not (shm_dir / "kvc.orphan").exists()


def demo_model(name: str) -> kc.ModelSnapshot:
    return kc.snapshot(name)


def serving(name: str) -> bool:
    m = demo_model(name)
    return m.sleep is not None and m.sleep.state == "awake" and m.blocks_used > 0


def test_a_demo_model_sleeps_as_kvctl_asks_and_wakes_on_kvctl_wake_or_a_request(shm_dir: Path) -> None:
    """The first model a newcomer steers can sleep: it drains, frees every block, unmaps every page, and
    serves again after kvctl wake, or when a request reaches it through its endpoint (as the README's tour does
    with curl); its own simulated users never wake it."""
    from kvtop.demo.fleet import DemoFleet

    with DemoFleet(models=1) as fleet:
        assert fleet.wait_ready(timeout=60), fleet.failure
        name = fleet.names()[0]
        wait_for(lambda: serving(name), 60, "the demo model's traffic")
        done = kvctl("sleep", "demo-llama", "--wait")  # running requests finish first
        assert done.exit_code == 0, done.stderr
        assert done.stdout.startswith(f"{name}: asleep, released ")
        m = demo_model(name)
        assert m.sleep is not None and m.sleep.state == "asleep"
        assert (m.mapped_bytes, m.blocks_used, m.blocks_cached, m.pages_inuse) == (0, 0, 0, 0)

        assert kvctl("wake", "demo-llama").exit_code == 0
        wait_for(lambda: serving(name), 90, "requests served again after kvctl wake")

        done = kvctl("sleep", "demo-llama", "--now", "--wait")  # running requests preempted
        assert done.exit_code == 0 and ": asleep, released " in done.stdout, (done.stdout, done.stderr)
        endpoint = demo_model(name).endpoint
        assert endpoint is not None
        request = urllib.request.Request(endpoint + "/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": name, "prompt": "hi", "max_tokens": 2}).encode())
        with urllib.request.urlopen(request, timeout=60) as answer:  # the request wakes it, then is answered
            assert answer.status == 200
        wait_for(lambda: serving(name), 90, "its traffic back after the request woke it")
        assert demo_model(name).sleep.acked_revision == 3  # type: ignore[union-attr]  # no wake was asked


# -- files left behind ---------------------------------------------------------------------

def test_the_capacity_lock_is_not_left_in_the_segment_directory(shm_dir: Path, spawn_allocator) -> None:
    with kc.KVCacheManager("a", name="a", **SMALL) as a:
        assert a.alloc(8) is not None
        b = spawn_allocator("b", script="blocks = m.alloc(8)")  # another process claims capacity too
        wait_for(lambda: kc.snapshot("b").pages_reserved > 0, 30, "b's warm pool")
        b.stdin.close()  # b closes its allocator and exits
        assert b.wait(timeout=30) == 0
    assert os.listdir(shm_dir) == []  # no lock file, no segment


def test_the_capacity_lock_still_excludes_while_it_comes_and_goes(shm_dir: Path, procs: Processes) -> None:
    """Holders unlink the lock before unlocking; a waiter on the old inode retries, so two never overlap."""
    ledger = kc.KVCacheManager("a", name="a", **SMALL)
    try:
        fd = ledger.backend.ledger._lock()
        code = ("import time, kvcached_core as kc\n"
                "m = kc.KVCacheManager('b', name='b', num_blocks=64, block_bytes=1<<16, num_layers=1, page_size=1<<18)\n"
                "l = m.backend.ledger\n"
                "fd = -1\n"
                "while fd < 0:\n"  # _lock gives up (-1) rather than wait long on a holder: ask again
                "    fd = l._lock()\n"
                "print('locked', time.monotonic(), flush=True); l._unlock(fd); m.close()\n")
        other = procs.start([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(), text=True)
        time.sleep(1.0)  # the other process is now waiting on the inode we hold
        released = time.monotonic()
        ledger.backend.ledger._unlock(fd)
        line = other.stdout.readline().split()
        assert other.wait(timeout=30) == 0
        assert line[0] == "locked" and float(line[1]) >= released
    finally:
        ledger.close()
    assert LOCK_NAME not in os.listdir(shm_dir)


# -- messages and pipes --------------------------------------------------------------------

def test_the_event_log_names_a_problem_file_once() -> None:
    from kvtop.frames.events import diff

    [event] = diff((), (), 1.0, (), (kc.Problem("/dev/shm/kvc.bad", "corrupt", "bad magic"),))
    assert (event.model, event.text) == ("/dev/shm/kvc.bad", "corrupt: bad magic")


def test_watch_into_a_closed_pipe_ends_at_once_not_an_interval_later(spawn_allocator, procs: Processes) -> None:
    spawn_allocator("m1")
    proc = procs.start([*KVCTL, "watch", "--format", "json", "--interval", "600"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    assert json.loads(proc.stdout.readline())["models"][0]["name"] == "m1"  # the first record at once
    proc.stdout.close()  # as `head -1` does after its line
    assert proc.wait(timeout=30) == 0  # it would sleep the 600 s interval before the next write
    assert proc.stderr.read() == b""


# -- waiting until a limit is applied ------------------------------------------------------

def test_limit_wait_applied_waits_for_the_memory_then_exits_0(spawn_allocator, procs: Processes) -> None:
    proc = spawn_allocator("m1", script="b = m.alloc(20)")  # 5 pages (bundles of 1 MiB) in use
    quick = kvctl("limit", "m1", "2MiB", "--wait-applied", "0.3")  # nothing frees a page: it runs out
    assert quick.exit_code == 3, quick.stderr
    assert quick.stdout.startswith("m1: limit 2.0 MiB deferred")
    assert quick.stderr == "kvctl: m1: limit 2.0 MiB not applied within 0.3 s: 5.0 MiB of pages still in use\n"

    waiter = procs.start([*KVCTL, "limit", "m1", "2MiB", "--wait-applied", "60", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), text=True)
    wait_for(lambda: kc.snapshot("m1").limit_revision == 2, 30, "the second request")
    assert waiter.poll() is None  # still waiting: the pages are still in use
    send(proc, "m.free(b[8:])")  # 2 pages left in use: now the limit holds
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    [ack] = json.loads(out)
    assert (ack["status"], ack["revision"], ack["effective_limit"]) == ("applied", 2, 2 * MiB)
    assert err == ""  # a pipe gets no progress line
    assert kc.snapshot("m1").mapped_bytes <= 2 * MiB


def test_limit_wait_applied_shows_a_live_line_on_a_terminal(spawn_allocator) -> None:
    spawn_allocator("m1", script="b = m.alloc(20)")
    primary, secondary = os.openpty()
    try:
        done = subprocess.run([*KVCTL, "limit", "m1", "2MiB", "--wait-applied", "2"], stdout=subprocess.PIPE,
                              stderr=secondary, env=child_env(), text=True, timeout=60)
        os.close(secondary)
        seen = b""
        with contextlib.suppress(OSError):  # EIO once the terminal has no writer left
            while chunk := os.read(primary, 4096):
                seen += chunk
    finally:
        os.close(primary)
    assert done.returncode == 3
    text = seen.decode()
    assert "\rm1: 5.0 MiB in use, 5.0 MiB mapped, limit 2.0 MiB: waiting for pages to empty" in text
    assert text.endswith("\r\x1b[Kkvctl: m1: limit 2.0 MiB not applied within 2 s: 5.0 MiB of pages still in use\r\n")


def test_limit_wait_applied_is_documented_with_its_exit_code() -> None:
    shown = kvctl("limit", "--help").stdout
    assert "--wait-applied SEC" in shown and "  3  acknowledged, but not applied within --wait-applied\n" in shown
    assert "3 kvctl limit --wait-applied: acknowledged, not applied in time." in kvctl("--help").stdout


# -- the exporter --------------------------------------------------------------------------

def http_get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def test_the_exporter_serves_metrics_at_metrics_an_index_at_root_and_404_elsewhere(spawn_allocator) -> None:
    from kvtop.serve.exporter import Exporter

    spawn_allocator("m1")
    with Exporter(port=0, with_nvml=False) as exporter:
        base = f"http://127.0.0.1:{exporter.port}"
        status, kind, body = http_get(base + "/metrics")
        assert status == 200 and kind.startswith("text/plain") and b'kvcached_mapped_bytes{' in body
        status, kind, body = http_get(base + "/")
        assert status == 200 and kind.startswith("text/html") and b'href="/metrics"' in body
        assert b"kvcached_mapped_bytes" not in body
        for path in ("/foo", "/metrics/", "/favicon.ico", "/index.html"):
            status, _, body = http_get(base + path)
            assert (status, body) == (404, b"not found: the metrics are at /metrics\n"), path


def test_kvctl_export_ctrl_c_exits_130_as_the_readme_says(procs: Processes) -> None:
    proc = procs.start([*KVCTL, "export", "--port", "0"], stderr=subprocess.PIPE, env=child_env(), text=True)
    line = proc.stderr.readline()
    assert line.startswith("kvctl export: serving http://127.0.0.1:"), line
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    metrics_page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    assert "It stops on Ctrl-C (exit 130" in " ".join(metrics_page.split())


# -- kvtop's trim dialog -------------------------------------------------------------------

def test_the_trim_dialog_reads_the_model_again_and_says_the_pool_refills(spawn_allocator, monkeypatch) -> None:
    from kvtop.screen.widgets import ConfirmScreen

    monkeypatch.setenv("KVCACHED_IDLE_RETURN_S", "-1")  # the warm pool stays until trimmed
    proc = spawn_allocator("m1", script="b = m.alloc(1)")
    wait_for(lambda: kc.snapshot("m1").pages_reserved == 5, 30, "the warm pool")
    app = KvtopApp(LiveSource(), interval=10.0)  # no new frame while the test runs

    async def script(pilot: Pilot) -> None:
        await until(pilot, lambda: app.frame and app.frame.model("m1"), "m1 on screen")
        assert app.frame.model("m1").pages_reserved == 5
        send(proc, "m.trim()")  # the frame on screen still says 5 reserved pages
        await pilot.press("t")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the trim dialog")
        detail = str(app.screen.query_one("#detail").render())
        assert "Unmaps its 0 reserved pages (0 B) now" in detail, detail
        assert "The warm pool refills while traffic lasts; a limit keeps it down." in detail
        await pilot.press("n")

    drive(app, script)


def test_the_docs_say_what_trim_says_about_the_refill() -> None:
    from kvtop.text.textfmt import REFILL_NOTE

    row = next(line for line in (DOCS / "kvctl.md").read_text().splitlines() if line.startswith("| `kvctl trim "))
    assert f"(`{REFILL_NOTE}`)" in row and "set a limit" in row


# -- kvtop's screen ------------------------------------------------------------------------

def fake_app(**kwargs: object) -> KvtopApp:
    from fakes import sample_fleet

    return KvtopApp(sample_fleet(), interval=0.05, **kwargs)  # type: ignore[arg-type]


async def settled(pilot: Pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: app.frame is not None and app.frame.taken_at == app.source.final_at
                and app.frame.detail is not None, "the fake fleet")
    await pilot.pause(0.1)


def footer_keys(app: KvtopApp) -> list[str]:
    from textual.widgets._footer import FooterKey

    return [f"{key.key_display} {key.description}".strip() for key in app.query(FooterKey)]


def test_the_footer_says_what_space_does_now_and_fits_80_columns() -> None:
    app = fake_app()

    async def script(pilot: Pilot) -> None:
        await settled(pilot)
        await until(pilot, lambda: footer_keys(app), "the footer's keys")  # composed once bindings are ready
        await pilot.pause(0.1)
        keys = footer_keys(app)
        assert "space Pause" in keys and "space Resume" not in keys
        bottom = "".join(seg.text for seg in app.screen._compositor.render_strips()[-1])
        assert "space Pause" in bottom and "z Zoom" in bottom and "^p palette" in bottom, bottom  # nothing cut
        await pilot.press("space")
        await until(pilot, lambda: "space Resume" in footer_keys(app), "the footer to say Resume")
        assert "space Pause" not in footer_keys(app) and app.paused
        await pilot.press("space")
        await until(pilot, lambda: "space Pause" in footer_keys(app), "the footer to say Pause again")
        assert not app.paused

    drive(app, script, size=(80, 24))


def test_zooming_past_either_end_says_so() -> None:
    from fakes import sample_fleet

    import kvtop.screen.dashboard as kvtop_app

    class Told(KvtopApp):
        """Keeps every notice it gives: toasts vanish after 3 s of wall time, a busy test machine is slower."""

        CSS_PATH = str(Path(kvtop_app.__file__).with_name("kvtop.tcss"))  # resolved beside the app, not here
        told: list[str] = []

        def notify(self, message: str, **kwargs: object) -> None:  # type: ignore[override]
            self.told.append(message)
            super().notify(message, **kwargs)  # type: ignore[arg-type]

    app = Told(sample_fleet(), interval=0.05, model="deepseek")  # 100k pages: both ends of the zoom exist

    async def script(pilot: Pilot) -> None:
        await settled(pilot)
        await pilot.press("Z")
        assert app.told == ["whole map on screen: z zooms in"]
        for _ in range(20):
            if app.pagemap.per_cell == 1:
                break
            await pilot.press("z")
        assert app.pagemap.per_cell == 1 and len(app.told) == 1
        await pilot.press("z", "z", "z")
        assert app.told[1:] == ["one page per cell: Z zooms out"]  # said once, not once per key

    drive(app, script)


def test_the_command_palette_holds_kvtops_commands_only() -> None:
    from textual.command import CommandPalette
    from textual.widgets import OptionList

    from kvtop.screen.actions import LIVE
    from kvtop.screen.commands import COMMANDS as OURS

    app = fake_app()

    async def script(pilot: Pilot) -> None:
        await settled(pilot)
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette), "the command palette")
        options = app.screen.query_one(OptionList)
        await until(pilot, lambda: options.option_count >= len(OURS[LIVE]), "its commands")
        await pilot.pause(0.2)
        shown = {str(options.get_option_at_index(i).prompt).splitlines()[0] for i in range(options.option_count)}
        assert shown == {title for title, _help, _action in OURS[LIVE]}  # no Textual theme, screenshot, keys entries

    drive(app, script)


def test_at_80_columns_the_model_table_keeps_the_columns_that_matter() -> None:
    app = fake_app()

    async def script(pilot: Pilot) -> None:
        await settled(pilot)
        table = app.table
        header = "".join(seg.text for seg in table.render_line(0)).split()
        assert header[:5] == ["model", "status", "mapped", "limit", "held"] and "waste" in header
        assert table.total_width <= table.scrollable_content_region.width  # nothing cut at the edge
        row = "".join(seg.text for seg in table.render_line(1))
        assert "1.32×" in row  # deepseek's waste, a column that used to be off screen

    drive(app, script, size=(80, 24))


def test_kvtop_into_a_file_is_not_cut_at_80_columns(spawn_allocator, tmp_path) -> None:
    spawn_allocator("a-model-with-a-long-name-to-widen-the-table")
    env = child_env()
    env.pop("COLUMNS", None)
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run(KVTOP, stdout=out, stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "out.txt").read_text().splitlines()
    header = next(line for line in lines if line.startswith("model "))
    assert header.split()[-5:] == ["engine", "pid", "dev", "min", "prio"], header  # every column
    assert len(header) > 80


# -- help text -----------------------------------------------------------------------------

def test_help_text_is_plain_and_says_which_arguments_are_optional() -> None:
    from kvtop.cli import COMMANDS

    for name in COMMANDS:
        shown = kvctl(name, "--help").stdout
        assert "``" not in shown, name  # no reStructuredText markup
    clean = kvctl("clean", "--help").stdout
    assert "\n    .kvc-new.<name>.<pid>\n" in clean  # the file name whole, on its own line
    for name in ("frag", "trim"):
        assert kvctl(name, "--help").stdout.startswith(f"Usage: kvctl {name} [OPTIONS] [MODEL]\n")
    assert kvctl("show", "--help").stdout.startswith("Usage: kvctl show [OPTIONS] MODEL\n")


# -- the README and docs/ against what a newcomer runs -------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"


def readme_block(after: str, kind: str, page: Path = README) -> str:
    text = page.read_text()
    start = text.index(f"```{kind}\n", text.index(after)) + len(kind) + 4
    return text[start:text.index("```", start)]


def test_the_readme_screen_is_what_kvtop_demo_shows() -> None:
    from kvtop.app import cli

    defaults = {p.name: p.default for p in cli.params}
    screen = readme_block("at 100×32 it looks like this", "text", DOCS / "kvtop.md")
    first = screen.splitlines()[0]
    models = defaults["demo_models"]
    assert f"· {models} models, {models} live · every {defaults['interval']:g} s ·" in first, first
    assert len(screen.splitlines()) == 32 and max(len(line) for line in screen.splitlines()) <= 100
    assert " × 2.0 MiB bundle" in screen  # the demo's page bundle, named as one (its pages are 256 KiB)


def test_the_readme_python_and_kvctl_examples_work_against_the_demo(shm_dir: Path) -> None:
    from kvtop.demo.fleet import DemoFleet

    with DemoFleet(models=4) as fleet:
        assert fleet.wait_ready(30), fleet.failure
        code = readme_block("## From another process", "python", DOCS / "allocator.md")
        exec(compile(code, "docs/allocator.md", "exec"), {})  # the page's own example
        helped = kvctl("--help").stdout
        for line in helped.splitlines():
            words = line.split()
            if words[:2] in (["kvctl", "show"], ["kvctl", "limit"]):
                args = words[1:4] if words[1] == "limit" else words[1:3]
                done = kvctl(*args)
                assert done.exit_code == 0, (args, done.stderr)


def test_the_example_and_the_readme_give_the_same_limit_and_it_exhausts_the_cache() -> None:
    example = (README.parent / "examples" / "generate.py").read_text()
    wanted = {line.split("--limit ")[1].split()[0] for line in (example + (DOCS / "engines.md").read_text()).splitlines()
              if "examples/generate.py --limit " in line}
    assert len(wanted) == 1, wanted
    done = subprocess.run([sys.executable, str(README.parent / "examples" / "generate.py"), "--limit", wanted.pop()],
                          capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 1 and "exhausted" in done.stderr, done.stderr


def test_every_column_of_the_model_table_is_shown_when_there_is_room() -> None:
    from kvtop.screen.view import COLUMNS
    from kvtop.screen.widgets.models import choose_columns

    widths = {key: 5 for key, *_ in COLUMNS}
    assert choose_columns(widths, 10_000) == COLUMNS  # in their order, none forgotten by the priority list
    narrow = [key for key, *_ in choose_columns(widths, 30)]
    assert narrow == ["name", "status", "mapped", "limit"]  # 1 + 5 + 3 x (2 + 5) = 27 of 30 columns
