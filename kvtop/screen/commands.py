"""Command palette (ctrl+p): the dashboard's actions, searchable by name."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from kvtop.screen.actions import LIVE, REPLAY, palette

# (title, help, action): the palette's rows of kvtop/screen/actions.py, the same actions the keys run; a replay's own.
COMMANDS = {LIVE: palette(LIVE), REPLAY: palette(REPLAY)}


class KvtopCommands(Provider):
    """Every dashboard action; in read-only mode the changing ones say so when run."""

    @property
    def entries(self) -> tuple[tuple[str, str, str], ...]:
        return COMMANDS[getattr(self.app, "MODE", LIVE)]

    async def discover(self) -> Hits:
        for title, help_text, action in self.entries:
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in self.entries:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self.app.run_action, action), help=help_text)
