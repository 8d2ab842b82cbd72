"""``kvctl report --plot``: mapped bytes per model over time, with the marks of :mod:`kvtop.record.report`.

matplotlib comes with the ``plot`` extra; :func:`matplotlib_problem` says whether it is there before any
recording is read, and only :func:`draw` imports it (with the Agg backend: no display needed).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .report import MARK_KINDS, ModelReport

MISSING = "--plot needs matplotlib, which is not installed: install the plot extra (pip install 'kvtop[plot]')"
MARKERS = dict(zip(MARK_KINDS, ("P", "v", "^", "X", "D", "s", "o"), strict=True))
MiB = 1 << 20


def matplotlib_problem() -> str | None:
    """One line when matplotlib cannot be imported; None when it can."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken install
        found = False
    return None if found else MISSING


def draw(reports: Sequence[ModelReport], out: Path, title: str) -> list[str]:
    """Write a PNG of each report's series (``keep_series=True``) to ``out``, its marks drawn on its line; the
    kinds of mark drawn (each has a key in the legend)."""
    # imported by name: the extra may be absent where the types are checked
    importlib.import_module("matplotlib").use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    dates: Any = importlib.import_module("matplotlib.dates")
    line2d: Any = importlib.import_module("matplotlib.lines").Line2D

    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    try:
        marked: dict[str, None] = {}
        for report in reports:
            times = [datetime.fromtimestamp(at) for at, _ in report.series]
            (line,) = ax.step(times, [b / MiB for _, b in report.series], where="post", label=report.name)
            for kind in MARK_KINDS:
                marks = [m for m in report.marks if m.kind == kind]
                if marks:
                    ax.scatter([datetime.fromtimestamp(m.at) for m in marks], [m.mapped_bytes / MiB for m in marks],
                               marker=MARKERS[kind], color=line.get_color(), edgecolors="black", zorder=3)
                    marked[kind] = None
        ax.set_title(title)
        ax.set_ylabel("mapped (MiB)")
        ax.set_xlabel("local time")
        ax.grid(True, alpha=0.3)
        locator = dates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator))
        handles, _ = ax.get_legend_handles_labels()  # the models' lines, then one grey key per kind of mark
        handles += [line2d([], [], marker=MARKERS[k], linestyle="", color="grey", markeredgecolor="black", label=k)
                    for k in marked]
        if handles:
            ax.legend(handles=handles, loc="upper left", fontsize="small")
        fig.autofmt_xdate()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return list(marked)
