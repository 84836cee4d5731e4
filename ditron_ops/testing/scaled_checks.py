"""Shared checks of ``ag_gemm_scaled`` (CPU interpreter and GPU tiers): e4m3 inputs with scales of
every mode, the float64 product of the dequantized operands, and a bound derived from the
roundings (the fp32 sum of K products, then one rounding to the output dtype)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

import ditron_ops

FP8 = torch.float8_e4m3fn
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
"""Half an ulp at 1.0 of each output dtype (relative rounding error of one rounding)."""


def scaled_inputs(sizes: Sequence[int], k: int, n: int, mode: str, device, seed: int = 0):
    """``(a_list, scale_a_list, b, scale_b)``: every rank's fp8 rows and scales (the same on
    every rank for one seed), a column-major fp8 ``b`` and its scales, all for ``mode``."""
    gen = torch.Generator().manual_seed(seed)
    kb, nb = -(-k // 128), -(-n // 128)

    def scale(*shape):
        return (torch.rand(*shape, generator=gen) + 0.5).to(device)
    a_list = [(torch.randn(s, k, generator=gen) * 8).to(FP8).to(device) for s in sizes]
    b = (torch.randn(n, k, generator=gen) * 8).to(FP8).to(device).t()
    if mode == "tensor":
        return a_list, [scale(1) for _ in sizes], b, scale(1)
    if mode == "row":
        return a_list, [scale(s, 1) for s in sizes], b, scale(1, n)
    return a_list, [scale(s, kb) for s in sizes], b, scale(kb, nb)


def dequantized(a_list, sa_list, b, sb, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered A and B in float64, scales applied."""
    k, n = b.shape
    if mode == "block":
        a = torch.cat([x.double() * s.double().repeat_interleave(128, 1)[:, :k]
                       for x, s in zip(a_list, sa_list)])
        bs = sb.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
        return a, b.double() * bs
    a = torch.cat([x.double() * s.double() for x, s in zip(a_list, sa_list)])
    return a, b.double() * sb.double()


def check_close(out: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> None:
    """``out`` within the rounding bound of ``a64 @ b64 (+ bias)``: one rounding to out's dtype
    (half an ulp of the value) plus K fp32 additions of products (``K * 2^-23`` of ``|A| @ |B|``),
    plus the fp32 product of two scales per term (``2^-22`` more)."""
    ref = a64 @ b64
    mag = a64.abs() @ b64.abs()
    if bias is not None:
        ref = ref + bias.double()
        mag = mag + bias.double().abs()
    k = a64.shape[1]
    bound = UNIT[out.dtype] * ref.abs() * 1.01 + (k + 4) * 2.0 ** -22 * mag + 1e-30
    err = (out.double().cpu() - ref.cpu()).abs()
    bad = err > bound.cpu()
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} elements beyond the rounding bound; "
                             f"first at flat {i}: got {out.flatten()[i].item()}, expected "
                             f"{ref.flatten()[i].item()}, bound {bound.flatten()[i].item():.3g}")


def check_ag_gemm_scaled(group, sizes, k: int, n: int, mode: str, out_dtype=torch.bfloat16,
                         impl: str = "fused", bias: bool = False, seed: int = 0) -> bool:
    """One call on every rank of ``group`` checked against the float64 product (rank body)."""
    a_list, sa_list, b, sb = scaled_inputs(sizes, k, n, mode, group.device, seed)
    bias_t = _bias(n, out_dtype, group.device, seed) if bias else None
    r = group.rank
    out = ditron_ops.ag_gemm_scaled(a_list[r], b, sa_list[r], sb, group, bias=bias_t,
                                    out_dtype=out_dtype, impl=impl, shard_sizes=list(sizes))
    assert out.shape == (sum(sizes), n) and out.dtype == out_dtype
    a64, b64 = dequantized(a_list, sa_list, b, sb, mode)
    check_close(out, a64, b64, bias_t)
    return True


def reduce_inputs(m: int, k_sizes: Sequence[int], n: int, mode: str, device, seed: int = 0):
    """Every rank's ``(a [M, K_r], scale_a, b [K_r, N] column-major, scale_b)`` for ``mode``
    (the same on every rank for one seed)."""
    out = []
    for r, k in enumerate(k_sizes):
        a_list, sa_list, b, sb = scaled_inputs([m], k, n, mode, device, seed=seed * 101 + r)
        out.append((a_list[0], sa_list[0], b, sb))
    return out


def reduce_operands(parts, mode: str, rows: Optional[slice] = None) -> tuple:
    """``(A, B)`` in float64, scales applied, whose product is the sum over ranks of
    ``reduce_inputs``' ``parts``: every rank's A side by side, B stacked (``rows``: only those
    rows of A, a ``gemm_rs_scaled`` rank's)."""
    a64 = torch.cat([dequantized([p[0]], [p[1]], p[2], p[3], mode)[0] for p in parts], dim=1)
    b64 = torch.cat([dequantized([p[0]], [p[1]], p[2], p[3], mode)[1] for p in parts], dim=0)
    return (a64 if rows is None else a64[rows]), b64


def _bias(n: int, out_dtype, device, seed: int) -> torch.Tensor:
    """A ``[N]`` bias of ``out_dtype``, the same on every rank for one seed."""
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(n, generator=gen) * 64).to(out_dtype).to(device)


def check_reduce_scaled(group, m: int, k_sizes: Sequence[int], n: int, mode: str, op: str,
                        out_dtype=torch.bfloat16, impl: str = "fused",
                        deterministic: bool = False, seed: int = 0, bias: bool = False,
                        **kw) -> torch.Tensor:
    """``gemm_rs_scaled`` / ``gemm_ar_scaled`` (``op``) on every rank against the float64 sum
    over ranks of the dequantized products (this rank's rows for ``gemm_rs_scaled``), ``+ bias``
    with ``bias``; returns the output."""
    parts = reduce_inputs(m, k_sizes, n, mode, group.device, seed)
    a, sa, b, sb = parts[group.rank]
    bias_t = _bias(n, out_dtype, group.device, seed) if bias else None
    fn = getattr(ditron_ops, op)
    out = fn(a, b, sa, sb, group, bias=bias_t, out_dtype=out_dtype, impl=impl,
             deterministic=deterministic, **kw)
    rows = None
    if op == "gemm_rs_scaled":
        sizes = kw.get("shard_sizes") or ditron_ops.split_sizes(m, group.world_size)
        rows = slice(sum(sizes[:group.rank]), sum(sizes[:group.rank + 1]))
    a64, b64 = reduce_operands(parts, mode, rows)
    assert out.shape == (a64.shape[0], n) and out.dtype == out_dtype
    check_close(out, a64, b64, bias_t)
    return out
