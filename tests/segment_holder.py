"""A process holding a bare segment (a writer, no allocator) with the words a test sets: another engine's claim or
working memory, as the device's scan sees it, alive until its stdin closes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import child_env


def hold_segment(name: str, words: str, *, backend: str = "cuda", device: int = 0) -> subprocess.Popen:
    """Start a process whose segment ``name`` (on ``backend``, ``device``) has had ``words`` called on its
    SegmentWriter (``"set_claimed(1024)"``, ``"set_working(4096, 1024)"``); it answers once they are published."""
    code = textwrap.dedent(f"""
        import sys
        from kvcached_core.segment.writer import Identity, SegmentWriter
        ident = Identity(name={name!r}, model="m", engine="test", backend={backend!r}, device={device},
                         page_size=2 << 20, block_bytes=1 << 16, num_layers=1, num_kv_buffers=2,
                         blocks_per_page=32, num_blocks=64, pages_total=2)
        w = SegmentWriter(ident)
        w.{words}
        print("READY", flush=True)
        sys.stdin.read()
        w.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=child_env(), text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc
