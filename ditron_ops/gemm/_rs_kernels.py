"""Kernels of ``gemm_rs`` / ``gemm_ar``: partial GEMM whose tiles go to the ranks that own their
rows, reduced in rank order.

Reduce-scatter (``gemm_rs_kernel``; rank r owns rows ``[lo, hi)``), one kernel (it is its own
start barrier: program 0 counts the call in on every rank, and a program waits until every rank
has counted it in before its first store into a peer's slots)::

    phase 1: every row tile except r's whole ones,  | count out: each | phase 2: r's whole row tiles:
      peers' rows first (right after r's rows);     | program of r    |   GEMM, wait for all flags,
      fp32 tiles stored into slot r of the owner    | adds its share  |   out = slot 0 + .. + acc (at
      (r's rows of a boundary tile: its own slot)   | to flag[r] on   |   position r) + .. slot W-1;
                                                    | every rank      | then r's boundary rows from
                                                    |                 |   the slots alone

A program counts out after its first own tile's GEMM, so its phase-1 stores drain meanwhile. A
partial last wave of at most half the grid that lies within r's whole tiles runs as twice as
many half-width tiles (split tail, as in ``ag_gemm``): the kernel ends about half a tile sooner.

Waits for flags come after the program's count out, and the only earlier wait (for the peers'
start counts) depends on nothing but their program 0 having started, so every rank's
contributions land whatever the others do (with all ranks' programs resident). A slot is written
only after its owner started this call, i.e. finished reading the previous call's partials
(stream order). r's own partial of a whole tile never leaves the registers: no fp32 round trip
and no second kernel, which makes the one-rank call a plain GEMM plus a few fire-and-forget
atomics. One-shot all-reduce (``gemm_broadcast_kernel``): every tile to slot r of every rank
(after the start barrier), then ``reduce_finish_kernel`` flags, waits and sums.

Counting out: a call adds exactly ``CALL_UNIT`` (2^24) to ``flag[r]`` on every rank, spread over
r's programs: 1 from each, the rest of the unit from program 0 (``nprog``, which varies with the
shape, is far below the unit). So ``flag[s] >= epoch * CALL_UNIT`` once every program of rank s
has counted out of call ``epoch``, with no ticket and no reset, and nobody waits for the
atomics' results. A program reads its own rank's ``flag[r]`` before it counts out, when at
least its own share of this call is missing: ``flag[r] >> CALL_BITS`` is then exactly the calls
before this one, whatever the other programs did. With peers a CTA barrier and a system-scope
acquire-release fence before the relaxed adds publish the program's phase-1 stores; at one rank
there is nothing to publish and the add is a GPU-scope relaxed atomic.

The partials stay fp32 and every owner adds them in rank order 0..W-1 and rounds once: the
result does not depend on arrival order, and with deterministic mode's tiles (BLOCK_K fixed at
64, the M side chosen per M among tilings measured to give the same bits) each output row
depends only on its own input row (batch invariance). The sum starts from its first term, slot 0
(at rank 0 the own partial, straight from the registers), not from a zero tile: the same values
as from +0.0 except that a sum of zeros keeps the sign of -0.0 (-0.0 is the additive identity,
+0.0 is not), which only a bit-level comparison sees (``==`` and ``torch.equal`` do not); the
one-shot ``reduce_finish_kernel`` and the collectives still start from +0.0.

Cost at one rank (the fused path with nothing to exchange): +1.5% geo-mean over the plain GEMM
of the same tiles, at most 2.46% per shape (H200, paired graph replay, the last bench run),
mostly in the epilogues and the prologue; counting out instead of an acq_rel ticket took
8192x4096x1376 from +2.55% to +1.78%, since an acq_rel atomic waits out its round trip. The
kernel sits at 255 registers with 128x256 fp32 tiles and small edits move its spills by tens of
bytes (36 B now in the TMA/aligned variant), so compile-check edits for sm_90a and measure.
History: benchmarks/NOTES.md, gemm_rs / gemm_ar.

Signal pad (the ``ag_gemm`` layout): ``flag[s]`` at ``s`` (units of ``CALL_UNIT``, above); start
counts at ``[W, 2W)`` (+1 per call); calls at ``3W`` (``start_barrier_kernel`` bumps it for one-shot
calls and ``reduce_finish_kernel`` reads it; the reduce-scatter kernel's program 0 bumps it too,
so both paths agree on the call count whatever mix of them runs on one workspace).
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl
from ._core_kernels import _tile_coords, tile_product

CALL_BITS = tl.constexpr(24)
CALL_UNIT = tl.constexpr(1 << CALL_BITS.value)  # (the interpreter cannot shift by a constexpr)
"""A call adds ``CALL_UNIT = 1 << CALL_BITS`` to each rank's ``flag[s]``, split over rank s's
programs (fewer than ``CALL_UNIT``; module docstring)."""


@dl.jit
def _multiple_of_16(x, ALIGNED: tl.constexpr):
    """``x`` itself; with ``ALIGNED`` (the host checked ``x % 16 == 0``) rewritten as
    ``x // 16 * 16`` so the compiler knows it is a multiple of 16 (16-byte vector accesses)."""
    if ALIGNED:
        x = x // 16 * 16
    return x


@dl.jit(do_not_specialize=("M", "N", "K", "slot_rows", "rank", "world_size", "sa_row", "sb_row"))
def gemm_broadcast_kernel(a_desc, b_desc, buf_ptr, buf_table, M, N, K, slot_rows, rank, world_size,
                          sa_ptr, sb_ptr, sa_row, sb_row, bias_ptr,
                          B_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ALIGNED: tl.constexpr,
                          SCALE: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False):
    """``a [M, K] @ b [K, N]`` in fp32 tiles (fp8 scales: ``tile_product``'s ``SCALE``; ``HAS_BIAS``:
    ``+ bias``, see ``_plus_bias``), each stored into slot ``rank`` of every rank. ``ALIGNED``: N
    is a multiple of 16 (vector stores)."""
    N = _multiple_of_16(N, ALIGNED)
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, tiles_m * tiles_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, tiles_m, GROUP_M * tiles_n, 0, GROUP_M)
        acc = tile_product(a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, sa_ptr,
                           sb_ptr, sa_row, sb_row, B_KN, BLOCK_M, BLOCK_N, BLOCK_K, SCALE)
        acc = _plus_bias(acc, bias_ptr, pid_n * BLOCK_N, N, HAS_BIAS)
        _store_halves(acc, buf_ptr, buf_table, buf_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                      slot_rows, rank, world_size, True, BLOCK_M, BLOCK_N)


@dl.jit
def _plus_bias(acc, bias_ptr, off_n, N, HAS_BIAS: tl.constexpr):
    """``acc + bias[off_n:]`` in fp32 with ``HAS_BIAS``, else ``acc``. The host sets ``HAS_BIAS`` on
    rank 0 only: the bias enters the sum once, in rank 0's partial, so the reduced value is
    ``(p_0 + bias) + p_1 + ...`` in rank order, rounded once, whatever path reduces it."""
    if HAS_BIAS:
        rn = off_n + tl.arange(0, acc.shape[1])
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return acc


@dl.jit
def _store_halves(acc, buf_ptr, buf_table, offsets_ptr, off_m, off_n, M, N, slot_rows, rank,
                  world_size, BROADCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_store_partial`` in two ``BLOCK_N / 2`` halves: half the live address registers."""
    acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    _store_partial(acc0, buf_ptr, buf_table, offsets_ptr, off_m, off_n, M, N, slot_rows, rank,
                   world_size, BROADCAST, BLOCK_M, BLOCK_N // 2)
    _store_partial(acc1, buf_ptr, buf_table, offsets_ptr, off_m, off_n + BLOCK_N // 2, M, N,
                   slot_rows, rank, world_size, BROADCAST, BLOCK_M, BLOCK_N // 2)


@dl.jit(do_not_specialize=("M", "N", "K", "slot_rows", "stride_om", "lo", "hi", "tail_tiles",
                           "rank", "world_size", "timeout_us", "op_id", "sa_row", "sb_row"))
def gemm_rs_kernel(a_desc, b_desc, bh_desc, slots_desc, c_desc, buf_ptr, buf_table, offsets_ptr,
                   out_ptr, sig_ptr, sig_table, err_claim, err_record, M, N, K, slot_rows,
                   stride_om, lo, hi, tail_tiles, rank, world_size, timeout_us, op_id,
                   sa_ptr, sb_ptr, sa_row, sb_row, bias_ptr,
                   B_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ALIGNED: tl.constexpr,
                   C_TMA: tl.constexpr, SPLIT_TAIL: tl.constexpr, SCALE: tl.constexpr = 0,
                   HAS_BIAS: tl.constexpr = False):
    """Reduce-scatter GEMM (schedule in the module docstring): ``out = (Σ_s a_s @ b_s)[lo:hi]``
    (``lo``, ``hi``: this rank's rows, also in ``offsets_ptr``; as arguments the first tile's
    coordinates need no load).
    ``ALIGNED``: N and ``stride_om`` are multiples of 16 (vector loads and stores). ``C_TMA``:
    whole own tiles read the peers' partials through ``slots_desc`` and store through ``c_desc``
    (``BLOCK_N / 2`` wide blocks; see ``_reduce_store_tma``); boundary rows always use masked
    pointer loads and stores. ``SPLIT_TAIL``: the last ``tail_tiles`` tiles (whole own tiles; the
    host passes a partial last wave of at most half the grid, else 0) run after the main loop as
    twice as many ``BLOCK_N / 2`` wide halves through ``bh_desc``, as in ``persistent_gemm_kernel``.
    ``HAS_BIAS``: every partial tile gets ``+ bias`` (``_plus_bias``)."""
    N = _multiple_of_16(N, ALIGNED)
    stride_om = _multiple_of_16(stride_om, ALIGNED)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_tiles = GROUP_M * tiles_n
    full_first = tl.cdiv(lo, BLOCK_M)  # r's whole row tiles: [full_first, full_end)
    full_end = tl.where(hi == M, tiles_m, hi // BLOCK_M)
    n_full = tl.maximum(full_end - full_first, 0)
    # This call's number: the calls this rank's programs have counted out of, read before this
    # program counts out (module docstring).
    epoch = (tl.load(sig_ptr + rank, volatile=True).to(tl.int64) >> CALL_BITS) + 1
    if pid == 0:  # this call started here: count it in on every rank (relaxed: what the peers
        for i in range(world_size):  # wait for, the previous call's reads, ended with its kernel)
            dst = dl.remote_ptr(sig_table, (rank + i) % world_size, sig_ptr)
            tl.atomic_add(dst + world_size + rank, 1, sem="relaxed", scope="sys")
        tl.atomic_add(sig_ptr + 3 * world_size, 1, sem="relaxed", scope="gpu")  # (one-shot's)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    rest = (tiles_m - n_full) * tiles_n  # phase-1 tiles, then r's whole tiles: one GEMM loop
    started = pid < 0  # every rank has counted this call in (checked before the first push)
    flagged = pid < 0  # every rank's partials for this rank have landed (waited for once)
    peers_in = pid < 0  # every other rank's have (all whole own tiles need)
    counted = pid < 0  # counted out (after the first own tile's GEMM, see below)
    main_tiles = tiles_m * tiles_n - tail_tiles  # (the host passes 0 without SPLIT_TAIL)
    for tile in range(pid, main_tiles, nprog):
        own = tile >= rest
        if own:
            pm, pid_n = _tile_coords(tile - rest, n_full, group_tiles, 0, GROUP_M)
            off_m = (full_first + pm) * BLOCK_M
        else:
            pm, pid_n = _tile_coords(tile, tiles_m - n_full, group_tiles, 0, GROUP_M)
            off_m = ((pm + full_end) % tiles_m) * BLOCK_M
        acc = tile_product(a_desc, b_desc, off_m, pid_n * BLOCK_N, M, N, K, sa_ptr, sb_ptr,
                           sa_row, sb_row, B_KN, BLOCK_M, BLOCK_N, BLOCK_K, SCALE)
        acc = _plus_bias(acc, bias_ptr, pid_n * BLOCK_N, N, HAS_BIAS)
        if own:
            counted, peers_in = _own_tile(
                acc, counted, peers_in, buf_ptr, out_ptr, slots_desc, c_desc, sig_ptr, sig_table,
                err_claim, err_record, op_id, epoch, deadline, nprog, off_m, pid_n * BLOCK_N, lo,
                hi, N, slot_rows, stride_om, rank, world_size, C_TMA, BLOCK_N)
        else:
            if not started:  # the owners' slots are free once they started this call
                for r in range(world_size):
                    dl.wait_at_least(sig_ptr + world_size + r, epoch, deadline, err_claim,
                                     err_record, op_id, rank, r, epoch)
                started = pid >= 0
            _store_halves(acc, buf_ptr, buf_table, offsets_ptr, off_m, pid_n * BLOCK_N, M, N,
                          slot_rows, rank, world_size, False, BLOCK_M, BLOCK_N)
    if SPLIT_TAIL:
        HALF: tl.constexpr = BLOCK_N // 2
        for sub in range(pid, 2 * tail_tiles, nprog):
            pm, pid_n = _tile_coords(main_tiles + sub // 2 - rest, n_full, group_tiles, 0, GROUP_M)
            off_m = (full_first + pm) * BLOCK_M
            off_n = pid_n * BLOCK_N + (sub % 2) * HALF
            if off_n < N:
                acc = tile_product(a_desc, bh_desc, off_m, off_n, M, N, K, sa_ptr, sb_ptr,
                                   sa_row, sb_row, B_KN, BLOCK_M, HALF, BLOCK_K, SCALE)
                acc = _plus_bias(acc, bias_ptr, off_n, N, HAS_BIAS)
                counted, peers_in = _own_tile(
                    acc, counted, peers_in, buf_ptr, out_ptr, slots_desc, c_desc, sig_ptr,
                    sig_table, err_claim, err_record, op_id, epoch, deadline, nprog, off_m, off_n,
                    lo, hi, N, slot_rows, stride_om, rank, world_size, C_TMA, BLOCK_N)
    if not counted:
        _count_out(sig_ptr, sig_table, rank, world_size, pid, nprog)
    has_top = (hi > lo) & (lo % BLOCK_M != 0)  # boundary tiles: r's rows came from the slots
    has_bottom = (hi > lo) & (full_end * BLOCK_M < hi) & ((full_end != lo // BLOCK_M) | ~has_top)
    n_edge = has_top.to(tl.int32) + has_bottom.to(tl.int32)
    for tile in range(pid, n_edge * tiles_n, nprog):
        top = (tile < tiles_n) & has_top
        off_m = tl.where(top, lo // BLOCK_M, full_end) * BLOCK_M
        if not flagged:  # boundary rows: this rank's own rows come from its own slot too
            flagged = _wait_flags(sig_ptr, epoch, deadline, err_claim, err_record, op_id, rank,
                                  world_size, -1)
        if flagged:
            zero = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
            for half in range(2):
                _reduce_half(zero, False, buf_ptr, out_ptr, slots_desc, c_desc, False, off_m,
                             (tile % tiles_n) * BLOCK_N + half * (BLOCK_N // 2), lo, hi, N,
                             slot_rows, stride_om, rank, world_size)


@dl.jit
def _own_tile(acc, counted, peers_in, buf_ptr, out_ptr, slots_desc, c_desc, sig_ptr, sig_table,
              err_claim, err_record, op_id, epoch, deadline, nprog, off_m, off_n, lo, hi, N,
              slot_rows, stride_om, rank, world_size, C_TMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """After the GEMM of a whole own tile (``acc``: the full ``BLOCK_N`` wide tile, or a split
    tail half): count this program out of phase 1 if not yet (its stores drained during this
    GEMM), wait for the peers' flags if not yet (a whole own tile reads the peers' slots, never
    its own), then reduce and store ``acc`` in ``BLOCK_N / 2`` wide blocks. Returns the new
    ``(counted, peers_in)``."""
    if not counted:
        _count_out(sig_ptr, sig_table, rank, world_size, tl.program_id(0), nprog)
        counted = nprog > 0
    if not peers_in:
        peers_in = _wait_flags(sig_ptr, epoch, deadline, err_claim, err_record, op_id, rank,
                               world_size, rank)
    if peers_in:
        if acc.shape[1] == BLOCK_N:
            h0, h1 = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, BLOCK_N // 2)),
                                         (0, 2, 1)))
            _reduce_half(h0, True, buf_ptr, out_ptr, slots_desc, c_desc, C_TMA, off_m, off_n, lo,
                         hi, N, slot_rows, stride_om, rank, world_size)
            _reduce_half(h1, True, buf_ptr, out_ptr, slots_desc, c_desc, C_TMA, off_m,
                         off_n + BLOCK_N // 2, lo, hi, N, slot_rows, stride_om, rank, world_size)
        else:
            _reduce_half(acc, True, buf_ptr, out_ptr, slots_desc, c_desc, C_TMA, off_m, off_n, lo,
                         hi, N, slot_rows, stride_om, rank, world_size)
    return counted, peers_in


@dl.jit
def _count_out(sig_ptr, sig_table, rank, world_size, pid, nprog):
    """Count this program out of phase 1 on every rank: add its share of the call's
    ``CALL_UNIT`` to ``flag[rank]`` (1; program 0 the rest), fire and forget: nothing waits
    for the atomics' result. With peers, a CTA barrier and a system-scope fence first publish the
    program's phase-1 stores (a release); at one rank there is nothing to publish."""
    share = tl.where(pid == 0, 1 - nprog + CALL_UNIT, 1).to(tl.int64)
    if world_size == 1:
        tl.atomic_add(sig_ptr + rank, share, sem="relaxed", scope="gpu")
    else:
        tl.debug_barrier()
        dl.fence_acq_rel_sys()
        for i in range(world_size):
            dst = dl.remote_ptr(sig_table, (rank + i) % world_size, sig_ptr)
            tl.atomic_add(dst + rank, share, sem="relaxed", scope="sys")


@dl.jit
def _wait_flags(sig_ptr, epoch, deadline, err_claim, err_record, op_id, rank, world_size, skip):
    """Every rank's partials for this rank have landed, except rank ``skip``'s (-1: none
    skipped): all its programs counted out of call ``epoch`` (bounded waits; False on timeout)."""
    ok = epoch >= 0
    for s in range(world_size):
        if s != skip:
            ok = ok & dl.wait_at_least(sig_ptr + s, epoch << CALL_BITS, deadline, err_claim,
                                       err_record, op_id, rank, s, epoch)
    if world_size - tl.where(skip >= 0, 1, 0) > 0:  # a flag was waited for: its partials were
        dl.fence_proxy_async()  # stored with plain stores (peers, or phase 1 here); TMA reads next
    return ok


@dl.jit
def _reduce_half(acc, OWN_IN_ACC: tl.constexpr, buf_ptr, out_ptr, slots_desc, c_desc,
                 C_TMA: tl.constexpr, off_m, off_n, lo, hi, N, slot_rows, stride_om, rank,
                 world_size):
    """Reduce and store a ``[BLOCK_M, BLOCK_N / 2]`` block of a tile at column ``off_n``: with
    ``C_TMA`` (whole own tiles) ``_reduce_store_tma`` at once (the descriptors' block), else
    ``_reduce_store`` in two quarters (fewer live registers: no spills either way, compiled for
    sm_90a)."""
    BM: tl.constexpr = acc.shape[0]
    Q: tl.constexpr = acc.shape[1] // 2
    if C_TMA:
        _reduce_store_tma(acc, slots_desc, c_desc, off_m, off_n, lo, slot_rows, rank, world_size)
    else:
        q0, q1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, Q)), (0, 2, 1)))
        _reduce_store(q0, OWN_IN_ACC, buf_ptr, out_ptr, off_m, off_n, lo, hi, N, slot_rows,
                      stride_om, rank, world_size, BM, Q)
        _reduce_store(q1, OWN_IN_ACC, buf_ptr, out_ptr, off_m, off_n + Q, lo, hi, N, slot_rows,
                      stride_om, rank, world_size, BM, Q)


@dl.jit
def _reduce_store(acc, OWN_IN_ACC: tl.constexpr, buf_ptr, out_ptr, off_m, off_n, lo, hi, N,
                  slot_rows, stride_om, rank, world_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[rows - lo] = slot 0 + slot 1 + ...`` (fp32, rank order from the first term, one
    rounding: module docstring) for this rank's rows of the tile; slot ``rank`` is ``acc`` when
    ``OWN_IN_ACC``."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    mask = ((rm >= lo) & (rm < hi))[:, None] & (rn < N)[None, :]
    local = (rm - lo).to(tl.int64)
    at = buf_ptr + local[:, None] * N + rn[None, :]
    slot = slot_rows.to(tl.int64) * N
    if OWN_IN_ACC:
        total = acc
        if rank > 0:  # slots 0..rank-1 first, then the own partial
            pre = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, rank):
                pre += tl.load(at + s * slot, mask=mask, other=0.0, cache_modifier=".cg")
            total = pre + acc
        after = rank + 1
    else:
        total = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
        after = 1
    for s in range(after, world_size):
        total += tl.load(at + s * slot, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + local[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
             mask=mask)


@dl.jit
def _reduce_store_tma(acc, slots_desc, c_desc, off_m, off_n, lo, slot_rows, rank, world_size):
    """``_reduce_store`` of a whole own tile through TMA: the peers' partial tiles are loaded from
    ``slots_desc`` (the slot buffer as ``[W * slot_rows, N]``) straight into ``acc``'s layout,
    so ``acc`` never leaves its registers; the sum is stored through ``c_desc`` (over ``out``).
    The tile's rows past this rank's last row read the next slot's rows (or zeros past the
    buffer) and are clipped by ``c_desc``'s shape, as are columns past N. Rank order from the
    first term (module docstring): at rank 0, and so at one rank, the sum starts from ``acc``."""
    row = off_m - lo
    total = acc
    if rank > 0:
        pre = slots_desc.load([row, off_n])
        for s in range(1, rank):
            pre += slots_desc.load([s * slot_rows + row, off_n])
        total = pre + acc
    for s in range(rank + 1, world_size):
        total += slots_desc.load([s * slot_rows + row, off_n])
    c_desc.store([row, off_n], total.to(c_desc.dtype))


@dl.jit
def _store_partial(acc, buf_ptr, buf_table, offsets_ptr, off_m, off_n, M, N, slot_rows, rank,
                   world_size, BROADCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store an fp32 tile (as the slots' dtype) at rows ``off_m..``, columns ``off_n..`` into
    slot ``rank`` of the owners of those rows (every rank with ``BROADCAST``)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    col_ok = (rn < N)[None, :]
    slot = rank.to(tl.int64) * slot_rows * N
    if BROADCAST:
        for i in range(world_size):
            dst = (rank + 1 + i) % world_size
            base = dl.peer_base(buf_table, dst, rank, buf_ptr) + slot + off_m.to(tl.int64) * N
            tl.store(base + (rm - off_m)[:, None] * N + rn[None, :], acc,
                     mask=(rm < M)[:, None] & col_ok)
    else:
        for s in range(world_size):
            lo = tl.load(offsets_ptr + s)
            hi = tl.load(offsets_ptr + s + 1)
            if (lo < off_m + BLOCK_M) & (hi > off_m):
                base = dl.peer_base(buf_table, s, rank, buf_ptr) + slot + (off_m - lo).to(tl.int64) * N
                mine = (rm >= lo) & (rm < hi)
                tl.store(base + (rm - off_m)[:, None] * N + rn[None, :], acc,
                         mask=mine[:, None] & col_ok)


@dl.jit(do_not_specialize=("rows", "N", "stride_om", "slot_rows", "rank", "world_size",
                           "timeout_us", "op_id"))
def reduce_finish_kernel(buf_ptr, out_ptr, sig_ptr, sig_table, err_claim, err_record, rows, N,
                         stride_om, slot_rows, rank, world_size, timeout_us, op_id,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr):
    """Flag every rank that this rank's partials have landed (they were stored by the previous
    kernel on this stream), wait for every rank's flag, then sum the slots in rank order.
    ``ALIGNED``: N and ``stride_om`` are multiples of 16 (vector loads and stores)."""
    N = _multiple_of_16(N, ALIGNED)
    stride_om = _multiple_of_16(stride_om, ALIGNED)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
    if pid == 0:  # the whole count of this call (the reduce-scatter kernel's unit)
        dl.fence_sys()
        for i in range(world_size):
            dst = (rank + i) % world_size
            dl.signal_add(dl.remote_ptr(sig_table, dst, sig_ptr) + rank, CALL_UNIT)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    ok = pid >= 0
    for s in range(world_size):
        ok = ok & dl.wait_at_least(sig_ptr + s, epoch << CALL_BITS, deadline, err_claim,
                                   err_record, op_id, rank, s, epoch)
    if ok:  # 2-D tiles (no per-element division), rank order, fp32, one rounding
        offs_r = tl.arange(0, BLOCK_R)
        offs_c = tl.arange(0, BLOCK_C)
        tiles_c = tl.cdiv(N, BLOCK_C)
        slot_elems = slot_rows.to(tl.int64) * N
        for t in range(pid, tl.cdiv(rows, BLOCK_R) * tiles_c, nprog):
            r = (t // tiles_c) * BLOCK_R + offs_r
            c = (t % tiles_c) * BLOCK_C + offs_c
            mask = (r < rows)[:, None] & (c < N)[None, :]
            idx = r.to(tl.int64)[:, None] * N + c[None, :]
            acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
            for s in range(world_size):
                acc += tl.load(buf_ptr + s * slot_elems + idx, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_om + c[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
