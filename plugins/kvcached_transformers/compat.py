"""What differs between the transformers 5.x releases the plugin supports (5.17 to the newest 5.x).

transformers renamed the models' ``past_key_values`` argument to ``cache`` in 5.20 (the old name is
refused before, and deprecated after). Everything else the plugin uses is the same across the range.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """``cache`` where the model's forward takes it (transformers 5.20 on), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to ``model.generate`` or ``model(...)``:
    ``model.generate(ids, **cache_arg(model, cache), ...)``."""
    return {cache_keyword(model): cache}


__all__ = ["cache_arg", "cache_keyword"]
