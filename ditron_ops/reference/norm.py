"""Plain-torch oracle of ``all_reduce_rmsnorm``: the composition all_reduce -> add -> RMSNorm ->
e4m3 quantization, with the roundings the fused op promises.

``add_rmsnorm`` and ``quantize_fp8`` are local (no group): the tests feed them the rank-ordered
sum, or the op's own normed rows (the quantization is then exact to compare bitwise).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime.group import Group
from .collectives import gather_tensors, rank_ordered_sum

FP8_MAX = 448.0
GROUP = 128


def row_sum_fixed_order(v: torch.Tensor) -> torch.Tensor:
    """``v [T, H]``'s sum over H as ``[T, 1]`` in a fixed pairwise order of elementwise adds
    (H zero-padded to a power of two, halves added until one column is left): every row's bits
    depend on that row alone on any device, where torch's own reductions may split a row
    differently for another T (CUDA)."""
    width = 1 << max(0, (v.shape[-1] - 1).bit_length())
    if width != v.shape[-1]:
        v = F.pad(v, (0, width - v.shape[-1]))
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v


def add_rmsnorm(h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float, row_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of the all-reduced ``h [T, H]`` (already rounded to its dtype).

    ``residual_out = round(h + residual)`` (fp32 add, one rounding, as torch's ``h + residual``);
    ``normed = round(r * rstd * weight)`` in fp32 with ``rstd = 1 / sqrt(mean(r^2) + eps)``, one
    rounding, as ``torch.nn.functional.rms_norm`` computes it (the sum over H is torch's order,
    or with ``row_invariant`` ``row_sum_fixed_order``'s; ``normed`` may differ from the
    kernel's by an ulp either way).
    """
    res_out = (h.float() + residual.float()).to(h.dtype)
    r = res_out.float()
    sumsq = row_sum_fixed_order(r * r) if row_invariant else r.pow(2).sum(-1, keepdim=True)
    mean = sumsq / r.shape[-1]
    rstd = 1.0 / torch.sqrt(mean + torch.tensor(eps, dtype=torch.float32))
    normed = (r * rstd * weight.float()).to(h.dtype)
    return normed, res_out


def quantize_fp8(y: torch.Tensor, group_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)``: e4m3 codes of ``y [T, H]`` with ``scale = amax * fp32(1/448)`` in fp32 per row
    (``scales [T, 1]``) or per ``group_size`` columns (``scales [T, H / group_size]``);
    ``codes = e4m3(clamp(y / scale, -448, 448))`` (a zero scale divides by 1)."""
    t, h = y.shape
    g = h if group_size is None else group_size
    yf = y.float().reshape(t, h // g, g)
    # times the fp32 reciprocal, as torch's CUDA ``amax / 448`` computes it (CPU torch divides)
    scale = yf.abs().amax(-1, keepdim=True) * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (yf / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(t, h), scale.reshape(t, h // g)


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, group: Group, quant: Optional[str] = None,
                       deterministic: Optional[bool] = None) -> tuple:
    """The op's result from an fp32 sum over ranks (one rounding) and the local math above:
    ``(normed, residual_out)`` or with ``quant`` ``(normed, residual_out, codes, scales)``.

    ``deterministic=None`` (the oracle of the tests): the rank-ordered sum of the gathered x
    and torch's sum over H. ``True`` (the op on a ``TorchGroup``): the same sum over ranks and
    ``row_sum_fixed_order`` (batch invariant). ``False``: the process group's all-reduce of x
    in fp32 (the backend's order, no W-fold gather traffic) and torch's sum over H.
    """
    pg = getattr(group, "pg", None)
    if deterministic is False and pg is not None:
        total = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
        dist.all_reduce(total, group=pg)
        h = total.to(x.dtype)
    else:
        h = rank_ordered_sum(gather_tensors(x, group), x.dtype)
    normed, res_out = add_rmsnorm(h, residual, weight, eps, row_invariant=bool(deterministic))
    if quant is None:
        return normed, res_out
    return (normed, res_out) + quantize_fp8(normed, GROUP if quant == "fp8_e4m3_128" else None)
