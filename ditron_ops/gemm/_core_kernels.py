"""The persistent GEMM core kernel and the tile helpers every GEMM kernel of the family uses.

``persistent_gemm_kernel`` is ``matmul`` (``WAIT=False``) and ag_gemm's consumer (``WAIT``:
each tile first waits for the gathered chunks its rows come from); gemm_rs's kernels reuse
``_tile_coords`` and ``tile_matmul``, so every GEMM of the family has the same K order.

``splitk_gemm_kernel`` and ``splitk_reduce_kernel`` are the default mode's split-K ``matmul``
(``_core_configs.select_split``): fp32 partial products of K slices, then their sum in slice
order, over all tiles or over the partial last wave that ``persistent_gemm_kernel`` left
(``_core_configs.sliced_tail``). Neither waits; no fused op and no deterministic call
launches them.

``skinny_gemm_kernel`` is ``matmul`` at small M (``TileConfig.swap_ab``): ``C^T = B^T A^T``,
so N takes the MMA's 64-row side and M its narrow side (a 16-column MMA instead of a 64-row
tile that is almost all padding), with ``tile_matmul``'s K steps.

``strip_gemm_kernel`` is the default mode's ``matmul`` in tiles wider than a power of two
(``TileConfig.strip``): two accumulators, ``BLOCK_N`` and ``STRIP`` wide, over one A block.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl


@dl.jit
def _tile_coords(tile, tiles_m, group_tiles, shift, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) tile order, M rotated by ``shift`` tiles (gather-mode swizzle)."""
    first_m = (tile // group_tiles) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = (first_m + (tile % group_tiles) % size_m + shift) % tiles_m
    pid_n = (tile % group_tiles) // size_m
    return pid_m, pid_n


@dl.jit
def tile_matmul(a_desc, b_desc, acc, off_m, off_n, K, B_KN: tl.constexpr, BLOCK_K: tl.constexpr,
                PROMOTE: tl.constexpr = None):
    """``acc += A[off_m:, :K] @ B[:K, off_n:]`` over fixed ``BLOCK_K`` steps (TMA loads; B as
    ``[K, N]`` when ``B_KN`` else as ``[N, K]`` transposed). The K order never depends on M.
    ``PROMOTE`` (fp8 operands): products summed in the tensor core's reduced precision before
    an fp32 add (``tl.dot``'s ``max_num_imprecise_acc``; Triton's sm_90 default never adds)."""
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a, b = _k_step(a_desc, b_desc, off_m, off_n, ki, B_KN, BLOCK_K)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
    return acc


@dl.jit
def _k_step(a_desc, b_desc, off_m, off_n, ki, B_KN: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step ``ki``'s tiles ``A[off_m:, ki*BLOCK_K:]`` and ``B[ki*BLOCK_K:, off_n:]`` (TMA
    loads; B stored ``[K, N]`` when ``B_KN`` else ``[N, K]``, read transposed)."""
    a = a_desc.load([off_m, ki * BLOCK_K])
    if B_KN:
        b = b_desc.load([ki * BLOCK_K, off_n])
    else:
        b = b_desc.load([off_n, ki * BLOCK_K]).T
    return a, b


@dl.jit
def tile_product(a_desc, b_desc, off_m, off_n, M, N, K, sa_ptr, sb_ptr, sa_row, sb_row,
                 B_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SCALE: tl.constexpr):
    """One tile's fp32 product ``A[off_m:, :K] @ B[:K, off_n:]`` in ``BLOCK_K`` steps from 0, its
    scales applied (fp8 operands):

    - ``SCALE == 0``: none (``tile_matmul``);
    - ``SCALE == 1``: row/column scales in the epilogue, ``acc * sa[m] * sb[n]`` (``sa_ptr`` one
      fp32 per row of A at ``sa_row`` floats apart, ``sb_ptr`` one per column of B at
      ``sb_row`` apart; a stride of 0 reads one tensor-wise scale); each K step's product is
      added to the sum in fp32 (the wgmma accumulator alone drifts past bf16 rounding at
      K of a few thousand on the H200, as ``torch._scaled_mm`` without fast accumulation);
    - ``SCALE == 2``: 1x128 blocks of A and 128x128 blocks of B (``BLOCK_K == 128``): every K
      step's product is promoted into the fp32 sum with ``sa[m, step] * sb[step, n // 128]``
      (``sa_row`` floats between A's rows, ``sb_row`` between B's block rows), so accuracy does
      not depend on K (TMA reads past K as zeros).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    if SCALE == 2:
        sa_rows = sa_ptr + rm.to(tl.int64) * sa_row
        sb_cols = sb_ptr + tl.minimum(rn, N - 1) // 128
        for ki in range(tl.cdiv(K, BLOCK_K)):
            a, b = _k_step(a_desc, b_desc, off_m, off_n, ki, B_KN, BLOCK_K)
            part = tl.dot(a, b)
            sa = tl.load(sa_rows + ki, mask=m_ok, other=0.0)
            sb = tl.load(sb_cols + ki * sb_row, mask=n_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
    elif SCALE == 1:
        acc = tile_matmul(a_desc, b_desc, acc, off_m, off_n, K, B_KN, BLOCK_K, BLOCK_K)
        sa = tl.load(sa_ptr + rm.to(tl.int64) * sa_row, mask=m_ok, other=0.0)
        sb = tl.load(sb_ptr + rn.to(tl.int64) * sb_row, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    else:
        acc = tile_matmul(a_desc, b_desc, acc, off_m, off_n, K, B_KN, BLOCK_K)
    return acc


@dl.jit(do_not_specialize=("M", "N", "K", "stride_cm", "stride_cn", "has_bias"))
def skinny_gemm_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm, stride_cn, has_bias,
                       B_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """``C[M, N] = A[M, K] @ B[K, N] (+ bias)`` as ``C^T = B^T A^T``, one program per
    ``[BLOCK_N, BLOCK_M]`` tile of ``C^T`` (N-major: the programs of one M block stream B side
    by side). The K order is ``tile_matmul``'s: ``BLOCK_K`` steps from 0, each one ``tl.dot``
    into an fp32 accumulator; the bias (fp32) after the loop; masked pointer stores (M is small:
    the store is a few rows of C)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    off_n = (pid % tiles_n) * BLOCK_N
    off_m = (pid // tiles_n) * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, ki * BLOCK_K])
        if B_KN:
            bt = b_desc.load([ki * BLOCK_K, off_n]).T
        else:
            bt = b_desc.load([off_n, ki * BLOCK_K])
        acc = tl.dot(bt, a.T, acc)
    rn = off_n + tl.arange(0, BLOCK_N)
    rm = off_m + tl.arange(0, BLOCK_M)
    if has_bias != 0:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    c_offs = rm.to(tl.int64)[None, :] * stride_cm + rn[:, None] * stride_cn
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@dl.jit
def _wait_rows(sig_ptr, offsets_ptr, row_lo, row_hi, rank, world_size, epoch, deadline,
               err_claim, err_record, op_id, seen):
    """Wait for every chunk that overlaps gathered rows ``[row_lo, row_hi)`` and check its size,
    skipping chunks in ``seen`` (bit s: this program already saw chunk s land, so its rows stay
    there for the rest of the call; chunks from 63 on have no bit and are waited for every
    time). Returns the new ``seen``; the proxy fence runs only after a wait."""
    new = seen
    waited = 0
    one = tl.full((), 1, tl.int64)
    for s in range(world_size):
        bit = tl.where(s < 63, one << tl.minimum(s, 62).to(tl.int64), 0)
        lo = tl.load(offsets_ptr + s)
        hi = tl.load(offsets_ptr + s + 1)
        if (lo < row_hi) & (hi > row_lo) & ((seen & bit) == 0):
            arrived = dl.wait_at_least(sig_ptr + s, epoch, deadline, err_claim, err_record,
                                       op_id, rank, s, epoch)
            got = tl.load(sig_ptr + 2 * world_size + s, volatile=True)
            if arrived & (got != (hi - lo)):
                dl.record_error(err_claim, err_record, op_id, rank, s, epoch, dl.SIZE_MISMATCH)
            new = new | bit  # (a timed-out chunk too: a lost peer costs one timeout)
            waited += 1
    if waited > 0:
        dl.fence_proxy_async()  # the rows were stored by other SMs (pull mode); TMA reads them next
    return new


@dl.jit
def _store_tile(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn, has_bias,
                C_TMA: tl.constexpr, IN_HALVES: tl.constexpr):
    """Epilogue of one tile: ``+ bias`` (fp32), then the store, through ``c_desc`` (blocks of
    half the full tile's width: a full tile in two halves when ``IN_HALVES``, fewer live
    registers; a half tile at once) or with masked pointer stores (any strides)."""
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    rn = off_n + tl.arange(0, BN)
    if has_bias != 0:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if C_TMA:
        if IN_HALVES:
            c0, c1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            c_desc.store([off_m, off_n], c0.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BN // 2], c1.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    else:
        rm = off_m + tl.arange(0, BM)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        c_offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@dl.jit(do_not_specialize=("M", "N", "K", "stride_cm", "stride_cn", "has_bias", "tail_tiles",
                           "rank", "world_size", "timeout_us", "op_id", "sa_row", "sb_row"))
def persistent_gemm_kernel(a_desc, b_desc, bh_desc, c_desc, c_ptr, bias_ptr, sig_ptr, offsets_ptr,
                   err_claim, err_record, M, N, K, stride_cm, stride_cn, has_bias, tail_tiles,
                   rank, world_size, timeout_us, op_id, sa_ptr, sb_ptr, sa_row, sb_row,
                   B_KN: tl.constexpr, C_TMA: tl.constexpr, WAIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, SPLIT_TAIL: tl.constexpr = False,
                   SCALE: tl.constexpr = 0):
    """Persistent GEMM ``C[M, N] = A[M, K] @ B[K, N] (+ bias)``; with ``WAIT`` A is the gathered
    buffer and each tile first waits for the chunks its rows come from (the call's epoch is the
    pad's word ``3W``, set by the start barrier). The tiles: ``gemm_tiles``; fp8 scales:
    ``tile_product`` (``SCALE``)."""
    epoch = tl.zeros((), tl.int64)
    deadline = tl.zeros((), tl.int64)
    if WAIT:
        epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
        deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    gemm_tiles(a_desc, b_desc, bh_desc, c_desc, c_ptr, bias_ptr, sig_ptr, offsets_ptr, err_claim,
               err_record, M, N, K, stride_cm, stride_cn, has_bias, tail_tiles, rank, world_size,
               epoch, deadline, op_id, sa_ptr, sb_ptr, sa_row, sb_row, B_KN, C_TMA, WAIT,
               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_TAIL, SCALE)


@dl.jit
def gemm_tiles(a_desc, b_desc, bh_desc, c_desc, c_ptr, bias_ptr, sig_ptr, offsets_ptr, err_claim,
               err_record, M, N, K, stride_cm, stride_cn, has_bias, tail_tiles, rank, world_size,
               epoch, deadline, op_id, sa_ptr, sb_ptr, sa_row, sb_row, B_KN: tl.constexpr,
               C_TMA: tl.constexpr, WAIT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               SPLIT_TAIL: tl.constexpr, SCALE: tl.constexpr):
    """The persistent tile loop: ``C[M, N] = A[M, K] @ B[K, N] (+ bias)``, with ``WAIT`` each
    tile first waiting for the gathered chunks its rows come from (flags ``>= epoch``).

    ``B_KN``: ``b_desc`` is over ``B [K, N]``, else over ``B^T [N, K]`` (a Linear weight).
    ``C_TMA``: C is stored through ``c_desc`` (blocks ``[BLOCK_M, BLOCK_N / 2]``), else with
    masked pointer stores (any strides).
    ``SPLIT_TAIL``: the last ``tail_tiles`` tiles (the host passes a partial last wave, at most
    half the grid, and 0 otherwise; the first ``tiles - tail_tiles`` are then a whole number of
    waves) run after the main loop as twice as many ``BLOCK_N / 2`` wide half tiles through
    ``bh_desc`` (B in half-width blocks), so the last wave is spread over up to twice the
    programs and takes about half as long (a half past N is skipped). Without ``SPLIT_TAIL``
    the last ``tail_tiles`` tiles are not run here (0, or those a sliced tail's split launch
    runs: ``_core.SlicedTailGemm``).
    No flattened tile + K loop: ``tl.range(flatten=True)`` measured 0.75-0.83x cuBLAS against
    0.89-0.96x plain (H200). History: benchmarks/NOTES.md, GEMM core.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    main_tiles = tiles_m * tiles_n - tail_tiles  # (without SPLIT_TAIL: 0, or a sliced tail's)
    group_tiles = GROUP_M * tiles_n
    shift = 0
    if WAIT:
        shift = tl.load(offsets_ptr + rank) // BLOCK_M  # own rows first
    seen = tl.zeros((), tl.int64)  # chunks this program has seen land
    for tile in range(pid, main_tiles, nprog):
        pid_m, pid_n = _tile_coords(tile, tiles_m, group_tiles, shift, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if WAIT:
            seen = _wait_rows(sig_ptr, offsets_ptr, off_m, tl.minimum(off_m + BLOCK_M, M), rank,
                              world_size, epoch, deadline, err_claim, err_record, op_id, seen)
        # A zero accumulator (the first MMA need not read it) and the bias added after the K
        # loop: a kernel of the same tiles without the bias seed ran 1.4% faster than one with
        # it (H200, one run; benchmarks/NOTES.md, GEMM core).
        acc = tile_product(a_desc, b_desc, off_m, off_n, M, N, K, sa_ptr, sb_ptr, sa_row,
                           sb_row, B_KN, BLOCK_M, BLOCK_N, BLOCK_K, SCALE)
        _store_tile(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn,
                    has_bias, C_TMA, True)
    if SPLIT_TAIL:
        HALF: tl.constexpr = BLOCK_N // 2
        for sub in range(pid, 2 * tail_tiles, nprog):
            pid_m, pid_n = _tile_coords(main_tiles + sub // 2, tiles_m, group_tiles, shift, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N + (sub % 2) * HALF
            if off_n < N:
                if WAIT:
                    seen = _wait_rows(sig_ptr, offsets_ptr, off_m, tl.minimum(off_m + BLOCK_M, M),
                                      rank, world_size, epoch, deadline, err_claim, err_record,
                                      op_id, seen)
                acc = tile_product(a_desc, bh_desc, off_m, off_n, M, N, K, sa_ptr, sb_ptr,
                                   sa_row, sb_row, B_KN, BLOCK_M, HALF, BLOCK_K, SCALE)
                _store_tile(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm,
                            stride_cn, has_bias, C_TMA, False)


@dl.jit(do_not_specialize=("M", "N", "K", "tile0", "tiles", "slices", "slice_steps"))
def splitk_gemm_kernel(a_desc, b_desc, p_desc, p_ptr, M, N, K, tile0, tiles, slices, slice_steps,
                       B_KN: tl.constexpr, P_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Partial products of ``C[M, N] = A[M, K] @ B[K, N]`` over ``slices`` slices of K, each
    ``slice_steps`` ``BLOCK_K`` steps (the last one shorter; TMA reads past K as zeros), for the
    ``tiles`` tiles from ``tile0`` on in ``_tile_coords``' grouped order (all of C, or the
    partial last wave that ``persistent_gemm_kernel`` left: ``SlicedTailGemm``).

    Persistent over the ``tiles x slices`` units, slice-major (unit ``u``: slice
    ``u // tiles``, tile ``tile0 + u % tiles``, so programs that run together read the same K
    range of neighbouring tiles). Unit ``(s, t)`` stores its fp32 tile, whole, packed at rows
    ``(s * tiles + t) * BLOCK_M`` of the workspace ``P [slices * tiles * BLOCK_M, BLOCK_N]``,
    through ``p_desc`` (``P_TMA``, blocks ``[BLOCK_M, BLOCK_N / 2]``) or pointer stores.
    ``B_KN`` as in ``gemm_tiles``.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    group_tiles = GROUP_M * tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    rows = slices * tiles * BLOCK_M
    for unit in range(pid, tiles * slices, nprog):
        s = unit // tiles
        t = unit % tiles
        pid_m, pid_n = _tile_coords(tile0 + t, tiles_m, group_tiles, 0, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        lo = s * slice_steps
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(lo, tl.minimum(lo + slice_steps, steps)):
            a = a_desc.load([off_m, ki * BLOCK_K])
            if B_KN:
                b = b_desc.load([ki * BLOCK_K, off_n])
            else:
                b = b_desc.load([off_n, ki * BLOCK_K]).T
            acc = tl.dot(a, b, acc)
        _store_tile(acc, p_desc, p_ptr, p_ptr, (s * tiles + t) * BLOCK_M, 0, rows, BLOCK_N,
                    BLOCK_N, 1, 0, P_TMA, True)


@dl.jit(do_not_specialize=("M", "N", "tile0", "tiles", "slices", "has_bias"))
def splitk_reduce_kernel(p_ptr, c_ptr, bias_ptr, M, N, tile0, tiles, slices, stride_cm,
                         stride_cn, has_bias, MAX_SLICES: tl.constexpr, TILE_M: tl.constexpr,
                         TILE_N: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """``C = (((P_0 + P_1) + P_2) + ...) (+ bias)`` over ``splitk_gemm_kernel``'s ``tiles``
    tiles from ``tile0`` on, rounded once to C's dtype: the ``slices`` fp32 partials (packed:
    tile ``t`` of slice ``s`` at rows ``(s * tiles + t) * TILE_M`` of ``P``, ``TILE_N``
    columns) summed in slice order (the same bits every run), the bias in fp32 after them as
    ``_store_tile`` adds it. One ``[BLOCK_R, BLOCK_C]`` block of a tile per program.

    Every slice's load is issued at once (``MAX_SLICES`` unrolled, those past ``slices``
    masked off), and P holds whole tiles at the constant row pitch ``TILE_N``, so the loads
    need no mask on M and N and are 16 bytes wide: not latency-bound (measured:
    benchmarks/NOTES.md, GEMM core).
    """
    pid = tl.program_id(0)
    PER_ROW: tl.constexpr = TILE_N // BLOCK_C
    PER_TILE: tl.constexpr = (TILE_M // BLOCK_R) * PER_ROW
    t = pid // PER_TILE
    blk = pid % PER_TILE
    pid_m, pid_n = _tile_coords(tile0 + t, tl.cdiv(M, TILE_M), GROUP_M * tl.cdiv(N, TILE_N), 0,
                                GROUP_M)
    r = (blk // PER_ROW) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (blk % PER_ROW) * BLOCK_C + tl.arange(0, BLOCK_C)
    rm = pid_m * TILE_M + r
    rn = pid_n * TILE_N + c
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = p_ptr + (t.to(tl.int64) * TILE_M + r)[:, None] * TILE_N + c[None, :]
    slice_stride = tiles.to(tl.int64) * (TILE_M * TILE_N)
    acc = tl.load(ptrs)  # (whole tiles in P: no mask on M and N, so 16-byte loads)
    for s in tl.static_range(1, MAX_SLICES):
        ptrs += slice_stride
        part = tl.load(ptrs, mask=s < slices, other=0.0)
        acc = tl.where(s < slices, acc + part, acc)  # (x + 0.0 would turn -0.0 into +0.0)
    if has_bias != 0:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@dl.jit(do_not_specialize=("M", "N", "K", "stride_cm", "stride_cn", "has_bias"))
def strip_gemm_kernel(a_desc, b_desc, bs_desc, c_desc, cs_desc, c_ptr, bias_ptr, M, N, K,
                      stride_cm, stride_cn, has_bias, B_KN: tl.constexpr, C_TMA: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIP: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``C[M, N] = A[M, K] @ B[K, N] (+ bias)`` in tiles ``BLOCK_N + STRIP`` columns wide (not a
    power of two: e.g. 272 for N = 544), persistent as ``gemm_tiles``: each K step loads one A
    block and two B blocks (``b_desc`` ``BLOCK_N`` wide, ``bs_desc`` ``STRIP`` wide, the next
    columns) into two accumulators. Why: a width that divides N (or fills the last wave) where
    the power-of-two tiles leave a mostly empty last column of tiles or a near-empty wave.
    The K order per element is ``tile_matmul``'s (``BLOCK_K`` steps from 0). C through
    ``c_desc`` (``[BLOCK_M, BLOCK_N / 2]`` blocks) and ``cs_desc`` (``[BLOCK_M, STRIP]``), or
    masked pointer stores."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N + STRIP)
    group_tiles = GROUP_M * tiles_n
    for tile in range(pid, tiles_m * tiles_n, nprog):
        pid_m, pid_n = _tile_coords(tile, tiles_m, group_tiles, 0, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * (BLOCK_N + STRIP)
        off_s = off_n + BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_s = tl.zeros((BLOCK_M, STRIP), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([off_m, ki * BLOCK_K])
            if B_KN:
                b = b_desc.load([ki * BLOCK_K, off_n])
                bs = bs_desc.load([ki * BLOCK_K, off_s])
            else:
                b = b_desc.load([off_n, ki * BLOCK_K]).T
                bs = bs_desc.load([off_s, ki * BLOCK_K]).T
            acc = tl.dot(a, b, acc)
            acc_s = tl.dot(a, bs, acc_s)
        _store_tile(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, stride_cn,
                    has_bias, C_TMA, True)
        if off_s < N:
            _store_tile(acc_s, cs_desc, c_ptr, bias_ptr, off_m, off_s, M, N, stride_cm,
                        stride_cn, has_bias, C_TMA, False)


@dl.jit(do_not_specialize=("rows", "cols", "src_pitch", "dst_pitch"))
def pad_rows_kernel(src_ptr, dst_ptr, rows, cols, src_pitch, dst_pitch, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, VEC: tl.constexpr):
    """``dst[r, c] = src[r, c]`` for ``r < rows``, ``c < cols``: an operand's rows into a buffer
    whose rows start on 128-byte lines (``_core_configs.pad_operands``), one ``[BLOCK_R,
    BLOCK_C]`` block a program. ``cols`` and both pitches are multiples of ``VEC`` elements (16
    bytes: the operand backs a TMA descriptor), so every load and store is a 16-byte vector."""
    cols = cols // VEC * VEC  # (states the divisibility: ``tl.multiple_of`` on these did not
    src_pitch = src_pitch // VEC * VEC  # vectorize, sm_90a PTX)
    dst_pitch = dst_pitch // VEC * VEC
    _copy_block(src_ptr, dst_ptr, rows, cols, src_pitch, dst_pitch, BLOCK_R, BLOCK_C)


@dl.jit
def _copy_block(src_ptr, dst_ptr, rows, cols, src_pitch, dst_pitch, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """``dst[r, c] = src[r, c]`` over this program's ``[BLOCK_R, BLOCK_C]`` block (grid axes 0
    and 1) of a ``rows x cols`` copy; returns the block's rows (int64)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(src_ptr + r[:, None] * src_pitch + c[None, :], mask=mask)
    tl.store(dst_ptr + r[:, None] * dst_pitch + c[None, :], x, mask=mask)
    return r


@dl.jit(do_not_specialize=("rows", "k", "a_pitch", "s_row", "s_col", "pitch", "scale_word",
                           "scales"))
def pack_rows_kernel(a_ptr, s_ptr, dst_ptr, dst_words, rows, k, a_pitch, s_row, s_col, pitch,
                     scale_word, scales, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_S: tl.constexpr, VEC: tl.constexpr):
    """``ag_gemm_scaled``'s rows as the gather moves them (``scaled.packed_row``): byte ``c <
    k`` of row ``r`` is ``a[r, c]`` (fp8 bytes), word ``scale_word + j`` its scale ``s[r, j]``
    (``j < scales``; strides ``s_row``, ``s_col``: 0 broadcasts a tensor-wise scale). One
    ``[BLOCK_R, BLOCK_C]`` block of bytes a program; column block 0 writes its rows' scales,
    ``BLOCK_S`` at a time (so K picks no compiled form). ``dst_ptr`` (bytes) and ``dst_words``
    (fp32) are the same buffer, rows ``pitch`` bytes. ``VEC``: 16 where ``_pad.pack_vec``
    finds ``a``'s rows whole, aligned 16-byte vectors (one vector a load), else 1."""
    k = k // VEC * VEC  # (states the divisibility, as ``pad_rows_kernel``)
    a_pitch = a_pitch // VEC * VEC
    pitch = pitch // VEC * VEC
    r = _copy_block(a_ptr, dst_ptr, rows, k, a_pitch, pitch, BLOCK_R, BLOCK_C)
    if tl.program_id(1) == 0:
        for j0 in range(0, scales, BLOCK_S):
            j = (j0 + tl.arange(0, BLOCK_S)).to(tl.int64)
            s_mask = (r[:, None] < rows) & (j[None, :] < scales)
            s = tl.load(s_ptr + r[:, None] * s_row + j[None, :] * s_col, mask=s_mask)
            tl.store(dst_words + r[:, None] * (pitch // 4) + scale_word + j[None, :], s,
                     mask=s_mask)
