"""Lazy public names for a package's ``__init__`` (PEP 562): a name's module loads on first use.

The facades (``kvcached_core``, ``kvcached_core.control``, ``kvcached_core.engines``) list what they offer in one
table, public name -> the module under the package that defines it (or, for a module offered whole, the
module itself), so ``kvctl list`` never pays for the allocator or the controller.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str], modules: Mapping[str, str] | None = None,
                 namespace: dict[str, Any] | None = None, *,
                 submodules: bool = True) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps a public name to the relative module that
    defines it (``"module:attribute"`` where the module calls it otherwise); ``modules`` a public name to a
    relative module offered whole; with ``submodules`` any other name may be a submodule of ``package`` not yet
    imported (an eager package's behaviour). A value found is cached in
    ``namespace`` (the package's ``globals()``), so each loads once."""
    whole = dict(modules or {})
    owner = (namespace or {}).get("__name__", package)  # the module whose attribute is asked for

    def getattr_(name: str) -> Any:
        if name in whole:
            value = importlib.import_module(f".{whole[name]}", package)
        elif name in names:
            module, _, attribute = names[name].partition(":")
            value = getattr(importlib.import_module(f".{module}", package), attribute or name)
        elif not submodules:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}")
        else:  # package.<submodule> without importing it first, as an eager package allows
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {owner!r} has no attribute {name!r}") from None
        if namespace is not None:
            namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace or ()) | set(names) | set(whole))

    return getattr_, dir_
