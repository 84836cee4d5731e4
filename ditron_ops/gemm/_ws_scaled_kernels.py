"""The warp-specialized sm_90 core's fp8 (e4m3) form: ``C = (A * sa) @ (B * sb) (+ bias)``.

A loader partition fills an mbarrier ring with TMA boxes of A ``[BLOCK_M, 128]`` and of the
weight ``[128, 128]``; two 4-warp consumer partitions run every K step (128 of K, one scale
block) as an fp8 wgmma into a fresh product tile and promote it into the fp32 sum in
registers::

    for each K step s:  part = wgmma(A_s, B_s)  (async, from zero); the step's scales loaded
                        wait for it (ping-pong: release ring slot s)
                        sum += part                              (SCALE 1: row / tensor-wise)
                        sum += part * sa[m, s] * sb[s, n // 128] (SCALE 2: blocks)
                        (split: release ring slot s, after both halves)
    epilogue:           SCALE 1: sum * sa[m] * sb[n]; + bias; round; TMA store

(A split config's ``PROMOTE`` 2, ``SCALE`` 1: steps s and s + 1 chained into one product,
then one wait and one add.)

Why promote: the fp8 wgmma's own accumulation drifts past bf16 rounding at K of a few
thousand (``_core_kernels.tile_product``, the portable core's same rule; ``torch._scaled_mm``
without fast accumulation promotes too), and block scales change every 128 of K. The product
is read only after its wgmma is done (no wgmma in flight while registers of one are read:
ptxas otherwise serializes every wgmma of the kernel, C7514, which a version keeping the
next step's product in flight during the add drew); the other consumer's wgmma keeps the
tensor cores busy meanwhile.

Schedules (``SPLIT``): split, both consumers on every tile of 128 rows, each its 64 rows,
sharing each ring slot's boxes and releasing it on its own (the ``empty`` barriers count 2),
in 128-column halves (``HALVES`` 1 or 2: one product tile at a time beside the halves' sums);
or ping-pong, the consumers on alternate 64x128 tiles over a ring holding a pair of units' K
steps alternately (``_pair_loader``: both mainloops at once). An 8-warp cooperative consumer
synchronizing its two warpgroups every step ran slower on every scale kind (benchmarks/NOTES.md,
fp8: the WS core). Data parallel, persistent, grouped tile order (``WAIT``: this rank's own
rows first). B is always the
K-major weight (fp8 wgmma reads both operands K-major: ``scaled.k_major``).
"""
from __future__ import annotations

from ..language import gluon_signals as gs
from ._ws_kernels import (HAVE_GLUON, _jit, _loader_regs, _plus_bias, _push_part, _sched,
                          _split_cols, _tile_mn, _ws_loader, ring_barriers)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
else:
    gluon = gl = None

SCALED_REGS = 240
"""Registers of the worker consumer partition (sums and one product of 64-register fp32 tiles,
two or three, plus addressing); the default consumer gets what the loader leaves (240, or 224
beside a waiting loader's 40)."""
_K_SCALED_REGS = gl.constexpr(SCALED_REGS) if HAVE_GLUON else SCALED_REGS
_NO = gl.constexpr(False) if HAVE_GLUON else False
_DP = gl.constexpr(0) if HAVE_GLUON else 0
"""Constants for the bf16 loader's constexpr parameters (B K-major, data parallel; no waits in
the ping-pong)."""


@_jit
def _step_scale(sa_ptr, sb_ptr, sa_row, sb_row, rows, off_n, kk, SCALE: gl.constexpr):
    """``SCALE`` 2: K step ``kk``'s scale of each row of the tile, ``sa[rows, kk] * sb[kk,
    off_n // 128]`` (the tile is inside one 128-column block: ``BLOCK_N`` divides 128); loaded
    before the step's product is waited for, through L1 (a row's scales of 32 K steps share a
    128-byte line; in the ag_gemm consumer's gathered rows, whole lines of one row, first read
    after the row's chunk landed: ``scaled.packed_row``). Else a placeholder (nothing
    loaded)."""
    if SCALE == 2:
        sb = gl.load(sb_ptr + kk * sb_row + off_n // 128)
        scale = gl.load(sa_ptr + rows * sa_row + kk) * sb
    else:
        scale = sa_row
    return scale


@_jit
def _promote(acc, part, scale, SCALE: gl.constexpr):
    """``acc + part`` (``SCALE`` 1), or ``acc + part * scale[m]`` (``SCALE`` 2)."""
    if SCALE == 2:
        acc = acc + part * gl.expand_dims(scale, 1)
    else:
        acc = acc + part
    return acc


@_jit
def _scaled_part(part, scale, SCALE: gl.constexpr):
    """``part * scale[m]`` (``SCALE`` 2), or ``part``: the split consumer's promotion is this
    product rounded, then added (``_promote``'s form, one fused multiply-add, is the ping-pong's
    and the portable core's; the split's form is the one its GPU tests ran)."""
    if SCALE == 2:
        part = part * gl.expand_dims(scale, 1)
    return part


@_jit
def _pair_pos(i, kk, units, k_steps):
    """Ring position of unit ``i``'s K step ``kk`` in ``_pair_loader``'s order: units in pairs,
    the pair's K steps alternating (a last unit without a partner alone)."""
    pair = i // 2
    both = pair * 2 + 1 < units
    return pair * 2 * k_steps + gl.where(both, 2 * kk + i % 2, kk)


@_jit
def _pair_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """The ping-pong's loader: this program's units (data parallel, grouped order)
    in pairs, each K step of the pair's first unit then the same step of its second, so both
    consumers' mainloops run at once (``_pair_pos``)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m, tiles_n, k_steps, units, _, _, _, _, _, _, _ = _sched(
        M, N, K, 0, 1, _DP, BLOCK_M, BLOCK_N, BLOCK_K)  # (data parallel: the bf16 kernel's)
    p = gl.program_id(0)
    G = gl.num_programs(0)
    it = 0
    for pair in range(gl.cdiv(units, 2)):
        i0 = 2 * pair
        both = i0 + 1 < units
        m0, n0 = _tile_mn(p + i0 * G, tiles_m, tiles_n, 0, GROUP_M)
        # (a partner-less last unit: clamped to a real tile, never loaded)
        m1, n1 = _tile_mn(gl.minimum(p + (i0 + 1) * G, tiles_m * tiles_n - 1), tiles_m, tiles_n,
                          0, GROUP_M)
        for kk in range(k_steps):
            for u in gl.static_range(2):
                if (u == 0) | both:
                    slot = it % STAGES
                    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                    bar = ready.index(slot)
                    mbarrier.expect(bar, nbytes)
                    if u == 0:
                        off_m = m0 * BLOCK_M
                        off_n = n0 * BLOCK_N
                    else:
                        off_m = m1 * BLOCK_M
                        off_n = n1 * BLOCK_N
                    tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar,
                                                    a_bufs.index(slot))
                    tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar,
                                                    b_bufs.index(slot))
                    it += 1


@_jit
def _pp_consumer(a_bufs, b_bufs, ready, empty, order, c_bufs, c_desc, bias_ptr, sa_ptr, sb_ptr,
                 sa_row, sb_row, M, N, K, HAS_BIAS: gl.constexpr, SCALE: gl.constexpr,
                 GROUP_M: gl.constexpr, SLOT: gl.constexpr):
    """Ping-pong consumer ``SLOT`` of 2 (4 warps): the program's tiles ``SLOT, SLOT + 2, ...``;
    the ring holds both consumers' K steps alternately (``_pair_loader``), so the mainloops
    run at once."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    # each slot's previous fill within a full pair is the same consumer's
    gl.static_assert(STAGES % 2 == 0)
    gl.static_assert(128 % BLOCK_N == 0, "a tile inside one 128-column scale block")
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    tiles_m, tiles_n, k_steps, units, _, _, _, _, _, _, _ = _sched(
        M, N, K, 0, 1, _DP, BLOCK_M, BLOCK_N, BLOCK_K)  # (data parallel: the bf16 kernel's)
    p = gl.program_id(0)
    G = gl.num_programs(0)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    for i in range(SLOT, units, 2):
        # A partner-less last unit fills slots consumer 1's last unit filled a lap before; a
        # parity wait cannot tell those laps apart, so it starts once consumer 1 has consumed
        # them.
        mbarrier.wait(order.index(0), 0, pred=(i == units - 1) & (i % 2 == 0) & (i > 0))
        pid_m, pid_n = _tile_mn(p + i * G, tiles_m, tiles_n, 0, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = gl.minimum(off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)),
                          M - 1).to(gl.int64)
        acc = zero
        for kk in range(k_steps):
            it = _pair_pos(i, kk, units, k_steps)
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)),
                                 zero, use_acc=False, is_async=True)
            scale = _step_scale(sa_ptr, sb_ptr, sa_row, sb_row, rows, off_n, kk, SCALE)
            # Read only once no wgmma is in flight: ptxas serializes every wgmma of a kernel
            # that reads an accumulator while another runs (C7514).
            part = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty.index(slot))
            acc = _promote(acc, part, scale, SCALE)
        mbarrier.arrive(order.index(0), pred=(i == units - 2) & (units % 2 == 1))
        _scaled_epilogue(acc, rows, off_m, off_n, c_desc, c_bufs, bias_ptr, sa_ptr, sb_ptr,
                         sa_row, sb_row, N, HAS_BIAS, SCALE)
    tma.store_wait(0)


@_jit
def _stage_part(part, i: gl.constexpr, c_desc, c_bufs, bias_ptr, off_m, off_n, N,
                HAS_BIAS: gl.constexpr):
    """Epilogue of column block ``i``: + bias, round, stage in tile ``i % BUFS`` of ``c_bufs``,
    TMA store (left in flight). Before staging, every store but the last ``BUFS - 1`` has read
    its tile: with two tiles the previous part's store drains while this one is staged (parts
    alternate tiles: every epilogue stages an even number of parts)."""
    EPI_N: gl.constexpr = c_desc.block_type.shape[1]
    BUFS: gl.constexpr = c_bufs.shape[0]
    out = _plus_bias(part, bias_ptr, off_n + i * EPI_N, N, HAS_BIAS).to(c_desc.dtype)
    tma.store_wait(BUFS - 1)
    buf = c_bufs.index(i % BUFS)
    buf.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n + i * EPI_N], buf)


@_jit
def _outer_scales(acc, rows, off_n, sa_ptr, sb_ptr, sa_row, sb_row, N, SCALE: gl.constexpr):
    """``SCALE`` 1: ``acc * sa[rows] * sb[cols]`` (tensor / row scales, applied once to the
    sum), else ``acc``."""
    if SCALE == 1:
        cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
        sa = gl.load(sa_ptr + rows * sa_row)
        sb = gl.load(sb_ptr + gl.minimum(cols, N - 1) * sb_row)
        acc = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
    return acc


@_jit
def _scaled_epilogue(acc, rows, off_m, off_n, c_desc, c_bufs, bias_ptr, sa_ptr, sb_ptr, sa_row,
                     sb_row, N, HAS_BIAS: gl.constexpr, SCALE: gl.constexpr):
    """A consumer's sum of columns ``[off_n, off_n + acc.shape[1])``: ``SCALE`` 1's row and
    column scales, + bias, round, TMA stores of ``EPI_N``-column parts (``_stage_part``)."""
    BN: gl.constexpr = acc.shape[1]
    EPI_N: gl.constexpr = c_desc.block_type.shape[1]
    gl.static_assert((BN // EPI_N) % c_bufs.shape[0] == 0, "parts alternate staging tiles")
    acc = _outer_scales(acc, rows, off_n, sa_ptr, sb_ptr, sa_row, sb_row, N, SCALE)
    parts = _split_cols(acc, BN // EPI_N)
    for c in gl.static_range(BN // EPI_N):
        _stage_part(parts[c], c, c_desc, c_bufs, bias_ptr, off_m, off_n, N, HAS_BIAS)


@_jit
def _tile_out(acc, rows, off_m, off_n, c_desc, c_bufs, bias_ptr, sa_ptr, sb_ptr, sa_row, sb_row,
              M, N, slots_ptr, peers_ptr, offsets_ptr, slot_rows, rank, world_size,
              HAS_BIAS: gl.constexpr, SCALE: gl.constexpr, PUSH: gl.constexpr):
    """A split consumer's sum out: ``PUSH`` 0, C through ``_scaled_epilogue``; else the gemm_rs
    / gemm_ar producer's fp32 partial (scales, + bias) into the owners' slots (``PUSH`` 1) or
    every rank's (2): the bf16 core's ``_push_part`` (``ws_gemm_kernel``'s ``PUSH`` arguments).
    A sum is pushed from the registers in two 64-column parts (whole, the 256-wide tile's bias
    form spills), no staging (8-byte stores of a thread's column pair)."""
    if PUSH == 0:
        _scaled_epilogue(acc, rows, off_m, off_n, c_desc, c_bufs, bias_ptr, sa_ptr, sb_ptr,
                         sa_row, sb_row, N, HAS_BIAS, SCALE)
    else:
        acc = _outer_scales(acc, rows, off_n, sa_ptr, sb_ptr, sa_row, sb_row, N, SCALE)
        parts = _split_cols(acc, 2)
        for c in gl.static_range(2):
            col = off_n + c * (acc.shape[1] // 2)
            _push_part(_plus_bias(parts[c], bias_ptr, col, N, HAS_BIAS), slots_ptr, peers_ptr,
                       offsets_ptr, off_m, col, M, N, slot_rows, rank, world_size, PUSH)


@_jit
def _chain(a_bufs, b_bufs, ready, it, SLOT: gl.constexpr, part, TWO: gl.constexpr,
           BOX: gl.constexpr):
    """Issue the split consumer's wgmma chain into ``part`` (from zero; async, not waited):
    ring slot ``it``'s K step, and with ``TWO`` slot ``it + 1``'s after it into the same
    product (no register read between the two). ``BOX``: first wait for the slots' boxes (the
    tile's first half; the second half's chain finds them landed)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    HALF_M: gl.constexpr = a_bufs.shape[1] // 2
    slot = it % STAGES
    if BOX:
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    part = warpgroup_mma(a_bufs.index(slot).slice(SLOT * HALF_M, HALF_M),
                         b_bufs.index(slot).permute((1, 0)), part, use_acc=False, is_async=True)
    if TWO:
        slot2 = (it + 1) % STAGES
        if BOX:
            mbarrier.wait(ready.index(slot2), ((it + 1) // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(slot2).slice(SLOT * HALF_M, HALF_M),
                             b_bufs.index(slot2).permute((1, 0)), part, use_acc=True,
                             is_async=True)
    return part


@_jit
def _split_consumer(a_bufs, b_bufs, b2_bufs, ready, empty, c_bufs, c_desc, bias_ptr, sa_ptr,
                    sb_ptr, sa_row, sb_row, M, N, K, shift, slots_ptr, peers_ptr, offsets_ptr,
                    slot_rows, rank, world_size, HAS_BIAS: gl.constexpr, SCALE: gl.constexpr,
                    GROUP_M: gl.constexpr, SLOT: gl.constexpr, HALVES: gl.constexpr,
                    PROMOTE: gl.constexpr, PUSH: gl.constexpr):
    """Split consumer ``SLOT`` of 2 (4 warps): rows ``[64 SLOT, 64 SLOT + 64)`` of every tile of
    the program, the tile ``HALVES`` x 128 columns wide (B's second 128 columns in ``b2_bufs``;
    two halves on ``SCALE`` 1 only: a third 64-register tile spilled on block scales); each K
    step one wgmma per 128-column half into the one product tile, promoted into that half's
    sum (``PROMOTE`` 2, ``SCALE`` 1 only: two K steps' wgmmas chained into one product, then
    one promotion; ``K`` is then a multiple of 256, the kernel's rounding: the boxes past the
    operands' K land as zeros). The two consumers share each slot's A box (each its
    64 rows) and B boxes, and each releases the slot on its own (``empty`` counts 2): no
    barrier between them, so one's promotion runs under the other's wgmma. Tile rows rotated
    by ``shift`` as the loader visits them (the ag_gemm consumer's, the scattering producer's;
    else 0). Sums out through ``_tile_out`` (``PUSH``: into the reducing ops' slots)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    HALF_M: gl.constexpr = a_bufs.shape[1] // 2
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[1]
    gl.static_assert(BN == 128, "each half one 128-column scale block")
    gl.static_assert((HALVES == 1) | (SCALE == 1), "block scales: one 128-column half")
    gl.static_assert((PROMOTE == 1) | (SCALE == 1), "block scales change every K step")
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    tiles_m, tiles_n, k_steps, units, _, _, _, _, _, _, _ = _sched(
        M, N, K, 0, 1, _DP, 2 * HALF_M, BN * HALVES, BLOCK_K)
    p = gl.program_id(0)
    G = gl.num_programs(0)
    # (use_acc=False: each step's product reuses the last one's registers, no zero tile)
    part = gl.zeros([HALF_M, BN], gl.float32, layout)
    it = 0
    for i in range(units):
        pid_m, pid_n = _tile_mn(p + i * G, tiles_m, tiles_n, shift, GROUP_M)
        off_m = pid_m * 2 * HALF_M + SLOT * HALF_M
        off_n = pid_n * BN * HALVES
        rows = gl.minimum(off_m + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout)),
                          M - 1).to(gl.int64)
        acc0 = gl.zeros([HALF_M, BN], gl.float32, layout)
        acc1 = gl.zeros([HALF_M, BN], gl.float32, layout)
        for kk in range(k_steps // PROMOTE):
            part = _chain(a_bufs, b_bufs, ready, it, SLOT, part, PROMOTE == 2, True)
            # (the step's scales after its boxes landed: waiting, after the loader's wait)
            scale = _step_scale(sa_ptr, sb_ptr, sa_row, sb_row, rows, off_n, kk, SCALE)
            part = _scaled_part(warpgroup_mma_wait(0, deps=(part, )), scale, SCALE)
            acc0 += part
            if HALVES == 2:
                part = _chain(a_bufs, b2_bufs, ready, it, SLOT, part, PROMOTE == 2, False)
                part = warpgroup_mma_wait(0, deps=(part, ))
                acc1 += part
            for j in gl.static_range(PROMOTE):
                mbarrier.arrive(empty.index((it + j) % STAGES))
            it += PROMOTE
        _tile_out(acc0, rows, off_m, off_n, c_desc, c_bufs, bias_ptr, sa_ptr, sb_ptr, sa_row,
                  sb_row, M, N, slots_ptr, peers_ptr, offsets_ptr, slot_rows, rank, world_size,
                  HAS_BIAS, SCALE, PUSH)
        if HALVES == 2:
            _tile_out(acc1, rows, off_m, off_n + BN, c_desc, c_bufs, bias_ptr, sa_ptr, sb_ptr,
                      sa_row, sb_row, M, N, slots_ptr, peers_ptr, offsets_ptr, slot_rows, rank,
                      world_size, HAS_BIAS, SCALE, PUSH)
    if PUSH == 0:
        tma.store_wait(0)


@_jit
def _split_worker(a_bufs, b_bufs, b2_bufs, ready, empty, c_bufs, c_desc, bias_ptr, sa_ptr,
                  sb_ptr, sa_row, sb_row, M, N, K, shift, slots_ptr, peers_ptr, offsets_ptr,
                  slot_rows, rank, world_size, HAS_BIAS: gl.constexpr, SCALE: gl.constexpr,
                  GROUP_M: gl.constexpr, HALVES: gl.constexpr, PROMOTE: gl.constexpr,
                  PUSH: gl.constexpr):
    """The split schedule's second consumer (a 4-warp worker partition, slot 1)."""
    _split_consumer(a_bufs, b_bufs, b2_bufs, ready, empty, c_bufs, c_desc, bias_ptr, sa_ptr,
                    sb_ptr, sa_row, sb_row, M, N, K, shift, slots_ptr, peers_ptr, offsets_ptr,
                    slot_rows, rank, world_size, HAS_BIAS, SCALE, GROUP_M, 1, HALVES, PROMOTE,
                    PUSH)


@_jit
def _split_loader(a_desc, b_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, shift,
                  sig_ptr, offsets_ptr, err_claim, err_record, rank, world_size, epoch, deadline,
                  op_id, GROUP_M: gl.constexpr, HALVES: gl.constexpr, WAIT: gl.constexpr):
    """The split schedule's loader: the bf16 kernel's (``WAIT``: its wait for each unit's
    gathered chunks), B's second half (``HALVES`` 2) a second box of the same descriptor beside
    the first."""
    _ws_loader(a_desc, b_desc, b_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, 0, 1,
               shift, sig_ptr, offsets_ptr, err_claim, err_record, rank, world_size, epoch,
               deadline, op_id, _NO, GROUP_M, _DP, (HALVES - 1) * 128, WAIT)


@_jit
def _pp_worker(a_bufs, b_bufs, ready, empty, order, c_bufs, c_desc, bias_ptr, sa_ptr, sb_ptr,
               sa_row, sb_row, M, N, K, HAS_BIAS: gl.constexpr, SCALE: gl.constexpr,
               GROUP_M: gl.constexpr):
    """The ping-pong's second consumer (a 4-warp worker partition, slot 1)."""
    _pp_consumer(a_bufs, b_bufs, ready, empty, order, c_bufs, c_desc, bias_ptr, sa_ptr, sb_ptr,
                 sa_row, sb_row, M, N, K, HAS_BIAS, SCALE, GROUP_M, 1)


def _jit_dims(fn):
    return (gluon.jit(fn, do_not_specialize=["M", "N", "K", "sa_row", "sb_row", "rank",
                                             "world_size", "timeout_us", "op_id", "slot_rows"])
            if HAVE_GLUON else fn)


@_jit_dims
def ws_scaled_kernel(a_desc, b_desc, c_desc, bias_ptr, sa_ptr, sb_ptr, sa_row, sb_row, M, N, K,
                     sig_ptr, offsets_ptr, err_claim, err_record, rank, world_size, timeout_us,
                     op_id, slots_ptr, peers_ptr, slot_rows, SCALE: gl.constexpr,
                     HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                     SPLIT: gl.constexpr, HALVES: gl.constexpr, EPI_BUFS: gl.constexpr,
                     PROMOTE: gl.constexpr, WAIT: gl.constexpr, PUSH: gl.constexpr,
                     num_warps: gl.constexpr):
    """fp8 GEMM with scales (module docstring). Grid: ``(programs, )``.

    ``a_desc`` fp8 ``[M, K]`` boxes ``[BLOCK_M, 128]`` (``SPLIT``: 128 rows, else 64);
    ``b_desc`` the fp8 weight ``[N, K]`` boxes ``[128, 128]`` (``HALVES`` of them per tile and
    K step); ``c_desc`` ``[M, N]`` boxes ``[64, EPI_N]``, staged in ``EPI_BUFS`` tiles per
    consumer; ``PROMOTE`` (split, ``SCALE`` 1): K steps per promotion; ``sa_ptr`` fp32 A
    scales (``SCALE`` 1: one per row, ``sa_row`` floats apart, 0 for one tensor-wise scale; 2: ``[M, ceil(K /
    128)]`` rows ``sa_row`` apart); ``sb_ptr`` fp32 B scales (1: one per column ``sb_row``
    apart, or 0; 2: ``[ceil(K / 128), ceil(N / 128)]`` rows ``sb_row`` apart); ``bias_ptr``
    ``[N]`` (read with ``HAS_BIAS`` only).
    ``WAIT`` (split only): the ag_gemm consumer over the gathered fp8 rows ``a_desc``, their
    scales in the rows (``sa_ptr``): the loader waits for each unit's chunks as the bf16
    kernel's does (``ws_gemm_kernel``'s wait arguments), tiles from this rank's own rows first
    (else the wait arguments are unused).
    ``PUSH`` (1 scatter, 2 broadcast; split only): the gemm_rs / gemm_ar producer, as
    ``ws_gemm_kernel``'s ``PUSH``: fp32 sums (scaled, + bias) into slot ``rank`` of the
    ``[W, slot_rows, N]`` slots (``slots_ptr`` this rank's, ``peers_ptr`` every rank's base,
    ``offsets_ptr`` the ``W + 1`` first rows) of the owners of their rows or of every rank;
    no C (``c_desc`` unused, no staging tiles), rows after this rank's first visited first.
    Else the push arguments are unused."""
    gl.static_assert(SPLIT | ((not WAIT) & (PUSH == 0)), "a waiting or pushing kernel is split")
    gl.static_assert((not WAIT) | (PUSH == 0), "wait or push, not both")
    if WAIT:
        shift = gl.load(offsets_ptr + rank) // a_desc.block_type.shape[0]
        epoch = gl.load(sig_ptr + 3 * world_size, volatile=True).to(gl.int64)
        deadline = gs.now_ns() + timeout_us.to(gl.int64) * 1000
    elif PUSH == 1:  # the peers' rows first: their partials leave earliest
        shift = gl.load(offsets_ptr + rank + 1) // a_desc.block_type.shape[0]
        epoch = 0
        deadline = 0
    else:  # (constants: no waiting code in the plain kernel)
        shift = 0
        epoch = 0
        deadline = 0
    if PROMOTE == 2:  # an even number of K steps: a last, odd one pairs with a zero box
        K = (K + 255) // 256 * 256
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                       b_desc.layout)
    ready, empty, order = ring_barriers(STAGES, 2 if SPLIT else 1)
    if PUSH == 0:  # each consumer's C staging tiles (EPI_BUFS: ScaledConfig.epi_bufs)
        c_bufs0 = gl.allocate_shared_memory(c_desc.dtype, [EPI_BUFS] + c_desc.block_type.shape,
                                            c_desc.layout)
        c_bufs1 = gl.allocate_shared_memory(c_desc.dtype, [EPI_BUFS] + c_desc.block_type.shape,
                                            c_desc.layout)
    else:  # (pushed from the registers: nothing staged, the ring gets the memory)
        c_bufs0 = a_bufs
        c_bufs1 = a_bufs
    if SPLIT:
        if HALVES == 2:
            b2_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape,
                                                b_desc.layout)
        else:
            b2_bufs = b_bufs
        gl.warp_specialize([
            (_split_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, c_bufs0, c_desc, bias_ptr,
                               sa_ptr, sb_ptr, sa_row, sb_row, M, N, K, shift, slots_ptr,
                               peers_ptr, offsets_ptr, slot_rows, rank, world_size, HAS_BIAS,
                               SCALE, GROUP_M, 0, HALVES, PROMOTE, PUSH)),
            (_split_worker, (a_bufs, b_bufs, b2_bufs, ready, empty, c_bufs1, c_desc, bias_ptr,
                             sa_ptr, sb_ptr, sa_row, sb_row, M, N, K, shift, slots_ptr, peers_ptr,
                             offsets_ptr, slot_rows, rank, world_size, HAS_BIAS, SCALE, GROUP_M,
                             HALVES, PROMOTE, PUSH)),
            (_split_loader, (a_desc, b_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
                             shift, sig_ptr, offsets_ptr, err_claim, err_record, rank,
                             world_size, epoch, deadline, op_id, GROUP_M, HALVES, WAIT)),
        ], [4, 1], [_K_SCALED_REGS, _loader_regs(WAIT)])
    else:
        gl.warp_specialize([
            (_pp_consumer, (a_bufs, b_bufs, ready, empty, order, c_bufs0, c_desc, bias_ptr,
                            sa_ptr, sb_ptr, sa_row, sb_row, M, N, K, HAS_BIAS, SCALE, GROUP_M,
                            0)),
            (_pp_worker, (a_bufs, b_bufs, ready, empty, order, c_bufs1, c_desc, bias_ptr, sa_ptr,
                          sb_ptr, sa_row, sb_row, M, N, K, HAS_BIAS, SCALE, GROUP_M)),
            (_pair_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
        ], [4, 1], [_K_SCALED_REGS, 24])
