"""kvcached for vLLM: the engine's KV cache in kvcached pages, under kvtop and kvctl.

Installed with ``pip install 'kvtop[vllm]'``; vLLM loads :func:`register` in every process it
starts (entry-point group ``vllm.general_plugins``). With ``ENABLE_KVCACHED=true`` the plugin
takes over the KV cache; without it vLLM is left exactly as it is. Importing this package stays
cheap: vLLM itself is imported only once the plugin is enabled.
"""

from __future__ import annotations

from kvcached_core.engines import EngineInfo
from kvcached_core.settings import ConfigError

from .settings import UnsupportedVLLM, enabled

ENGINE = EngineInfo(
    name="vllm",
    summary="vLLM (general plugin): block pool, KV tensors and limits through kvcached",
    modules=("vllm",),
    example="ENABLE_KVCACHED=true python examples/vllm_offline.py",
    extras=("vllm",),
)


def register() -> None:
    """vLLM's plugin hook: install the integration in this process when ``ENABLE_KVCACHED`` is on.

    A vLLM that lacks or changed a seam the plugin uses (:mod:`.seams`), or an ``ENABLE_KVCACHED``
    that is not a boolean, stops the process at start with one line on stderr (exit status 1): vLLM
    loads plugins in its main process while it reads its arguments, before any engine starts, and
    its own traceback would bury the reason.
    """
    try:
        if not enabled():
            return
        from .install import install

        install()
    except (UnsupportedVLLM, ConfigError) as exc:
        raise SystemExit(str(exc)) from None


__all__ = ["ENGINE", "enabled", "register"]
