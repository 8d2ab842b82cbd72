"""What the vLLM plugin reads from the environment."""

from __future__ import annotations

from kvcached_core.settings import settings

ENABLE_ENV = "ENABLE_KVCACHED"  # the variable users of the public kvcached already set


def enabled() -> bool:
    """``ENABLE_KVCACHED``: true/1/yes/on takes over vLLM's KV cache; unset or false leaves vLLM alone."""
    return settings().enable_kvcached


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM lacks or changed a seam the plugin uses; the message names it (see :mod:`.seams`)."""
