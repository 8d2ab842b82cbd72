"""The copy kernel's preconditions (kvcached_core.backends.cuda_copy.fits), on plain CPU tensors: where a move
or a view does not fit its 16-byte loads and stores, device_copy keeps torch's gather and scatter. The kernel
itself runs in tests/test_compact_cuda.py (GPU)."""

from __future__ import annotations

import torch

from kvcached_core.backends.cuda_copy import fits


def rows(block: int = 256) -> torch.Tensor:
    return torch.zeros(4, 3, 8, block, dtype=torch.uint8)  # [ranges, pages, blocks a page, bytes]


def test_disjoint_moves_over_aligned_rows_fit() -> None:
    assert fits(rows(), [(0, 9), (1, 10), (23, 2)])


def test_a_block_both_read_and_written_does_not_fit() -> None:
    assert not fits(rows(), [(0, 9), (9, 3)])  # 9 is a destination and a source: the order would matter


def test_blocks_the_loads_cannot_cover_do_not_fit() -> None:
    assert not fits(rows(block=24), [(0, 1)])  # 24 bytes: not whole 16-byte words
    assert not fits(rows().view(torch.int32), [(0, 1)])  # not the byte view all_blocks gives
    assert not fits(rows()[:, :, :, 8:], [(0, 1)])  # the blocks start off a 16-byte boundary


def test_a_kernel_that_cannot_be_built_is_a_reason_kept_not_an_error(monkeypatch) -> None:
    """A build that fails with something other than NVRTC's own refusal (here torch's AssertionError, what a
    torch without CUDA raises) is a reason kept and said, whether the build ran in the background (a
    compaction's first call) or on the caller's thread. The failure goes in through the module's ``_build``,
    so it holds where torch has CUDA and the kernel would build."""
    from conftest import wait_for

    from kvcached_core.backends import cuda_copy

    def no_cuda(device: int) -> cuda_copy.Mover:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(cuda_copy, "_build", no_cuda)
    monkeypatch.setattr(cuda_copy, "_movers", {})
    assert cuda_copy.mover(0, wait=False) is None  # the build started, in a background thread
    why = wait_for(lambda: cuda_copy.mover(0, wait=False), timeout=30, what="the background build to end")
    assert isinstance(why, str) and "AssertionError" in why and cuda_copy.mover(0) == why
    monkeypatch.setattr(cuda_copy, "_movers", {})
    assert isinstance(cuda_copy.mover(1), str)  # built on the caller's thread: the failure kept, not raised
