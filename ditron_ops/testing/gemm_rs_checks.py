"""Checks of ``gemm_rs`` / ``gemm_ar`` against the order-exact reference (CPU, GPU, self-check).

The order-exact reference sums every rank's fp32 product from our batch-invariant GEMM
(``matmul(deterministic=True)`` with an fp32 output) in rank order and rounds once, exactly what
the fused kernels promise, so the comparison is ``torch.equal``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import reference
from ..gemm.ag_gemm import ag_gemm
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
    part = matmul(a, b, out=torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device),
                  deterministic=True)
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


def check_tp_mlp_autograd(group: Group, sizes: Sequence[int], hidden: int, ffn_per_rank: int,
                          dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> bool:
    """``y = gemm_rs(ag_gemm(x, w1), w2)`` (fused, uneven shards ``sizes``): output and the
    gradients of x, w1, w2 against the single-process fp32 reference (AssertionError)."""
    w, r, f = group.world_size, group.rank, ffn_per_rank
    gen = torch.Generator().manual_seed(7)
    x_full = torch.randn(sum(sizes), hidden, generator=gen).to(dtype).float()
    w1_full = (torch.randn(hidden, f * w, generator=gen) * hidden ** -0.5).to(dtype).float()  # column shards
    w2_full = (torch.randn(f * w, hidden, generator=gen) * (f * w) ** -0.5).to(dtype).float()  # row shards
    g_full = torch.randn(sum(sizes), hidden, generator=gen).to(dtype).float()
    rows, cols = slice(sum(sizes[:r]), sum(sizes[:r + 1])), slice(f * r, f * (r + 1))
    x = x_full[rows].to(group.device, dtype).requires_grad_()
    w1 = w1_full[:, cols].to(group.device, dtype).requires_grad_()
    w2 = w2_full[cols].to(group.device, dtype).requires_grad_()
    h = ag_gemm(x, w1, group, impl="fused", shard_sizes=list(sizes))
    y = gemm_rs(h, w2, group, impl="fused", shard_sizes=list(sizes))
    (y.float() * g_full[rows].to(group.device)).sum().backward()
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x_full, w1_full, w2_full))
    ((xr @ w1r @ w2r) * g_full).sum().backward()
    for name, got, want in (("y", y.detach(), (x_full @ w1_full @ w2_full)[rows]), ("x", x.grad, xr.grad[rows]),
                            ("w1", w1.grad, w1r.grad[:, cols]), ("w2", w2.grad, w2r.grad[cols])):
        err = (got.float().cpu() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (f"rank {r}", name, err)
    return True
