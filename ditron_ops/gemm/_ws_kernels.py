"""Persistent, warp-specialized sm_90 GEMM in Gluon (DESIGN.md §14, the second GEMM path).

``C[M, N] = A[M, K] @ B[K, N] (+ bias[N])``, fp32 accumulation, bf16/fp16 operands::

    loader partition (1 warp)         consumer partition(s) (wgmma warpgroups)
    ------------------------          ----------------------------------------
    for each unit of this program:    for each unit this consumer owns:
      for each K step:                  for each K step:
        wait  empty[s]                    wait  ready[s]
        TMA A, B -> ring[s]               wgmma async (ring[s]); this step's in flight only
        (expect-tx on ready[s])           arrive empty[s - 1]
                                        epilogue: + bias, round, smem, TMA store (async)

The ring of ``STAGES`` A/B tiles is continuous across tiles (the loader prefetches the next
tile's K steps while the consumers run their epilogue). Two schedules of the consumers:

* cooperative (``PINGPONG=False``): one default partition of ``num_warps`` = 8 warps, i.e. two
  warpgroups each owning half of the rows of a 128x256 tile (wgmma m64n256k16 each);
* ping-pong (``PINGPONG=True``): two 4-warp consumer partitions (the default one and a worker),
  each owning whole units: consumer ``c`` takes this program's units ``c, c + 2, ...``. An
  ``order`` mbarrier pair makes a consumer start its mainloop only once the other has waited
  for all K steps of the previous unit (without it consumer 1 waited on ring phases several
  laps ahead, which a parity wait cannot tell apart: the launch failure of the first version);
  the mainloops alternate on the tensor cores, each epilogue under the other's mainloop.

Work: a persistent grid; each program takes a list of work units ``(tile, K range)`` (data
parallel, stream-K or split-K: ``_ws_configs`` says which and how they are reduced, the rule
``_ws_configs.plan`` picks one). Tiles follow a grouped order (``GROUP_M`` rows of tiles per
band: L2 reuse of B). A unit covering part of a tile's K steps writes an fp32 partial to a
workspace and bumps the tile's arrival counter; the last to arrive sums the tile's partials in
K order (fixed order, one rounding) and runs the epilogue. ``MODE_SPLITR`` instead stores each
K slice's partial to its own ``[M, N]`` fp32 plane and ``ws_reduce_kernel`` (a second, plain
Triton launch over all SMs) sums the planes in slice order. ``WsPlan.partials`` says how the
partials move: ``reg`` (stores/loads from the wgmma register layout) or ``tma`` (staged through
the C staging tile as fp32 and TMA-stored; the fix-up reads 16-byte coalesced blocks ahead of
its adds; ``ws_reduce_tma_kernel`` over line-padded planes), in the same order either way.

B arrives as ``[K, N]`` row-major (``B_KN``: TMA boxes ``[BLOCK_K, BLOCK_N]``) or as the
transpose of a row-major ``[N, K]`` weight (boxes ``[BLOCK_N, BLOCK_K]``, handed to wgmma as a
transposed shared-memory view). TMA zero-fills every box outside ``[M, K]`` / ``[K, N]``, so
ragged M, N, K need no masks in the mainloop, and clips the stores of C.

The module imports on a Triton without Gluon; the second-kernel reduce of ``MODE_SPLITR`` and
the host side (descriptors, scratch, ``ws_matmul``, the plain ``matmul``'s ``WsGemm``) are in
``_ws_launch``.
"""
from __future__ import annotations

try:  # Gluon ships with triton >= 3.5; the portable core never needs it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    HAVE_GLUON = True
except ImportError:  # annotations are strings (future import), so the defs below still run
    gluon = gl = None
    HAVE_GLUON = False

from ..language import gluon_signals as gs
from ..runtime.error_record import KIND_SIZE_MISMATCH

_jit = gluon.jit if HAVE_GLUON else (lambda fn: fn)
_constexpr_function = gluon.constexpr_function if HAVE_GLUON else (lambda fn: fn)

MAXNREG = 168
"""Registers per thread the kernel is compiled for: 3 warpgroups x 128 threads x 168 <= 64 Ki.
The loader's warpgroup then drops to ``LOADER_REGS`` and the consumers rise (setmaxnreg)."""
LOADER_REGS = 24
"""Registers of the loader partition (scalar work only; the hardware minimum)."""
LOADER_WAIT_REGS = 40
"""Registers of a waiting loader (``WAIT``: the flag polls, deadline and seen-chunk mask;
at 24 the ping-pong kernels' loader spilled)."""
CONSUMER_REGS = 240
"""Registers of the ping-pong worker consumer (a 128-register accumulator plus addressing);
the default partition gets what is left of ``MAXNREG`` x 3 warpgroups."""
TRACE_UNITS = 64
"""Work units per program a ``TRACE`` launch records (later ones overwrite the last row)."""
TRACE_POINTS = 4
"""Timestamps per traced unit (``_stamp``): 0 mainloop start, 1 mainloop end, 2 a stream-K or
split-K partial stored and its arrival counted (those modes only), 3 the unit done (C stored,
a split plane stored, or the fix-up's C stored)."""
_K_TRACE_UNITS = gl.constexpr(TRACE_UNITS) if HAVE_GLUON else TRACE_UNITS
_K_TRACE_POINTS = gl.constexpr(TRACE_POINTS) if HAVE_GLUON else TRACE_POINTS
_SIZE_MISMATCH = gl.constexpr(KIND_SIZE_MISMATCH) if HAVE_GLUON else KIND_SIZE_MISMATCH
_K_CONSUMER_REGS = gl.constexpr(CONSUMER_REGS) if HAVE_GLUON else CONSUMER_REGS


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------

@_constexpr_function
def _loader_regs(wait):
    return LOADER_WAIT_REGS if wait else LOADER_REGS


@_constexpr_function
def _wgmma_n(block_n):
    """wgmma instruction N: the whole tile width (one m64nNk16 per warpgroup and K16 step)."""
    return min(block_n, 256)


@_jit
def _tile_mn(tile, tiles_m, tiles_n, shift, GROUP_M: gl.constexpr):
    """Grouped tile order: bands of ``GROUP_M`` tile rows, column-major inside a band, so the
    programs working at one time share B columns and A rows in L2; rows rotated by ``shift``
    tiles (the ag_gemm consumer: this rank's own rows first, 0 otherwise)."""
    band_tiles = GROUP_M * tiles_n
    first_m = (tile // band_tiles) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    in_band = tile % band_tiles
    return (first_m + in_band % rows + shift) % tiles_m, in_band // rows


@_jit
def _sched(M, N, K, dp_tiles, split, MODE: gl.constexpr, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """This program's share of the work (``_ws_configs`` module docstring, the modes).

    Returns ``(tiles_m, tiles_n, k_steps, units, n_dp, s, e, t0, q, r, kps)``: ``units`` work
    units, the first ``n_dp`` whole data-parallel tiles; stream-K: this program's iteration
    range ``[s, e)`` starting in stream-K tile ``t0``, ``q``/``r`` the range length and
    remainder; split-K: ``kps`` K steps per slice."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    k_steps = gl.cdiv(K, BLOCK_K)
    p = gl.program_id(0)
    G = gl.num_programs(0)
    if MODE == 1:
        n_dp = dp_tiles // G
        total = (tiles - dp_tiles) * k_steps
        q = total // G
        r = total % G
        s = p * q + gl.minimum(p, r)
        e = s + q + (p < r).to(gl.int32)
        t0 = s // k_steps
        n_sk = gl.where(e > s, (e - 1) // k_steps - t0 + 1, 0)
        units = n_dp + n_sk
        kps = k_steps
    elif MODE >= 2:
        kps = gl.cdiv(k_steps, split)
        units = gl.cdiv(tiles * split - p, G)
        n_dp = units
        s = p * 0
        e = s
        t0 = s
        q = s
        r = s
    else:
        units = gl.cdiv(tiles - p, G)
        n_dp = units
        kps = k_steps
        s = p * 0
        e = s
        t0 = s
        q = s
        r = s
    return tiles_m, tiles_n, k_steps, units, n_dp, s, e, t0, q, r, kps


@_jit
def _unit(i, k_steps, n_dp, s, e, t0, kps, dp_tiles, split, MODE: gl.constexpr):
    """Work unit ``i`` of this program: ``(tile, k_begin, k_end)`` in K steps."""
    p = gl.program_id(0)
    G = gl.num_programs(0)
    if MODE == 1:
        tt = t0 + (i - n_dp)
        base = tt * k_steps
        dp = i < n_dp
        tile = gl.where(dp, p + i * G, dp_tiles + tt)
        kb = gl.where(dp, 0, gl.maximum(s, base) - base)
        ke = gl.where(dp, k_steps, gl.minimum(e, base + k_steps) - base)
    elif MODE >= 2:
        u = p + i * G
        tile = u // split
        kb = (u % split) * kps
        ke = gl.minimum(k_steps, kb + kps)
    else:
        tile = p + i * G
        kb = i * 0
        ke = k_steps + kb
    return tile, kb, ke


@_jit
def _owner(g, q, r):
    """The stream-K range holding iteration ``g``."""
    big = r * (q + 1)
    return gl.where(g < big, g // (q + 1), r + (g - big) // gl.maximum(q, 1))


@_jit
def _wait_rows(sig_ptr, offsets_ptr, row_lo, row_hi, rank, world_size, epoch, deadline,
               err_claim, err_record, op_id, seen):
    """The ag_gemm consumer's wait before a tile's A loads (``_core_kernels._wait_rows``' twin):
    every gathered chunk overlapping rows ``[row_lo, row_hi)`` not yet in ``seen`` (bit s:
    chunk s landed; chunks from 63 on are waited for every time), its size checked. Returns
    the new ``seen``; the proxy fence runs after a wait (TMA reads the rows next)."""
    new = seen
    waited = 0
    one = (epoch * 0 + 1).to(gl.int64)
    for s in range(world_size):
        bit = gl.where(s < 63, one << gl.minimum(s, 62).to(gl.int64), 0)
        lo = gl.load(offsets_ptr + s)
        hi = gl.load(offsets_ptr + s + 1)
        if (lo < row_hi) & (hi > row_lo) & ((seen & bit) == 0):
            arrived = gs.wait_at_least(sig_ptr + s, epoch, deadline, err_claim, err_record,
                                       op_id, rank, s, epoch)
            got = gl.load(sig_ptr + 2 * world_size + s, volatile=True)
            if arrived & (got != (hi - lo)):
                gs.record_error(err_claim, err_record, op_id, rank, s, epoch, _SIZE_MISMATCH)
            new = new | bit  # (a timed-out chunk too: a lost peer costs one timeout)
            waited += 1
    if waited > 0:
        gs.fence_proxy_async()
    return new


@_jit
def _ws_loader(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
               dp_tiles, split, shift, sig_ptr, offsets_ptr, err_claim, err_record, rank,
               world_size, epoch, deadline, op_id, B_KN: gl.constexpr, GROUP_M: gl.constexpr,
               MODE: gl.constexpr, N2: gl.constexpr, WAIT: gl.constexpr):
    """Producer partition: fills the ring in work-unit order, one K step per slot (``N2``: the
    second accumulator's columns, its B box loaded beside the first). ``WAIT`` (the ag_gemm
    consumer): before a unit's loads, the gathered chunks its rows come from (``_wait_rows``;
    flags ``>= epoch``, bounded by ``deadline``)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    if B_KN:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    else:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    # Every box lands in full (zero fill outside the tensor), so the byte count never varies.
    if N2 > 0:
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                + b2_desc.block_type.nbytes)
    else:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes

    tiles_m, tiles_n, k_steps, units, n_dp, s, e, t0, q, r, kps = _sched(
        M, N, K, dp_tiles, split, MODE, BLOCK_M, BLOCK_N + N2, BLOCK_K)
    it = 0  # ring position, continuous over units (consumers derive theirs the same way)
    if WAIT:
        seen = (epoch * 0).to(gl.int64)  # chunks seen landed
    else:
        seen = 0
    for i in range(units):
        tile, kb, ke = _unit(i, k_steps, n_dp, s, e, t0, kps, dp_tiles, split, MODE)
        pid_m, pid_n = _tile_mn(tile, tiles_m, tiles_n, shift, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * (BLOCK_N + N2)
        if WAIT:
            seen = _wait_rows(sig_ptr, offsets_ptr, off_m, gl.minimum(off_m + BLOCK_M, M), rank,
                              world_size, epoch, deadline, err_claim, err_record, op_id, seen)
        for kk in range(kb, ke):
            slot = it % STAGES
            # Parity of the previous fill's release; a fresh barrier passes parity 1 at once.
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bar, a_bufs.index(slot))
            if B_KN:
                tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], bar,
                                                b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], bar,
                                                b_bufs.index(slot))
            if N2 > 0:
                if B_KN:
                    tma.async_copy_global_to_shared(b2_desc, [kk * BLOCK_K, off_n + BLOCK_N],
                                                    bar, b2_bufs.index(slot))
                else:
                    tma.async_copy_global_to_shared(b2_desc, [off_n + BLOCK_N, kk * BLOCK_K],
                                                    bar, b2_bufs.index(slot))
            it += 1


@_jit
def _split_cols(x, PARTS: gl.constexpr):
    """``x`` [R, C] as ``PARTS`` column blocks [R, C / PARTS], left to right (register moves
    only: the wgmma layout keeps each thread's columns in its registers)."""
    xs = (x, )
    for _ in gl.static_range(PARTS.bit_length() - 1):
        halves = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            # [R, 2, C/2] -> [R, C/2, 2]: the split axis last, so split() gives the halves.
            halves += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
        xs = halves
    return xs


@_jit
def _tile_offsets(part, col0, BLOCK_N: gl.constexpr):
    """Offsets ``row * BLOCK_N + col0 + col`` of ``part``'s elements in a row-major partial
    tile (``part``'s layout)."""
    rows = gl.arange(0, part.shape[0], layout=gl.SliceLayout(1, part.type.layout))
    cols = gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, part.type.layout))
    return gl.expand_dims(rows, 1) * BLOCK_N + gl.expand_dims(cols + col0, 0)


@_jit
def _store_part(part, i: gl.constexpr, c_desc, c_smem, bias_ptr, off_m, off_n, N,
                HAS_BIAS: gl.constexpr):
    """Epilogue of column block ``i``: + bias, round, stage, TMA store (left in flight; waited
    only before the staging tile is rewritten)."""
    EPI_N: gl.constexpr = c_desc.block_type.shape[1]
    out = _plus_bias(part, bias_ptr, off_n + i * EPI_N, N, HAS_BIAS).to(c_desc.dtype)
    tma.store_wait(0)
    c_smem.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n + i * EPI_N], c_smem)


@_jit
def _store_plane(part, plane, off_m, off_n, M, N):
    """``part`` (fp32, any layout) to ``plane[off_m:, off_n:]`` of a row-major ``[M, N]`` fp32
    plane, clipped to ``[M, N]``."""
    rows = off_m + gl.arange(0, part.shape[0], layout=gl.SliceLayout(1, part.type.layout))
    cols = off_n + gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, part.type.layout))
    offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    gl.store(plane + offs, part, mask=mask)


@_jit
def _push_part(part, buf_ptr, peers_ptr, offsets_ptr, off_m, off_n, M, N, slot_rows, rank,
               world_size, PUSH: gl.constexpr):
    """The gemm_rs / gemm_ar producer's epilogue of one fp32 column block (``_rs_kernels.
    _store_partial``'s twin): into slot ``rank`` of the ``[W, slot_rows, N]`` fp32 slots of the
    owners of its rows (``PUSH`` 1; row ``i`` of rank s's rows at slot row ``i - lo_s``) or of
    every rank, peers first (``PUSH`` 2). Stores from the wgmma layout: a warp's store covers
    whole 32-byte sectors. Nothing is published here: the finish kernel after this launch
    fences and counts out (``reduce_finish_kernel``). N is a multiple of 16 (the host's
    condition), written so the compiler sees it: 8-byte stores of each thread's column pair."""
    N = N // 16 * 16
    rows = off_m + gl.arange(0, part.shape[0], layout=gl.SliceLayout(1, part.type.layout))
    cols = off_n + gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, part.type.layout))
    col_ok = gl.expand_dims(cols < N, 0)
    slot = rank.to(gl.int64) * slot_rows * N
    if PUSH == 2:
        offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(rows < M, 1) & col_ok
        for i in range(world_size):
            dst = (rank + 1 + i) % world_size
            gl.store(gs.peer_base(peers_ptr, dst, rank, buf_ptr) + slot + offs, part, mask=mask)
    else:
        for s in range(world_size):
            lo = gl.load(offsets_ptr + s)
            hi = gl.load(offsets_ptr + s + 1)
            if (lo < off_m + part.shape[0]) & (hi > off_m):
                offs = (gl.expand_dims((rows - lo).to(gl.int64) * N, 1)
                        + gl.expand_dims(cols, 0))
                mask = gl.expand_dims((rows >= lo) & (rows < hi), 1) & col_ok
                gl.store(gs.peer_base(peers_ptr, s, rank, buf_ptr) + slot + offs, part,
                         mask=mask)


@_jit
def _plus_bias(part, bias_ptr, off_n, N, HAS_BIAS: gl.constexpr):
    """``part + bias[off_n:]`` in fp32 with ``HAS_BIAS``, else ``part``."""
    if HAS_BIAS:
        cols = off_n + gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, part.type.layout))
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        part = part + gl.expand_dims(bias.to(gl.float32), 0)
    return part


@_constexpr_function
def _fix_layout(block_n, warps):
    """Blocked layout of the ``partials="tma"`` fix-up: 4 consecutive fp32 a thread (16-byte
    loads), a warp over whole 256-byte rows of a ``[BLOCK_M, block_n]`` column block."""
    tpw_n = min(32, block_n // 4)
    return gl.BlockedLayout([1, 4], [32 // tpw_n, tpw_n], [warps, 1], [1, 0])


@_jit
def _stage_partial(acc, p_desc, p_smem, row0, col0):
    """``acc`` (fp32, wgmma layout) to ``[row0:, col0:]`` of the partials tensor ``p_desc``:
    column blocks of the staging tile's width through ``p_smem`` (the epilogue's staging tile
    as fp32), each a TMA store (left in flight; waited before ``p_smem`` is rewritten)."""
    PN: gl.constexpr = p_desc.block_type.shape[1]
    parts = _split_cols(acc, acc.shape[1] // PN)
    for c in gl.static_range(acc.shape[1] // PN):
        tma.store_wait(0)
        p_smem.store(parts[c])
        fence_async_shared()
        tma.async_copy_shared_to_global(p_desc, [row0, col0 + c * PN], p_smem)


@_jit
def _publish_stores(x):
    """Wait until this thread's TMA stores are written (not only read from shared memory) and
    order them before the generic proxy's later accesses (the arrival's release). Returns a
    dummy of ``x``'s type (inline asm needs a result)."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;",
        "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@_jit
def _seg_slot(j, first, base, q, r, MODE: gl.constexpr):
    """Workspace slot of the tile's ``j``-th partial in K order (``MODE`` 1: the stream-K range
    ``first + j`` wrote slot 0 or 1 of its pair, by whether it started before the tile)."""
    if MODE == 1:
        pj = first + j
        sj = 2 * pj + ((pj * q + gl.minimum(pj, r)) < base).to(gl.int32)
    else:
        sj = first + j
    return sj


@_constexpr_function
def _fix_ahead(block_m, block_n, warps):
    """Column blocks the fix-up loads ahead of its adds: 2 where a block is at most 32 fp32 a
    thread (four blocks live: sum, current, two in flight), else 1 (128-row blocks over one
    warpgroup: 64 a thread; two ahead spilled)."""
    return 2 if block_m * block_n <= 32 * 32 * warps else 1


@_jit
def _fixup_coalesced(ws_ptr, first, nseg, base, q, r, c_desc, c_smem, bias_ptr, off_m, off_n,
                     N, HAS_BIAS: gl.constexpr, MODE: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
    """The last arriver's sum of a tile's ``nseg`` partials in K order, ``[BLOCK_M, EPI_N]``
    column block by block, each block's epilogue (+ bias, round, TMA store of C) from the
    blocked layout. Loads run ``_fix_ahead`` blocks ahead of the adds over the flat (block,
    segment) stream ``t = c * nseg + j`` (indices past the end clamped to the last block: one
    or two spare loads a tile)."""
    EPI_N: gl.constexpr = c_desc.block_type.shape[1]
    PARTS: gl.constexpr = BLOCK_N // EPI_N
    TILE: gl.constexpr = BLOCK_M * BLOCK_N
    AHEAD: gl.constexpr = _fix_ahead(BLOCK_M, EPI_N, WARPS)
    layout: gl.constexpr = _fix_layout(EPI_N, WARPS)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, EPI_N, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows, 1) * BLOCK_N + gl.expand_dims(cols, 0)
    last = PARTS * nseg - 1
    cur = gl.load(ws_ptr + _seg_slot(0, first, base, q, r, MODE).to(gl.int64) * TILE + offs,
                  cache_modifier=".cg")
    if AHEAD > 1:
        t1 = gl.minimum(1, last)
        nxt = gl.load(ws_ptr + _seg_slot(t1 % nseg, first, base, q, r, MODE).to(gl.int64) * TILE
                      + (t1 // nseg) * EPI_N + offs, cache_modifier=".cg")
    for c in gl.static_range(PARTS):
        tot = gl.zeros([BLOCK_M, EPI_N], gl.float32, layout)
        for j in range(nseg):
            t2 = gl.minimum(c * nseg + j + AHEAD, last)
            nn = gl.load(ws_ptr + _seg_slot(t2 % nseg, first, base, q, r, MODE).to(gl.int64)
                         * TILE + (t2 // nseg) * EPI_N + offs, cache_modifier=".cg")
            tot += cur  # K order: segment j of block c
            if AHEAD > 1:
                cur = nxt
                nxt = nn
            else:
                cur = nn
        _store_part(tot, c, c_desc, c_smem, bias_ptr, off_m, off_n, N, HAS_BIAS)


@_jit
def ring_barriers(STAGES: gl.constexpr, READERS: gl.constexpr):
    """The ring's mbarriers: ``ready[s]`` (slot ``s``'s TMA bytes landed), ``empty[s]`` (slot
    ``s`` read by its ``READERS`` consumer partitions), ``order[c]`` (ping-pong consumer ``c``
    may start its next mainloop)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=READERS)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    return ready, empty, order


@_jit
def _stamp(trace_ptr, i, POINT: gl.constexpr, TRACE: gl.constexpr):
    """``TRACE`` only: the global timer (ns) at ``POINT`` of this program's unit ``i`` into
    ``trace_ptr`` ``[programs, TRACE_UNITS, TRACE_POINTS]`` int64 (the probe's timeline of where
    a schedule spends its time; one binary without it)."""
    if TRACE:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                      is_pure=False, pack=1)
        row = gl.program_id(0) * _K_TRACE_UNITS + gl.minimum(i, _K_TRACE_UNITS - 1)
        gl.store(trace_ptr + row.to(gl.int64) * _K_TRACE_POINTS + POINT, t)


@_jit
def _ws_consumer(a_bufs, b_bufs, b2_bufs, ready, empty, order, c_smem, c_desc, bias_ptr, ws_ptr,
                 cnt_ptr, p_desc, trace_ptr, M, N, K, dp_tiles, split, plane_rows, shift,
                 peers_ptr, offsets_ptr, slot_rows, rank, world_size,
                 HAS_BIAS: gl.constexpr, B_KN: gl.constexpr, GROUP_M: gl.constexpr,
                 MODE: gl.constexpr, TMA_PARTS: gl.constexpr, TRACE: gl.constexpr,
                 N2: gl.constexpr, PUSH: gl.constexpr, SLOT: gl.constexpr, SLOTS: gl.constexpr,
                 WARPS: gl.constexpr):
    """Consumer partition: wgmma over the ring, then the epilogue of each owned work unit.

    ``SLOT`` of ``SLOTS`` consumers: this one takes the program's units ``SLOT, SLOT + SLOTS,
    ...``; ``WARPS``: its warps (4: one warpgroup, 8: two stacked along M).

    Ping-pong order (``SLOTS`` = 2): a consumer starts unit ``i``'s mainloop only after the
    other consumer has waited for every K step of unit ``i - 1`` (``order`` barriers). The
    ring's parity waits are then never more than one phase ahead of a slot's barrier.

    ``TMA_PARTS`` (``partials="tma"``): fp32 partials leave through ``p_desc`` (TMA stores from
    the staging tile reinterpreted as fp32; ``plane_rows``: rows of one split plane) and the
    fix-up reads them coalesced (``_fixup_coalesced``).

    ``N2`` > 0: a second accumulator of ``N2`` columns right of the first (``b2_bufs``), one
    more async wgmma per K step; ``MODE`` 0 only (the host never plans partials for it).

    ``PUSH`` (``MODE`` 0): fp32 tiles (+ bias) into the gemm_rs / gemm_ar slots (``ws_ptr``
    this rank's, ``peers_ptr`` every rank's base, ``offsets_ptr`` the ranks' first rows;
    ``_push_part``) instead of C."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    if B_KN:
        BLOCK_N: gl.constexpr = b_bufs.shape[2]
    else:
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
    EPI_N: gl.constexpr = c_desc.block_type.shape[1]
    PARTS: gl.constexpr = BLOCK_N // EPI_N
    TILE: gl.constexpr = BLOCK_M * BLOCK_N
    if TMA_PARTS:
        # The staging tile of C as an fp32 [BLOCK_M, PN] tile (the same bytes).
        p_smem = c_smem._reinterpret(gl.float32, p_desc.block_type.shape, p_desc.layout)
    # Warps stacked along M ([WARPS, 1]): each warpgroup runs one wide m64nNk16 per K16 step,
    # the fewest instructions and the least shared-memory traffic per MAC.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1],
        instr_shape=[16, _wgmma_n(BLOCK_N), 256 // a_bufs.dtype.primitive_bitwidth])

    if N2 > 0:
        acc2_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS, 1],
            instr_shape=[16, N2, 256 // a_bufs.dtype.primitive_bitwidth])

    tiles_m, tiles_n, k_steps, units, n_dp, s, e, t0, q, r, kps = _sched(
        M, N, K, dp_tiles, split, MODE, BLOCK_M, BLOCK_N + N2, BLOCK_K)
    p = gl.program_id(0)
    it = 0  # ring position (the loader's order)
    for i in range(units):
        tile, kb, ke = _unit(i, k_steps, n_dp, s, e, t0, kps, dp_tiles, split, MODE)
        if i % SLOTS == SLOT:
            if SLOTS > 1:
                mbarrier.wait(order.index(SLOT), ((i - 1) // 2) & 1, pred=i > 0)
            _stamp(trace_ptr, i, 0, TRACE)
            prev = 0
            # Not carried over units: dead in the epilogue once its partial or C is stored.
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            if N2 > 0:
                acc2 = gl.zeros([BLOCK_M, N2], gl.float32, acc2_layout)
            for kk in range(kb, ke):
                slot = it % STAGES
                mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
                if B_KN:
                    b_tile = b_bufs.index(slot)
                else:
                    b_tile = b_bufs.index(slot).permute((1, 0))  # [N, K] box as K-major B
                # use_acc=False on the first step zeroes the accumulator for free.
                acc = warpgroup_mma(a_bufs.index(slot), b_tile, acc, use_acc=kk > kb,
                                    is_async=True)
                if N2 > 0:
                    if B_KN:
                        b2_tile = b2_bufs.index(slot)
                    else:
                        b2_tile = b2_bufs.index(slot).permute((1, 0))
                    acc2 = warpgroup_mma(a_bufs.index(slot), b2_tile, acc2, use_acc=kk > kb,
                                         is_async=True)
                    # This step's two in flight: the previous step's are done.
                    acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
                else:
                    # Keep one wgmma in flight: the previous step's is done, its slot goes back.
                    acc = warpgroup_mma_wait(1, deps=(acc, ))
                if WARPS > 4:
                    # Arrive is issued by one thread; the other warpgroup's wgmma must be done.
                    gl.thread_barrier()
                mbarrier.arrive(empty.index(prev), pred=kk > kb)
                prev = slot
                it += 1
            if SLOTS > 1:
                mbarrier.arrive(order.index(1 - SLOT))  # the other consumer's next unit may go
            if N2 > 0:
                acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
            else:
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            if WARPS > 4:
                gl.thread_barrier()
            mbarrier.arrive(empty.index(prev))
            _stamp(trace_ptr, i, 1, TRACE)

            pid_m, pid_n = _tile_mn(tile, tiles_m, tiles_n, shift, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * (BLOCK_N + N2)
            parts = _split_cols(acc, PARTS)
            if MODE == 0 and PUSH > 0:
                for c in gl.static_range(PARTS):
                    _push_part(_plus_bias(parts[c], bias_ptr, off_n + c * EPI_N, N, HAS_BIAS),
                               ws_ptr, peers_ptr, offsets_ptr, off_m, off_n + c * EPI_N, M, N,
                               slot_rows, rank, world_size, PUSH)
                if N2 > 0:
                    parts2 = _split_cols(acc2, N2 // EPI_N)
                    for c in gl.static_range(N2 // EPI_N):
                        col = off_n + BLOCK_N + c * EPI_N
                        _push_part(_plus_bias(parts2[c], bias_ptr, col, N, HAS_BIAS), ws_ptr,
                                   peers_ptr, offsets_ptr, off_m, col, M, N, slot_rows, rank,
                                   world_size, PUSH)
            elif MODE == 0:
                for c in gl.static_range(PARTS):
                    _store_part(parts[c], c, c_desc, c_smem, bias_ptr, off_m, off_n, N, HAS_BIAS)
                if N2 > 0:
                    parts2 = _split_cols(acc2, N2 // EPI_N)
                    for c in gl.static_range(N2 // EPI_N):
                        _store_part(parts2[c], PARTS + c, c_desc, c_smem, bias_ptr, off_m, off_n,
                                    N, HAS_BIAS)
            elif MODE == 3:
                if TMA_PARTS:
                    # rows (kb // kps) * plane_rows + off_m of the planes' [split * rows, N]
                    # view (rows padded to whole tiles: no box crosses into the next plane)
                    _stage_partial(acc, p_desc, p_smem, (kb // kps) * plane_rows + off_m, off_n)
                else:
                    # fp32 partial to plane kb // kps of the [split, M, N] workspace (reduced
                    # by ws_reduce_kernel in slice order).
                    plane = ws_ptr + (kb // kps).to(gl.int64) * M * N
                    for c in gl.static_range(PARTS):
                        _store_plane(parts[c], plane, off_m, off_n + c * EPI_N, M, N)
            else:
                if MODE == 1:
                    tt = tile - dp_tiles
                    base = tt * k_steps
                    partial = (i >= n_dp) & ((kb > 0) | (ke < k_steps))
                    first = _owner(base, q, r)
                    nseg = _owner(base + k_steps - 1, q, r) - first + 1
                    my_slot = 2 * p + (i > n_dp).to(gl.int32)
                    cidx = tt
                else:
                    partial = split > 1
                    first = tile * split
                    base = first  # (stream-K's; unused here)
                    nseg = split
                    my_slot = p + i * gl.num_programs(0)
                    cidx = tile
                if partial:
                    # This range's fp32 partial to its workspace tile, then arrive.
                    if TMA_PARTS:
                        # rows my_slot * BLOCK_M of the [slots * BLOCK_M, BLOCK_N] view
                        _stage_partial(acc, p_desc, p_smem, my_slot * BLOCK_M, 0)
                        _publish_stores(my_slot)
                    else:
                        wbase = ws_ptr + my_slot.to(gl.int64) * TILE
                        for c in gl.static_range(PARTS):
                            gl.store(wbase + _tile_offsets(parts[c], c * EPI_N, BLOCK_N),
                                     parts[c])
                    gl.thread_barrier()
                    old = gl.atomic_add(cnt_ptr + cidx, 1, sem="acq_rel", scope="gpu")
                    _stamp(trace_ptr, i, 2, TRACE)
                    if TMA_PARTS and old == nseg - 1:
                        gl.store(cnt_ptr + cidx, 0)  # ready for the next launch
                        _fixup_coalesced(ws_ptr, first, nseg, base, q, r, c_desc, c_smem,
                                         bias_ptr, off_m, off_n, N, HAS_BIAS, MODE, BLOCK_M,
                                         BLOCK_N, WARPS)
                    elif old == nseg - 1:
                        # Last to arrive: sum the partials in K order (one fixed order).
                        gl.store(cnt_ptr + cidx, 0)  # ready for the next launch
                        for c in gl.static_range(PARTS):
                            offs = _tile_offsets(parts[c], c * EPI_N, BLOCK_N)
                            tot = gl.full_like(parts[c], 0.0)
                            for j in range(nseg):
                                if MODE == 1:
                                    pj = first + j
                                    sj = 2 * pj + ((pj * q + gl.minimum(pj, r)) < base).to(
                                        gl.int32)
                                else:
                                    sj = first + j
                                tot += gl.load(ws_ptr + sj.to(gl.int64) * TILE + offs,
                                               cache_modifier=".cg")
                            _store_part(tot, c, c_desc, c_smem, bias_ptr, off_m, off_n, N,
                                        HAS_BIAS)
                else:
                    for c in gl.static_range(PARTS):
                        _store_part(parts[c], c, c_desc, c_smem, bias_ptr, off_m, off_n, N,
                                    HAS_BIAS)
            _stamp(trace_ptr, i, 3, TRACE)
        else:
            it += ke - kb
    tma.store_wait(0)


@_jit
def _ws_consumer_worker(a_bufs, b_bufs, b2_bufs, ready, empty, order, c_smem, c_desc, bias_ptr,
                        ws_ptr, cnt_ptr, p_desc, trace_ptr, M, N, K, dp_tiles, split, plane_rows,
                        shift, peers_ptr, offsets_ptr, slot_rows, rank, world_size,
                        HAS_BIAS: gl.constexpr, B_KN: gl.constexpr, GROUP_M: gl.constexpr,
                        MODE: gl.constexpr, TMA_PARTS: gl.constexpr, TRACE: gl.constexpr,
                        N2: gl.constexpr, PUSH: gl.constexpr):
    """The ping-pong's second consumer (a 4-warp worker partition, slot 1 of 2)."""
    _ws_consumer(a_bufs, b_bufs, b2_bufs, ready, empty, order, c_smem, c_desc, bias_ptr, ws_ptr,
                 cnt_ptr, p_desc, trace_ptr, M, N, K, dp_tiles, split, plane_rows, shift,
                 peers_ptr, offsets_ptr, slot_rows, rank, world_size,
                 HAS_BIAS, B_KN, GROUP_M, MODE, TMA_PARTS, TRACE, N2, PUSH, 1, 2, 4)


def _jit_dims(fn):
    """``ws_gemm_kernel``'s decorator: sizes unspecialized (one binary serves every shape)."""
    return (gluon.jit(fn, do_not_specialize=["M", "N", "K", "dp_tiles", "split", "plane_rows",
                                             "rank", "world_size", "timeout_us", "op_id",
                                             "slot_rows"])
            if HAVE_GLUON else fn)


@_jit_dims
def ws_gemm_kernel(a_desc, b_desc, c_desc, bias_ptr, ws_ptr, cnt_ptr, p_desc, trace_ptr, b2_desc,
                   M, N, K, dp_tiles, split, plane_rows, sig_ptr, offsets_ptr, err_claim,
                   err_record, rank, world_size, timeout_us, op_id, peers_ptr, slot_rows,
                   HAS_BIAS: gl.constexpr, B_KN: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, PINGPONG: gl.constexpr, MODE: gl.constexpr,
                   TMA_PARTS: gl.constexpr, num_warps: gl.constexpr, TRACE: gl.constexpr = False,
                   N2: gl.constexpr = 0, WAIT: gl.constexpr = False, PUSH: gl.constexpr = 0):
    """Persistent warp-specialized GEMM (module docstring). Grid: ``(programs, )``.

    ``a_desc`` [M, K] boxes [BLOCK_M, BLOCK_K]; ``b_desc`` [K, N] boxes [BLOCK_K, BLOCK_N]
    (``B_KN``) or [N, K] boxes [BLOCK_N, BLOCK_K]; ``c_desc`` [M, N] boxes [BLOCK_M, EPI_N];
    ``bias_ptr`` [N] (read only with ``HAS_BIAS``); ``ws_ptr`` fp32 partial tiles and
    ``cnt_ptr`` int32 zeroed arrival counters (``MODE`` 1/2 only; ``_ws_configs.WsPlan``);
    ``TMA_PARTS``: partials through ``p_desc``, an fp32 descriptor over the workspace (boxes
    ``[BLOCK_M, EPI_N * C bytes / 4]``, the staging tile's bytes): ``[slots * BLOCK_M,
    BLOCK_N]`` (``MODE`` 1/2) or the split planes ``[split * plane_rows, N]`` (``MODE`` 3; row
    pitch ``splitr_pitch``); else ``p_desc`` is unused (``c_desc`` passed again).
    ``TRACE``: consumers record timestamps in ``trace_ptr`` (``_stamp``; else unused).
    ``N2`` > 0: ``b2_desc`` boxes the second accumulator's ``N2`` columns of B (else unused:
    ``b_desc`` passed again); output tiles are ``BLOCK_N + N2`` wide.
    ``WAIT``: the ag_gemm consumer over the gathered buffer ``a_desc``: the loader waits for
    the chunks of each unit's rows (the signal pad ``sig_ptr``: arrival flags, sizes at
    ``2W``, the call's epoch at ``3W``; ``offsets_ptr`` the chunks' first rows; a timeout after
    ``timeout_us`` recorded as op ``op_id``) and every partition visits the rows of tiles from
    this rank's own first (else the wait arguments are unused).
    ``PUSH`` (1 scatter, 2 broadcast; ``MODE`` 0): the gemm_rs / gemm_ar producer. Tiles go as
    fp32 into slot ``rank`` of the ``[W, slot_rows, N]`` slots (``ws_ptr`` this rank's,
    ``peers_ptr`` the int64 table of every rank's base) of the owners of their rows
    (``offsets_ptr``: ``W + 1`` first rows) or of every rank; C is not written (``c_desc``
    only sizes the unused staging tile). Scatter visits the rows after this rank's first, its
    own last (the peers' partials leave earliest)."""
    dtype: gl.constexpr = a_desc.dtype
    if WAIT:
        shift = gl.load(offsets_ptr + rank) // a_desc.block_type.shape[0]
        epoch = gl.load(sig_ptr + 3 * world_size, volatile=True).to(gl.int64)
        deadline = gs.now_ns() + timeout_us.to(gl.int64) * 1000
    elif PUSH == 1:
        shift = gl.load(offsets_ptr + rank + 1) // a_desc.block_type.shape[0]
        epoch = 0
        deadline = 0
    else:  # (constants: no waiting code in the plain kernel)
        shift = 0
        epoch = 0
        deadline = 0
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if N2 > 0:
        b2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b2_desc.block_type.shape,
                                            b2_desc.layout)
    else:
        b2_bufs = b_bufs
    ready, empty, order = ring_barriers(STAGES, 1)
    # One staging tile per consumer for the subtiled TMA stores of C.
    c_smem0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    if PINGPONG:
        c_smem1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, order, c_smem0, c_desc,
                            bias_ptr, ws_ptr, cnt_ptr, p_desc, trace_ptr, M, N, K, dp_tiles,
                            split, plane_rows, shift, peers_ptr, offsets_ptr, slot_rows, rank,
                            world_size, HAS_BIAS, B_KN, GROUP_M, MODE, TMA_PARTS, TRACE, N2,
                            PUSH, 0, 2, num_warps)),
            (_ws_consumer_worker, (a_bufs, b_bufs, b2_bufs, ready, empty, order, c_smem1, c_desc,
                                   bias_ptr, ws_ptr, cnt_ptr, p_desc, trace_ptr, M, N, K,
                                   dp_tiles, split, plane_rows, shift, peers_ptr, offsets_ptr,
                                   slot_rows, rank, world_size, HAS_BIAS, B_KN, GROUP_M,
                                   MODE, TMA_PARTS, TRACE, N2, PUSH)),
            (_ws_loader, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N,
                          K, dp_tiles, split, shift, sig_ptr, offsets_ptr, err_claim, err_record,
                          rank, world_size, epoch, deadline, op_id, B_KN, GROUP_M, MODE, N2,
                          WAIT)),
        ], [4, 1], [_K_CONSUMER_REGS, _loader_regs(WAIT)])
    else:
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, order, c_smem0, c_desc,
                            bias_ptr, ws_ptr, cnt_ptr, p_desc, trace_ptr, M, N, K, dp_tiles,
                            split, plane_rows, shift, peers_ptr, offsets_ptr, slot_rows, rank,
                            world_size, HAS_BIAS, B_KN, GROUP_M, MODE, TMA_PARTS, TRACE, N2,
                            PUSH, 0, 1, num_warps)),
            (_ws_loader, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N,
                          K, dp_tiles, split, shift, sig_ptr, offsets_ptr, err_claim, err_record,
                          rank, world_size, epoch, deadline, op_id, B_KN, GROUP_M, MODE, N2,
                          WAIT)),
        ], [1], [_loader_regs(WAIT)])
