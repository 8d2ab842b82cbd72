"""An engine's failure as the one line the harness prints: an exception's (:func:`error_line`), or why
transformers' generation loop stopped (:func:`loop_error`)."""

from __future__ import annotations

from typing import Any

LINE_CHARS = 400  # an error line is cut here


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 3] + "..."


def loop_error(manager: Any) -> str:
    """Why transformers' generation loop stopped: its fatal error as one line."""
    status = getattr(manager, "background_thread_status", None)
    fatal = getattr(status, "fatal_error", None)
    return error_line(fatal) if isinstance(fatal, BaseException) else "the generation loop stopped"
