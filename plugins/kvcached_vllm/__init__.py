"""kvcached for vLLM: the engine's KV cache in kvcached pages, under kvtop and kvctl.

Installed with ``pip install 'kvtop[vllm]'``; vLLM loads :func:`register` in every process it
starts (entry-point group ``vllm.general_plugins``). With ``ENABLE_KVCACHED=true`` the plugin
takes over the KV cache; without it vLLM is left exactly as it is. Importing this package stays
cheap: vLLM itself is imported only once the plugin is enabled.
"""

from __future__ import annotations

from kvcached_core.engines import EngineInfo

from .settings import SUPPORTED_VLLM, enabled

ENGINE = EngineInfo(
    name="vllm",
    summary=f"vLLM {SUPPORTED_VLLM} (general plugin): block pool, KV tensors and limits through kvcached",
    modules=("vllm",),
    example="ENABLE_KVCACHED=true python examples/vllm_offline.py",
    extras=("vllm",),
)


def register() -> None:
    """vLLM's plugin hook: install the integration in this process when ``ENABLE_KVCACHED`` is on."""
    if not enabled():
        return
    from .install import install

    install()


__all__ = ["ENGINE", "SUPPORTED_VLLM", "enabled", "register"]
