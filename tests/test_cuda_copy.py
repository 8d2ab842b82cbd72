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

