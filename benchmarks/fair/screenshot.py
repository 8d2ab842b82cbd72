"""kvtop's picture of a run: its screen (160x50) saved as SVG while the elastic engines serve.

kvtop's own app runs headless (Textual's ``run_test``) in a thread of the benchmark, reading the elastic engines'
segment directory as ``kvtop`` would. Once the segments' pressure counters show a reclaim made during the run (a
model took memory another gave), kvtop selects the model that took the most, so its page map shows, and the screen
is saved once that page map has been read. A run with no reclaim leaves the screen as it was when the run ended
(the report says which). Used as a context manager around one replay.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import TracebackType

SIZE = (160, 50)
POLL_S = 0.25


def reclaims(models: list) -> dict[str, int]:
    """Reclaims each live model took so far (its pressure counters; 0 where it publishes none)."""
    return {m.name: (m.pressure.took_count if m.pressure is not None else 0) for m in models if m.status == "live"}


class Screenshot:
    """Save kvtop's screen to ``path`` during one run (the engines' segments under ``directory``)."""

    def __init__(self, directory: Path, path: Path) -> None:
        self.directory, self.path = directory, path
        self.stop = threading.Event()
        self.result: dict = {}  # "reclaim": bool, "model": the model selected, "error": why nothing was saved
        self.thread = threading.Thread(target=self._run, name="kvtop-screenshot", daemon=True)

    def __enter__(self) -> Screenshot:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop.set()
        self.thread.join(60)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # noqa: BLE001 - a picture that failed must not fail the benchmark
            self.result = {"error": f"{type(exc).__name__}: {exc}"}

    async def _main(self) -> None:
        from kvcached_core import scan
        from kvtop.frames.source import LiveSource
        from kvtop.screen.dashboard import KvtopApp

        start = reclaims(list(scan(directory=self.directory).models))
        app = KvtopApp(LiveSource(directory=self.directory), interval=0.5, readonly=True)
        async with app.run_test(size=SIZE) as pilot:
            chosen: str | None = None
            while not self.stop.is_set():
                await pilot.pause(POLL_S)
                frame = app.frame
                if frame is None:
                    continue
                taken = {n: c - start.get(n, 0) for n, c in reclaims(list(frame.models)).items()}
                if chosen is None and any(c > 0 for c in taken.values()):
                    chosen = max(taken, key=lambda n: taken[n])
                    app.selected = chosen
                detail = frame.detail
                if chosen is not None and detail is not None and detail.name == chosen and detail.pages is not None:
                    await pilot.pause(POLL_S)  # the page map drawn
                    self._save(app, reclaim=True, model=chosen)
                    return
            frame = app.frame
            live = [m for m in frame.models if m.status == "live"] if frame is not None else []
            if live and app.selected is None:
                app.selected = max(live, key=lambda m: m.mapped_bytes).name
            await pilot.pause(2 * POLL_S)
            self._save(app, reclaim=False, model=app.selected)

    def _save(self, app: object, *, reclaim: bool, model: str | None) -> None:
        svg = app.export_screenshot(title="kvtop")  # type: ignore[attr-defined]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(svg)
        self.result = {"reclaim": reclaim, "model": model}
