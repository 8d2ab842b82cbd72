"""The optional native parts, built when the package is installed (metadata: pyproject.toml).

Each is an ordinary extension module; ``optional=True`` lets an install without a C compiler or
Python's headers succeed, and the allocator then says once, at run time, that it uses the Python
path instead (:mod:`kvcached_core.native`). Each build records its source's digest, so a build
older than its source (an edited checkout not reinstalled) is reported rather than used.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent


def native(module: str, source: str) -> Extension:
    """One extension from ``source`` and the headers it includes from ``<stem>_c/`` beside it; the digest covers
    them all, in that order (kvcached_core/native.py computes the same at import)."""
    headers = sorted((ROOT / source).parent.joinpath(Path(source).stem + "_c").glob("*.h"))
    digest = hashlib.sha256()
    for path in [ROOT / source, *headers]:
        digest.update(path.read_bytes())
    return Extension(module, [source], optional=True, extra_compile_args=["-O2"],
                     depends=[str(h.relative_to(ROOT)) for h in headers],
                     define_macros=[("KVC_SOURCE_DIGEST", f'"{digest.hexdigest()[:16]}"')])


setup(ext_modules=[
    native("kvcached_core.allocator._fastpath", "kvcached_core/allocator/fastpath.c"),
    native("kvcached_core.backends._cuda_native", "kvcached_core/backends/cuda_native.c"),
])
