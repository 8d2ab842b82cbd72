"""Command palette (ctrl+p): the dashboard's actions, searchable by name."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from kvtop.actions import palette

# (title, help, action): the palette's rows of kvtop/actions.py, the same actions the keys run.
COMMANDS = palette()


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
