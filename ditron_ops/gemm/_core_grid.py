"""Grids and the B operand of every persistent-GEMM launch (``matmul``, ag_gemm's consumer,
gemm_rs / gemm_ar's producer): the program budget per rank, the consumer grid, and B's TMA
descriptor over ``b`` or ``b.T`` (an aligned copy where neither serves). Re-exported by
``_core``."""
from __future__ import annotations

from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime.group import Group, sm_count
from ._core_configs import TileConfig
from ._pad import padded_copy, tma_ok


INTERPRETER_PROGRAMS = 1
"""Consumer programs in the interpreter (it runs a grid's programs one after the other, so a
waiting program must not need a later one; the fused path's producer runs first there)."""


def program_budget(device: torch.device, group: Optional[Group]) -> int:
    """Programs a persistent consumer may use: every SM (the default all-gather runs on copy
    engines), or this rank's share of them in a virtual world (all ranks' waiting grids must be
    resident together); ``INTERPRETER_PROGRAMS`` in the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return group.sm_share() if group is not None else sm_count(device)


def consumer_programs(device: torch.device, group: Optional[Group], tiles: int) -> int:
    """Persistent GEMM grid: one program per tile up to ``program_budget``; pull mode gives
    ``pull_programs`` of them to the producer (see ``fused``)."""
    return max(1, min(tiles, program_budget(device, group)))


def consumer_grid(device: torch.device, group: Optional[Group], tiles: int,
                  cfg: TileConfig) -> int:
    """``consumer_programs`` (``cfg.ctas_per_sm`` per SM of the budget), doubled when
    ``split_tail`` can run every tile as two halves within the budget (small M: e.g. 7 tiles
    on 14 programs)."""
    budget = program_budget(device, group) * cfg.ctas_per_sm
    if cfg.split_tail and 2 * tiles <= budget:
        return 2 * tiles
    return max(1, min(tiles, budget))


def b_operand(b: torch.Tensor, cfg: TileConfig, b_pad: Optional[torch.Tensor] = None
              ) -> tuple[Optional[torch.Tensor], TensorDescriptor, bool]:
    """``b``'s aligned copy when no TMA descriptor can be made over ``b`` or ``b.T`` (``b_pad``
    if given, else a new one; None when ``b`` serves as is), then ``b_descriptor`` of what the
    GEMM reads. The plan keeps the copy alive as long as its descriptor."""
    pad = None
    if not tma_ok(b) and not tma_ok(b.t()):
        pad = b_pad if b_pad is not None else padded_copy(b)
    return (pad, *b_descriptor(b if pad is None else pad, cfg))


def b_descriptor(b: torch.Tensor, cfg: TileConfig) -> tuple[TensorDescriptor, bool]:
    """TMA descriptor for ``b [K, N]`` (blocks ``cfg.block_n`` wide) and whether it is over
    ``b`` (True) or ``b.T`` (False).

    ``[K, N]`` row-major and ``w.t()`` of a row-major Linear weight ``w [N, K]`` are used as they
    are; any other stride pattern is copied once into an aligned row-major buffer.
    """
    bn = cfg.block_n
    if tma_ok(b):
        return TensorDescriptor(b, list(b.shape), list(b.stride()), [cfg.block_k, bn]), True
    bt = b.t()
    if tma_ok(bt):
        return TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [bn, cfg.block_k]), False
    b = padded_copy(b)
    return TensorDescriptor(b, list(b.shape), list(b.stride()), [cfg.block_k, bn]), True


def half_b_descriptor(b_desc: TensorDescriptor, b_kn: bool, cfg: TileConfig) -> TensorDescriptor:
    """``b_desc`` (from ``b_descriptor``) in ``cfg.block_n / 2`` wide blocks for the split tail,
    over the same memory (no second copy of an unaligned B); ``b_desc`` itself without it."""
    if not cfg.split_tail:
        return b_desc
    half = cfg.block_n // 2
    block = [cfg.block_k, half] if b_kn else [half, cfg.block_k]
    return TensorDescriptor(b_desc.base, b_desc.shape, b_desc.strides, block)
