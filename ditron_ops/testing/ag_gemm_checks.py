"""Checks of ``ag_gemm`` against ``all_gather`` + fp32 matmul (CPU interpreter, GPU, self-check)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import reference
from ..gemm.ag_gemm import ag_gemm
from ..runtime.group import Group

# Max |ours - reference| / max |reference| accepted per dtype (fp32 reference; GPU fp16/bf16 GEMMs
# accumulate in fp32 and round once, so the error is about one output rounding).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def ag_gemm_inputs(group: Group, sizes: Sequence[int], n: int, k: int, dtype: torch.dtype,
                   weight_layout: bool, seed: int = 0):
    """(a [M_r, K], b [K, N], bias [N]): ``b`` is ``w.t()`` of a ``[N, K]`` weight when
    ``weight_layout`` (column-major ``b``), else a row-major ``[K, N]``. Same ``b`` on all ranks."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + group.rank)
    scale = max(k, 1) ** -0.25
    a = (torch.randn(sizes[group.rank], k, generator=gen) * scale).to(dtype=dtype, device=group.device)
    gen_b = torch.Generator(device="cpu").manual_seed(seed * 1000 + 999)
    shape = (n, k) if weight_layout else (k, n)
    b = (torch.randn(shape, generator=gen_b) * scale).to(dtype=dtype, device=group.device)
    bias = torch.randn(n, generator=gen_b).to(dtype=dtype, device=group.device)
    return a, (b.t() if weight_layout else b), bias


def check_ag_gemm(group: Group, sizes: Sequence[int], n: int, k: int, dtype: torch.dtype, *,
                  weight_layout: bool = True, with_bias: bool = True, use_out: bool = False,
                  impl: str = "fused", seed: int = 0, return_gathered: bool = True) -> float:
    """One ag_gemm call vs the reference; returns the relative error (raises AssertionError).

    The gathered A must equal ``all_gather(a)`` exactly; the product must be within
    ``REL_TOL[dtype]`` of the fp32 reference.
    """
    a, b, bias = ag_gemm_inputs(group, sizes, n, k, dtype, weight_layout, seed)
    bias = bias if with_bias else None
    out: Optional[torch.Tensor] = None
    if use_out:  # a strided destination: every other column of a wider buffer
        out = torch.empty(sum(sizes), 2 * n, dtype=dtype, device=group.device)[:, ::2]
    res = ag_gemm(a, b, group, bias=bias, out=out, impl=impl, shard_sizes=list(sizes),
                  return_gathered=return_gathered)
    got, gathered = res if return_gathered else (res, None)
    if use_out:
        assert got.data_ptr() == out.data_ptr()
    full = reference.all_gather(a, group, list(sizes))
    want = full.float() @ b.float()
    if bias is not None:
        want += bias.float()
    group.synchronize()
    assert got.shape == want.shape, (got.shape, want.shape)
    if gathered is not None:
        assert torch.equal(gathered, full), f"rank {group.rank}: gathered A differs"
    if want.numel() == 0:
        return 0.0
    err = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    assert err <= REL_TOL[dtype], f"rank {group.rank}: relative error {err:.2e} > {REL_TOL[dtype]:.0e}"
    return err


def interpreter_split_tail(monkeypatch, programs: int):
    """Tests: interpreter tiles of 16 x 32 (halves 16 wide) with ``split_tail``, the rule's only
    candidate, on ``programs`` programs (the interpreter runs them one after the other), through
    pytest's ``monkeypatch``; returns the tile configuration."""
    from ..gemm import _core as _launch, _core_configs, _core_grid

    cfg = _launch.TileConfig(16, 32, 16, 2, 4, 1, split_tail=True)
    monkeypatch.setattr(_core_configs, "INTERPRETER_CANDIDATES",
                        (_core_configs.Candidate("16x32x16/tail", cfg, 1.0, True),))
    monkeypatch.setattr(_core_grid, "INTERPRETER_PROGRAMS", programs)
    return cfg
