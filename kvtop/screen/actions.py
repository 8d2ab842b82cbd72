"""kvtop's one table of actions: the key bindings, the command palette and the help screen are all read from it.

A row is one binding (its keys, the action they run, the label the footer and the help screen show); a row with
a ``palette`` title is also a command palette entry, whose hint names the row's first key. Nothing else lists
keys or commands, so the three cannot drift apart. A row's ``mode`` says which dashboard has it: the live one,
the replay of a recording (``kvtop --replay``), or both; a key may do one thing live and another in a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding

# How the help screen and the palette write Textual's key names.
KEY_NAMES = {"question_mark": "?", "space": "space", "plus": "+", "minus": "-", "equals_sign": "=",
             "down": "↓", "up": "↑", "left": "←", "right": "→", "enter": "enter", "pageup": "pgup",
             "pagedown": "pgdn", "escape": "esc", "tab": "tab", "comma": ",", "full_stop": "."}
LIVE, REPLAY, BOTH = "live", "replay", ""


@dataclass(frozen=True)
class Action:
    keys: str  # Textual key names, comma-separated
    action: str
    label: str  # the footer's and the help screen's words
    show: bool = True  # in the footer
    priority: bool = False  # before any focused widget's own bindings
    palette: str = ""  # the command palette's title ("": not in the palette)
    palette_help: str = ""
    palette_action: str = ""  # the palette runs this instead of ``action`` (one entry for a key's two actions)
    in_help: bool = True  # a row of the help screen (False: the other half of a key listed once)
    help_label: str = ""  # the help screen's words where they differ from the footer's
    mode: str = BOTH  # LIVE, REPLAY or BOTH: the dashboards that have this row

    @property
    def help_text(self) -> str:
        return self.help_label or self.label

    @property
    def key_text(self) -> str:
        """The keys as a person reads them: ``↓ j``."""
        return " ".join(KEY_NAMES.get(k, k) for k in self.keys.split(","))

    def binding(self) -> Binding:
        return Binding(self.keys, self.action, self.label, show=self.show, priority=self.priority)


ACTIONS: tuple[Action, ...] = (
    Action("q", "quit", "Quit", palette="Quit", palette_help="leave kvtop"),
    Action("ctrl+c", "quit", "Quit", show=False, priority=True),
    Action("question_mark", "help", "Help", palette="Help", palette_help="keys, legend and terms"),
    Action("down,j", "cursor(1)", "Next model", show=False),
    Action("up,k", "cursor(-1)", "Previous model", show=False),
    Action("home", "cursor(-1000000)", "First model", show=False),
    Action("end", "cursor(1000000)", "Last model", show=False),
    Action("tab", "switch_arrows", "Arrows: models/map", show=False, priority=True,
           palette="Arrow keys: models / page map", palette_help="↑/↓ select a model, or scroll the page map"),
    Action("left", "map_scroll(-1)", "Page map back a row", show=False),
    Action("right", "map_scroll(1)", "Page map on a row", show=False),
    Action("enter", "details", "Details", show=False, palette="Model details",
           palette_help="everything about the selected model"),
    Action("t", "trim", "Trim", palette="Trim selected model",
           palette_help="unmap the selected model's reserved pages now"),
    Action("T", "trim_all", "Trim all", show=False, palette="Trim all models",
           palette_help="unmap every live model's reserved pages now"),
    Action("c", "compact", "Compact", show=False, palette="Compact selected model",
           palette_help="move its cached blocks out of sparse pages and unmap the pages emptied"),
    Action("w", "sleep_wake", "Sleep/wake", show=False, palette="Sleep / wake selected model",
           palette_help="give back its whole KV cache, or wake it when it sleeps"),
    Action("l", "limit", "Limit", palette="Set limit of selected model",
           palette_help="cap mapped bytes: 4G, 512MiB, 30%, none"),
    Action("p", "policy", "Policy (min, priority)", show=False, palette="Set policy of selected model",
           palette_help="its min (never reclaimed) and priority (lower gives first)"),
    Action("s", "cycle_sort", "Sort", palette="Cycle sort", palette_help="sort by name, mapped, waste, alloc/s, held"),
    Action("f", "filter", "Filter", palette="Filter models", palette_help="show only models matching a substring"),
    # space is one key: the footer shows the one of these two it does now; the help screen and the palette
    # list it once
    Action("space", "pause", "Pause", help_label="Pause / resume", palette="Pause / resume", palette_help="stop or restart refreshing",
           palette_action="toggle_pause", mode=LIVE),
    Action("space", "resume", "Resume", in_help=False, mode=LIVE),
    Action("plus,equals_sign", "faster", "Faster", show=False, palette="Refresh faster",
           palette_help="shorter refresh interval", mode=LIVE),
    Action("minus", "slower", "Slower", show=False, palette="Refresh slower", palette_help="longer refresh interval",
           mode=LIVE),
    # a replay's clock (kvtop --replay): space plays and pauses it, +/- its speed
    Action("space", "replay_pause", "Pause", help_label="Play / pause", palette="Play / pause",
           palette_help="play the recording, or hold the moment shown", palette_action="replay_toggle",
           mode=REPLAY),
    Action("space", "replay_play", "Play", in_help=False, mode=REPLAY),
    Action("plus,equals_sign", "replay_speed(1)", "Faster", show=False, help_label="Play faster (up to 600x)",
           palette="Play faster", palette_help="1, 2, 5, 10, 30, 60, 120, 300, 600x", mode=REPLAY),
    Action("minus", "replay_speed(-1)", "Slower", show=False, help_label="Play slower (down to 1x)",
           palette="Play slower", palette_help="600, 300, 120, 60, 30, 10, 5, 2, 1x", mode=REPLAY),
    Action("full_stop", "replay_step(1)", "Step", show=False, help_label="Pause, one sample on",
           palette="Step one sample on", palette_help="pause and show the next sample", mode=REPLAY),
    Action("comma", "replay_step(-1)", "Step back", show=False, help_label="Pause, one sample back",
           palette="Step one sample back", palette_help="pause and show the sample before", mode=REPLAY),
    Action("g", "replay_jump", "Go to", help_label="Go to a moment: 03:00, an ISO time, +10m, -30s",
           palette="Go to a moment", palette_help="HH:MM[:SS], an ISO time, or +10m / -30s", mode=REPLAY),
    Action("n", "replay_event(1)", "Next event", help_label="Next event the log shows (of the kinds e chose)",
           palette="Next event", palette_help="pause at the next event the log shows", mode=REPLAY),
    Action("N", "replay_event(-1)", "Previous event", show=False, help_label="Previous event",
           palette="Previous event", palette_help="pause at the event before the moment shown", mode=REPLAY),
    Action("e", "replay_events", "Event kinds", show=False,
           help_label="What n / N stop at: every event, limits, trims, sleeps…",
           palette="Choose event kinds", palette_help="n / N stop at every event, or at one kind's", mode=REPLAY),
    Action("z", "zoom_in", "Zoom", palette="Zoom page map in", palette_help="fewer pages per cell"),
    Action("Z", "zoom_out", "Unzoom", show=False, palette="Zoom page map out",
           palette_help="more pages per cell, back to fit"),
    Action("pagedown", "map_page(1)", "Scroll map down", show=False, priority=True),
    Action("pageup", "map_page(-1)", "Scroll map up", show=False, priority=True),
)
# Textual's own key for the palette: a row of the help screen, no binding of ours.
PALETTE_KEY = Action("ctrl+p", "command_palette", "Command palette", show=False)


def rows(mode: str = LIVE) -> list[Action]:
    """The rows of one dashboard: ``LIVE`` or ``REPLAY``."""
    return [a for a in ACTIONS if a.mode in (BOTH, mode)]


def bindings(mode: str = LIVE) -> list[Binding]:
    return [a.binding() for a in rows(mode)]


def help_rows(mode: str = LIVE) -> list[Action]:
    """The help screen's rows, in the table's order, the palette's own key last."""
    return [a for a in rows(mode) if a.in_help] + [PALETTE_KEY]


def palette(mode: str = LIVE) -> tuple[tuple[str, str, str], ...]:
    """The command palette's entries: (title, help with the key that does the same, action to run)."""
    entries = [(a.palette, f"{a.palette_help} ({KEY_NAMES.get(a.keys.split(',')[0], a.keys.split(',')[0])})",
                a.palette_action or a.action) for a in rows(mode) if a.palette]
    # what changes a model first, leaving kvtop and its help last
    last = [e for e in entries if e[2] in ("help", "quit")]
    return tuple([e for e in entries if e not in last] + sorted(last, key=lambda e: e[2] == "quit"))
