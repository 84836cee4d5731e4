"""Test-only kernel of ``moe_checks``: ``_kernels._quotient`` on given values and scales.

Here rather than in ``moe._kernels``: nothing but the checks launches it (kernels live in
``_*_kernels`` modules, ``DESIGN.md``).
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl
from ..moe import _kernels


@dl.jit
def quotient_kernel(v_ptr, s_ptr, q_ptr, c_ptr, QUANT: tl.constexpr, R: tl.constexpr):
    """``_kernels._quotient`` of ``R`` rows of 128 values per program, and the e4m3 codes."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    offs = r[:, None, None] * 128 + tl.arange(0, 128)[None, None, :]
    v = tl.load(v_ptr + offs)
    q = _kernels._quotient(v, tl.load(s_ptr + r)[:, None], QUANT)
    tl.store(q_ptr + offs, q)
    tl.store(c_ptr + offs, _kernels._e4m3(q))
