"""Operand rows the GEMM kernels can read: TMA-ready copies, and rows moved onto 128-byte lines.

A TMA descriptor needs a row-major operand with 16-byte aligned rows (``tma_ok``); anything else
is copied once per call into a buffer of the plan (``padded_copy``). K-long rows (A's, and a
weight's ``w.t()``) that TMA can read but that start off 128-byte lines (bf16 with K 8 past a
multiple of 16: every 128-byte row of a ``BLOCK_K = 64`` box then straddles two lines and five
32-byte sectors) slow every tile configuration (``_core_configs.MISALIGNED_SLOWDOWN``); where the rule says a copy costs less
than it saves (``_core_configs.pad_operands``), ``RowPad`` copies the call's rows into a buffer
whose rows start on lines (``pad_rows_kernel``) and the GEMM reads that. ``RowPacker`` packs
``ag_gemm_scaled``'s fp8 rows and their scales into the rows its gather moves.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..runtime.launcher import BoundKernel
from ._core_configs import LINE_BYTES
from ._core_kernels import pack_rows_kernel, pad_rows_kernel



def tma_ok(t: torch.Tensor) -> bool:
    """``t`` (2-D) can back a TMA descriptor as is: last dim contiguous, 16-byte aligned."""
    e = t.element_size()
    return (t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * e) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


def padded_copy(t: torch.Tensor) -> torch.Tensor:
    """Row-major copy of ``t`` (any strides) with rows on 128-byte lines (viewed back to
    ``t``'s shape)."""
    rows, cols = t.shape
    e = t.element_size()
    buf = t.new_empty((rows, -(-cols * e // LINE_BYTES) * LINE_BYTES // e))[:, :cols]
    buf.copy_(t)
    return buf


def read_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The row-major view of ``t`` that a descriptor reads (``t``, else ``t.T`` for a B given as
    ``w.t()``), or None when neither backs one (a ``padded_copy`` is read instead)."""
    if tma_ok(t):
        return t
    return t.t() if tma_ok(t.t()) else None


def row_alignment(rows: Optional[torch.Tensor]) -> int:
    """Bytes (a power of two, at most ``LINE_BYTES``) on which every row of the row-major
    ``rows`` (``read_rows``) starts: 128 on lines, 32 or 64 on sectors, 16 off them. None (a
    ``padded_copy`` to make, whose rows are on lines) counts as 128."""
    if rows is None:
        return LINE_BYTES
    pitch = rows.stride(0) * rows.element_size() if rows.shape[0] > 1 else 0
    bits = rows.data_ptr() | pitch | LINE_BYTES
    return bits & -bits


def off_sectors(rows: Optional[torch.Tensor]) -> bool:
    """Whether ``rows`` (``read_rows``) start off 32-byte sectors and ``RowPad`` can copy them
    (rows of whole 16-byte vectors): ``_core_configs.pad_operands``' candidates."""
    return (rows is not None and row_alignment(rows) < 32
            and rows.shape[1] * rows.element_size() % 16 == 0)


PAD_BLOCKS = {"cuda": (8, 512, 4), "cpu": (4, 32, 1)}
"""``pad_rows_kernel``'s ``(BLOCK_R, BLOCK_C, num_warps)`` per device type: 8 KB of bf16 a
program on the GPU (four 16-byte loads a thread); small blocks in the interpreter."""


class RowPad:
    """A buffer shaped like the row-major ``rows`` whose rows start on 128-byte lines, and the
    per-call copy into it (``pad_rows_kernel``, bound once; only the source address varies).

    Parameters
    ----------
    rows : torch.Tensor
        An example of the call's rows (``read_rows``: row-major, 16-byte aligned pitch), each
        a whole number of 16-byte vectors (``off_sectors``).
    """

    def __init__(self, rows: torch.Tensor):
        n_rows, cols = rows.shape
        e = rows.element_size()
        if cols * e % 16 or rows.stride(0) * e % 16 or rows.stride(1) != 1:
            raise ValueError(f"RowPad: rows of {cols * e} bytes {rows.stride(0) * e} apart "
                             "are not whole 16-byte vectors")
        pitch = -(-cols * e // LINE_BYTES) * LINE_BYTES // e
        self.buf = rows.new_empty((n_rows, pitch))[:, :cols]
        br, bc, warps = PAD_BLOCKS["cuda" if rows.is_cuda else "cpu"]
        self.kernel = BoundKernel(
            pad_rows_kernel, (-(-n_rows // br), -(-cols // bc)),
            (rows, self.buf, n_rows, cols, rows.stride(0), pitch),
            dict(BLOCK_R=br, BLOCK_C=bc, VEC=16 // e, num_warps=warps),
            vary=("src_ptr",), device=rows.device)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy ``rows`` (the call's; the example's shape and pitch) into ``buf``; returns it."""
        self.kernel.launch(rows)
        return self.buf


PACK_BLOCKS = {"cuda": (8, 1024, 64, 4), "cpu": (4, 64, 4, 1)}
"""``pack_rows_kernel``'s ``(BLOCK_R, BLOCK_C, BLOCK_S, num_warps)`` per device type: 8 KB of fp8
bytes a program on the GPU (as ``PAD_BLOCKS``); small blocks in the interpreter."""


def pack_vec(a: torch.Tensor) -> int:
    """Bytes ``pack_rows_kernel`` moves per load of ``a``'s rows: 16 where the rows are whole,
    aligned 16-byte vectors, else 1."""
    whole = a.shape[1] % 16 == 0 and (a.stride(0) % 16 == 0 or a.shape[0] <= 1)
    return 16 if whole and a.stride(1) == 1 and a.data_ptr() % 16 == 0 else 1


class RowPacker:
    """``ag_gemm_scaled``'s per-call packing of fp8 rows and their scales into the rows the
    gather moves (``scaled.packed_row``): one launch of ``pack_rows_kernel``, bound once per
    layout (only the addresses vary), in place of two torch copies into the strided rows.

    Parameters
    ----------
    a : torch.Tensor
        An example of the call's ``[M, K]`` fp8 rows (unit column stride, or one column).
    scale_a : torch.Tensor
        An example of its fp32 scales.
    s_row, s_col : int
        Row ``r``'s ``j``-th scale is element ``r * s_row + j * s_col`` of ``scale_a`` (both 0:
        one tensor-wise scale for every row).
    scale_word, scales, pitch : int
        The packed row's layout: scales from fp32 word ``scale_word``, ``scales`` of them, rows
        ``pitch`` bytes.
    """

    def __init__(self, a: torch.Tensor, scale_a: torch.Tensor, s_row: int, s_col: int,
                 scale_word: int, scales: int, pitch: int):
        rows, k = a.shape
        self.shape = (rows, pitch // 4)
        br, bc, bs, warps = PACK_BLOCKS["cuda" if a.is_cuda else "cpu"]
        example = torch.empty(self.shape, dtype=torch.float32, device=a.device)
        self.kernel = BoundKernel(
            pack_rows_kernel, (-(-rows // br), -(-k // bc)),
            (a.view(torch.uint8), scale_a, example.view(torch.uint8), example, rows, k,
             a.stride(0), s_row, s_col, pitch, scale_word, scales),
            dict(BLOCK_R=br, BLOCK_C=bc, BLOCK_S=bs, VEC=pack_vec(a), num_warps=warps),
            vary=("a_ptr", "s_ptr", "dst_ptr", "dst_words"), device=a.device)

    def __call__(self, a: torch.Tensor, scale_a: torch.Tensor) -> torch.Tensor:
        """The call's packed rows: ``[M, pitch / 4]`` fp32 words, fresh."""
        packed = torch.empty(self.shape, dtype=torch.float32, device=a.device)
        self.kernel.launch(a.view(torch.uint8), scale_a, packed.view(torch.uint8), packed)
        return packed
