"""Element copies shared by kernels of several families (collectives, ag_gemm's pull producer)."""
from __future__ import annotations

import triton.language as tl

from ._jit import jit


@jit
def copy_tiles(dst, src, count, pid, nprog, BLOCK: tl.constexpr):
    """Copy ``count`` elements, tiles ``pid, pid + nprog, ...`` (loads bypass L1: the source may
    have been written by a peer)."""
    offs = tl.arange(0, BLOCK)
    for off in range(pid * BLOCK, count, nprog * BLOCK):
        off = tl.multiple_of(off, BLOCK)
        mask = off + offs < count
        x = tl.load(src + off + offs, mask=mask, cache_modifier=".cg")
        tl.store(dst + off + offs, x, mask=mask)
