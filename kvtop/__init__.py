"""kvtop: the terminal tools for kvcached_core — the ``kvtop`` dashboard and the ``kvctl`` CLI."""

from kvcached_core import __version__

__all__ = ["__version__"]
