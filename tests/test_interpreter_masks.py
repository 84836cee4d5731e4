"""Masks built from a scalar comparison stay boolean in the Triton interpreter.

Triton's interpreter labels a comparison's result with its operand's type, so a broadcast scalar
comparison became an int32 0/1 mask: Triton 3.6 loaded through it anyway, 3.9 raises ``mask has
unsupported dtype``. ``language._jit`` types comparisons ``int1``; this kernel uses each form
the op kernels use, on whichever Triton the tier runs.
"""
import torch
import triton.language as tl

from ditron_ops import _env
from ditron_ops.language import jit

import pytest

pytestmark = pytest.mark.skipif(not _env.use_interpreter(), reason="interpreter tier")


@jit
def _masked_copy_kernel(src, dst, n, flag, slices, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    keep = (offs < n) & (flag != 0)                       # block & broadcast scalar comparison
    x = tl.load(src + offs, mask=keep, other=-1.0)
    s = tl.program_id(0)
    x = tl.where(flag != 0, x, 0.0)                       # scalar condition over a block
    tl.store(dst + s * BLOCK + offs, x, mask=s < slices)  # scalar mask on a block of pointers


@pytest.mark.parametrize("flag,slices", [(1, 2), (0, 1)])
def test_scalar_comparison_masks(flag, slices):
    src = torch.arange(8, dtype=torch.float32)
    dst = torch.full((2, 8), 7.0)
    _masked_copy_kernel[(2,)](src, dst, 5, flag, slices, BLOCK=8)
    row = torch.tensor([0, 1, 2, 3, 4, -1, -1, -1], dtype=torch.float32) if flag else torch.zeros(8)
    want = torch.stack([row, row if slices == 2 else torch.full((8,), 7.0)])
    assert torch.equal(dst, want)
