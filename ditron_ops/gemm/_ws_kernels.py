"""Experimental: the plain persistent GEMM with Triton's automatic warp specialization (Hopper).

``ws_gemm_kernel`` is ``persistent_gemm_kernel``'s plain path (``WAIT=False``, no bias, no split
tail) in the form Triton 3.6's Hopper pass (``NVGPUWarpSpecialization``) partitions: one TMA
producer warp group and two wgmma consumer warp groups, each computing half of the tile's rows
(``num_warps=4`` asked, 12 warps run; ``setmaxnreg`` gives the consumers 232 registers). Only
``bench gemm_sweep --only ws`` and tests launch it (``_ws.ws_matmul``); NOT MEASURED
(benchmarks/NOTES.md, GEMM core, Warp-specialized variants).

What the pass needs, found compiling for sm_90a (``tools/sm90_compile.py ws``):

* ``num_warps=4``: with 8 the pass leaves the loop alone (no ``ttg.warp_specialize``).
* Descriptors made in the kernel (``tl.make_tensor_descriptor``; 512 bytes of global scratch
  per program): the pass halves the loads' and the store's blocks, which a host descriptor
  fixes ("'tt.descriptor_store' op tensor descriptor block and tensor types must match").
* One full-tile store: the half-width epilogue's reshape / permute / split stops the data
  partitioner ("unsupported op type", WSDataPartition.cpp:1205), so C takes a whole tile of
  shared memory (128x256 bf16: 64 KB, 3 stages at most).
* No ``flatten``: with it the pass makes no partitions either, and at 4 warps the 128x256
  accumulator spills (255 registers, 1 KB of stack).
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl
from ._core_kernels import _tile_coords, tile_matmul


@dl.jit(do_not_specialize=("M", "N", "K", "stride_am", "stride_b", "stride_cm"))
def ws_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_b, stride_cm,
                   B_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """``C[M, N] = A[M, K] @ B[K, N]``, persistent over the tiles in ``_tile_coords``' grouped
    order with the same K order as ``tile_matmul``. ``A``, ``C`` row-major (row strides
    ``stride_am``, ``stride_cm``); ``B`` as ``[K, N]`` (``B_KN``) or as ``B^T [N, K]``, row
    stride ``stride_b``; every row 16-byte aligned (TMA).

    The epilogue recomputes the tile's coordinates from its own counter (as Triton's persistent
    matmul tutorial does) rather than carrying them through the K loop."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    if B_KN:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_b, 1], [BLOCK_K, BLOCK_N])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_b, 1], [BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_tiles = GROUP_M * tiles_n
    tile_c = pid - nprog
    for tile in tl.range(pid, tiles_m * tiles_n, nprog, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, tiles_m, group_tiles, 0, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tile_matmul(a_desc, b_desc, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), off_m,
                          off_n, K, B_KN, BLOCK_K)
        tile_c += nprog
        pid_m, pid_n = _tile_coords(tile_c, tiles_m, group_tiles, 0, GROUP_M)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))
