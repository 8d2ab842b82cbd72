"""Compaction on a CUDA device: ``device_copy`` moves each block in every layer and KV buffer with one batched
copy, and the pages emptied are unmapped. GPU tests skip (with the reason) where no NVIDIA GPU is."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from test_cuda_backend import LAYOUTS, cuda_manager, needs_gpu

from kvcached_core.allocator.compact import copy_blocks, device_copy

BPP = 8  # cuda_manager's 2 MiB pages of 256 KiB blocks


@contextlib.contextmanager
def random_cache(name: str, pages: int) -> Iterator[tuple[Any, Any]]:
    """A CUDA manager with all its ``pages`` page ids mapped and full of random bytes, and its blocks' raw view."""
    import torch

    with cuda_manager(name, num_blocks=pages * BPP) as m:
        assert m.alloc(pages * BPP) is not None  # every page mapped
        raw = m.backend.all_blocks(m.block_bytes)
        raw.view(torch.int64).random_()
        yield m, raw


@pytest.mark.gpu
@needs_gpu
@LAYOUTS
def test_device_copy_moves_every_layer_and_returns_the_pages(layout, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", layout)
    monkeypatch.setenv("KVCACHED_MIN_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "0")
    monkeypatch.setenv("KVCACHED_CUDA_ASYNC_UNMAP", "0")  # the unmap has happened when compact returns
    with cuda_manager(f"compact-{layout}", num_blocks=8 * BPP, policy="best-fit") as m:
        ids = [m.alloc(1)[0] for _ in range(8 * BPP)]  # type: ignore[index]
        rows = m.backend.all_blocks(m.block_bytes).view(torch.int32)  # [layers x KV, pages, blocks, words]
        ranges = m.num_layers * m.num_kv_buffers
        assert tuple(rows.shape[:3]) == (ranges, m.geometry.num_pages, BPP)
        mark = torch.arange(ranges, device=rows.device, dtype=torch.int32).view(ranges, 1) * 100_000
        for block in ids:
            rows[:, block // BPP, block % BPP] = mark + block
        drop = [b for b in ids if (b // BPP < 4 and b % BPP < 2) or (b // BPP >= 4 and b % BPP >= 2)]
        m.free(drop)
        kept = [b for b in ids if b not in drop]
        m.mark_cached(kept)
        m.set_compact_handler(lambda moves: copy_blocks(m.backend, m.block_bytes, moves))
        mapped = m.backend.mapped_bytes()
        result = m.compact()
        assert len(result.moves) == 8 and result.bytes_returned == 4 * m.bundle_bytes
        assert m.backend.mapped_bytes() == mapped - 4 * m.bundle_bytes  # the driver unmapped four page ids
        where = dict(result.moves)
        for block in kept:
            at = where.get(block, block)
            assert at // BPP < 4
            got = rows[:, at // BPP, at % BPP]
            assert torch.equal(got, (mark + block).expand_as(got)), (block, at)
        # the per-buffer views see the moved bytes at the documented offsets too
        src, dst = result.moves[0]
        raw = m.buffer(3, 1)
        cell = raw[dst // BPP, (dst % BPP) * m.block_bytes:(dst % BPP) * m.block_bytes + 4].view(torch.int32)
        assert int(cell.item()) == (3 * 2 + 1) * 100_000 + src
        assert device_copy(m.backend, m.block_bytes, []) == []


@pytest.mark.gpu
@needs_gpu
@LAYOUTS
def test_the_copy_kernel_moves_what_torchs_indexed_copy_moves(layout, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    import random

    from kvcached_core.allocator import compact
    from kvcached_core.backends.cuda_copy import Mover, fits, mover

    monkeypatch.setenv("KVCACHED_CUDA_LAYOUT", layout)
    with random_cache(f"kernel-{layout}", 8) as (m, raw):
        picked = random.Random(3).sample(range(8 * BPP), 40)
        moves = list(zip(picked[:20], picked[20:], strict=True))
        expected = raw.clone()
        compact.gather_scatter(expected, moves)
        kernel = mover(raw.device.index or 0)
        assert isinstance(kernel, Mover), kernel  # NVRTC built it here
        assert fits(raw, moves)
        kernel.move(raw, moves)
        torch.cuda.synchronize()
        assert torch.equal(raw, expected)
        # device_copy takes the kernel, not the gather and scatter
        monkeypatch.setattr(compact, "gather_scatter", lambda *a: pytest.fail("device_copy fell back"))
        back = [(d, s) for s, d in moves]
        compact.device_copy(m.backend, m.block_bytes, back)
        for s, d in moves:
            assert torch.equal(raw[:, s // BPP, s % BPP], raw[:, d // BPP, d % BPP])


@pytest.mark.gpu
@needs_gpu
def test_the_first_compaction_builds_the_kernel_in_the_background_and_copies_meanwhile(monkeypatch) -> None:
    """A compaction runs under its allocator's lock, so the first one does not wait for NVRTC: it copies with
    torch's gather and scatter while a background thread builds the kernel, and the next ones use the kernel."""
    torch = pytest.importorskip("torch")
    from conftest import wait_for

    from kvcached_core.allocator import compact
    from kvcached_core.backends import cuda_copy

    monkeypatch.setattr(cuda_copy, "_movers", {})  # nothing built in this process yet
    used: list[str] = []
    real_gather_scatter = compact.gather_scatter
    monkeypatch.setattr(compact, "gather_scatter", lambda *a: (used.append("torch"), real_gather_scatter(*a)))
    with random_cache("kernel-background", 4) as (m, raw):
        device = raw.device.index or 0
        expected = raw.clone()
        real_gather_scatter(expected, [(0, 9), (1, 10)])
        compact.device_copy(m.backend, m.block_bytes, [(0, 9), (1, 10)])
        assert used == ["torch"] and torch.equal(raw, expected)
        kernel = wait_for(lambda: cuda_copy.mover(device, wait=False), timeout=30, what="the kernel to be built")
        assert isinstance(kernel, cuda_copy.Mover), kernel
        real_gather_scatter(expected, [(2, 17)])
        compact.device_copy(m.backend, m.block_bytes, [(2, 17)])
        assert used == ["torch"] and torch.equal(raw, expected)  # the kernel copied this time


@pytest.mark.gpu
@needs_gpu
def test_a_kernel_that_fails_at_launch_is_given_up_for_torchs_copy(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    from kvcached_core.allocator import compact
    from kvcached_core.backends import cuda_copy

    monkeypatch.setattr(cuda_copy, "_movers", dict(cuda_copy._movers))
    with random_cache("kernel-fails", 4) as (m, raw):
        device = raw.device.index or 0
        assert isinstance(cuda_copy.mover(device), cuda_copy.Mover)

        def refused(self, rows, pairs) -> None:
            raise cuda_copy.CopyKernelUnavailable("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

        monkeypatch.setattr(cuda_copy.Mover, "launch", refused)
        expected = raw.clone()
        compact.gather_scatter(expected, [(0, 9), (3, 30)])
        assert compact.device_copy(m.backend, m.block_bytes, [(0, 9), (3, 30)]) == [(0, 9), (3, 30)]
        assert torch.equal(raw, expected)  # copied all the same, by torch
        assert "LAUNCH_OUT_OF_RESOURCES" in str(cuda_copy.mover(device))  # and given up for this process
