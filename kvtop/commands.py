"""Command palette (ctrl+p): the dashboard's actions, searchable by name."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, help, action) — the same actions the keys run.
COMMANDS = (
    ("Trim selected model", "unmap the selected model's reserved pages now (t)", "trim"),
    ("Trim all models", "unmap every live model's reserved pages now (T)", "trim_all"),
    ("Compact selected model", "move its cached blocks out of sparse pages and unmap the pages emptied (c)",
     "compact"),
    ("Sleep / wake selected model", "give back its whole KV cache, or wake it when it sleeps (w)", "sleep_wake"),
    ("Set limit of selected model", "cap mapped bytes: 4G, 512MiB, 30%, none (l)", "limit"),
    ("Set policy of selected model", "its min (never reclaimed) and priority (lower gives first) (p)", "policy"),
    ("Model details", "everything about the selected model (enter)", "details"),
    ("Cycle sort", "sort by name, mapped, waste, alloc/s, held (s)", "cycle_sort"),
    ("Filter models", "show only models matching a substring (f)", "filter"),
    ("Pause / resume", "stop or restart refreshing (space)", "toggle_pause"),
    ("Refresh faster", "shorter refresh interval (+)", "faster"),
    ("Refresh slower", "longer refresh interval (-)", "slower"),
    ("Zoom page map in", "fewer pages per cell (z)", "zoom_in"),
    ("Zoom page map out", "more pages per cell, back to fit (Z)", "zoom_out"),
    ("Help", "keys, legend and terms (?)", "help"),
    ("Quit", "leave kvtop (q)", "quit"),
)


class KvtopCommands(Provider):
    """Every dashboard action; in read-only mode the changing ones say so when run."""

    async def discover(self) -> Hits:
        for title, help_text, action in COMMANDS:
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in COMMANDS:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self.app.run_action, action), help=help_text)
