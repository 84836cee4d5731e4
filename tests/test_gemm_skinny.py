"""CPU tier: the small-M GEMM (``TileConfig.swap_ab``, ``_core.SkinnyGemm``,
``_core_kernels.skinny_gemm_kernel``) in the interpreter: exact on integer-valued inputs (every
product and partial sum exact in fp32), for M below, at and above its tile's rows, edge tiles
in N and K, bias, both B layouts and any output strides."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm._core import TileConfig, matmul

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")

SKINNY = TileConfig(16, 32, 16, 1, 4, 1, swap_ab=True)


def _ints(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("m,n,k", [(1, 40, 100), (3, 64, 48), (16, 33, 17), (17, 70, 64),
                                   (40, 32, 130)])
def test_skinny_is_exact_for_integer_inputs(m, n, k):
    for dtype, kind, with_bias in itertools.product((torch.float32, torch.float16), ("kn", "nk"),
                                                    (False, True)):
        a = _ints(m, k, dtype=dtype)
        b = _ints(k, n, dtype=dtype, seed=1) if kind == "kn" else _ints(n, k, dtype=dtype, seed=1).t()
        bias = _ints(n, dtype=dtype, seed=2) if with_bias else None
        got = matmul(a, b, bias=bias, cfg=SKINNY, deterministic=False)
        plan = next(reversed(_core._MATMUL_PLANS.cache._plans.values()))
        assert isinstance(plan.core, _core.SkinnyGemm)
        want = a.float() @ b.float() + (bias.float() if with_bias else 0)
        assert got.dtype == dtype and torch.equal(got.float(), want), (m, n, k, dtype, kind)


def test_skinny_any_output_strides():
    """A column-major fp32 ``out`` (pointer stores with both strides)."""
    a, b = _ints(5, 48), _ints(48, 40, seed=1)
    out = torch.empty(40, 5).t()
    matmul(a, b, out=out, cfg=SKINNY, deterministic=False)
    assert torch.equal(out, a @ b)


def test_skinny_unaligned_b_is_copied_per_call():
    """A B that no TMA descriptor reads (row pitch not a multiple of 16 bytes) goes through the
    plan's padded copy, refreshed on every call: new values of the same B give new results."""
    a = _ints(3, 48)
    wide = _ints(48, 41, seed=1)
    b = wide[:, :40]  # [K, N] rows 164 bytes apart; b.T is not row-major
    got = matmul(a, b, cfg=SKINNY, deterministic=False)
    plan = next(reversed(_core._MATMUL_PLANS.cache._plans.values()))
    assert plan.core._b_pad is not None and torch.equal(got, a @ b)
    wide.mul_(2)
    assert torch.equal(matmul(a, b, cfg=SKINNY, deterministic=False), a @ b)
