"""Checks of ``gemm_rs`` / ``gemm_ar`` against the order-exact reference (CPU, GPU, self-check).

The order-exact reference sums every rank's fp32 product from our fixed-configuration GEMM
(``ag_gemm.matmul`` with an fp32 output) in rank order and rounds once, exactly what the fused
kernels promise, so the comparison is ``torch.equal``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import reference
from ..gemm.gemm_rs import gemm_ar, gemm_rs
from ..gemm._core import matmul
from ..runtime.group import Group
from ..runtime.split import split_sizes


def gemm_rs_inputs(group: Group, m: int, n: int, k: int, dtype: torch.dtype, weight_layout: bool = True,
                   seed: int = 0, exact: bool = False):
    """(a [M, K_r], b [K_r, N]) of this rank; ``b = w.t()`` of a ``[N, K_r]`` weight if asked.

    ``exact``: small integers (|x| <= 4) instead of normal values, so every product and sum is
    exact in fp32 and any summation order gives the same bits. Interpreter tests that compare
    kernels of different tile widths need it: the interpreter's ``tl.dot`` is numpy's matmul,
    whose rounding depends on the block width with some OpenBLAS kernels (Haswell, Zen: a
    16-wide product differs from the same columns of a 32-wide one), which the GPU's MMA does
    not."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + group.rank)
    shape = (n, k) if weight_layout else (k, n)
    if exact:
        a = torch.randint(-4, 5, (m, k), generator=gen).to(dtype=dtype, device=group.device)
        b = torch.randint(-4, 5, shape, generator=gen).to(dtype=dtype, device=group.device)
        return a, (b.t() if weight_layout else b)
    scale = max(k, 1) ** -0.25
    a = (torch.randn(m, k, generator=gen) * scale).to(dtype=dtype, device=group.device)
    b = (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=group.device)
    return a, (b.t() if weight_layout else b)


def order_exact(a: torch.Tensor, b: torch.Tensor, group: Group) -> torch.Tensor:
    """``Σ_r a_r @ b_r``: fp32 products of our GEMM summed in rank order, rounded once."""
    part = matmul(a, b, out=torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device))
    return reference.rank_ordered_sum(reference.gather_tensors(part, group), a.dtype)


def check_gemm_reduce(group: Group, m: int, n: int, k: int, dtype: torch.dtype, *,
                      weight_layout: bool = True, algorithm: str = "auto",
                      shard_sizes: Optional[Sequence[int]] = None, seed: int = 0,
                      exact: bool = False) -> bool:
    """gemm_rs and gemm_ar (fused, deterministic) must equal the order-exact reference bitwise
    (``exact``: integer inputs, see ``gemm_rs_inputs``)."""
    a, b = gemm_rs_inputs(group, m, n, k, dtype, weight_layout, seed, exact)
    rows = list(shard_sizes) if shard_sizes is not None else split_sizes(m, group.world_size)
    rs = gemm_rs(a, b, group, deterministic=True, impl="fused", shard_sizes=rows)
    ar = gemm_ar(a, b, group, deterministic=True, impl="fused", algorithm=algorithm)
    want = order_exact(a, b, group)
    group.synchronize()
    start = sum(rows[:group.rank])
    assert torch.equal(rs, want[start:start + rows[group.rank]]), f"rank {group.rank}: gemm_rs differs"
    assert torch.equal(ar, want), f"rank {group.rank}: gemm_ar ({algorithm}) differs"
    return True


def spy_own_tail(monkeypatch) -> list:
    """Tests: the list every ``gemm._rs_launch.own_tail`` result is appended to (how many tiles
    the reduce-scatter GEMM ran as split-tail halves), through pytest's ``monkeypatch``."""
    from ..gemm import _rs_launch as _launch

    seen, own_tail = [], _launch.own_tail
    monkeypatch.setattr(_launch, "own_tail", lambda *a: seen.append(own_tail(*a)) or seen[-1])
    return seen
