"""Kernels of ``ag_gemm``: a start barrier, a persistent GEMM consumer, and the SM pull producer.

The all-gather is copy-engine work by default (``_launch.PRODUCER = "copy"``, no SM): after the
start barrier, a side stream copies this rank's shard into every rank's gathered buffer and then
writes the call's epoch into that rank's flag for it. Overlap schedule (rank r of W=4)::

    main stream   start barrier | GEMM tiles of chunk r | chunk r+1 | chunk r+2 | chunk r+3
    side stream                 | copy A_r -> rank r, flag | -> rank r+1, flag | -> r+2 | -> r+3
                                  (copy engines)             ^ a tile waits for the flags of the
                                                               chunks its rows come from

Pull mode (``"pull"``, ``ag_pull_kernel``) runs the side stream's part on a few SMs instead:
each rank copies its own shard locally, announces it (``ready``), and pulls the peers' chunks
from their gathered buffers in the same order. Measured slower on one H200 (the bench's
``producer`` rows), so copy engines stay the default.

Signal pad words of the ``ag_gemm`` workspace (W = world size)::

    [0, W)     flag[s]     epoch of the last call whose chunk from rank s has landed here
    [W, 2W)    start[s]    calls rank s has started (cumulative, written by its start barrier)
    [2W, 3W)   rows[s]     rows rank s sent in the last call (size check)
    3W         epoch       calls started by this rank (the start barrier bumps it)
    3W + 1     rows        this rank's rows for the current call (source of peers' rows[r])
    [4W, 5W)   ready[s]    pull mode: epoch of the last call whose rows rank s has in its buffer
    [5W, 6W)   count[s]    pull mode: programs done with chunk s (reset by the last)

The start barrier makes a call wait until every rank has started it, i.e. has finished the
previous call's GEMM (stream order), so one gathered buffer suffices: nobody overwrites rows a
slow peer still reads. The flags hold epochs (set, never reset), so CUDA-graph replays work.

Gather-mode swizzle: the persistent programs walk M tiles starting at the tile holding this
rank's first row, so they begin with rows that are copied first (the local copy) and reach
peers' chunks in the order the producer delivers them; a tile straddling chunks waits for each
of them.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl
from ..collectives._kernels import _copy_tiles


@dl.jit(do_not_specialize=("rank", "world_size", "rows", "timeout_us", "op_id"))
def ag_start_kernel(sig_ptr, sig_table, err_claim, err_record, rank, world_size, rows,
                    timeout_us, op_id):
    """One program: bump this rank's epoch, tell every rank this call started, wait for all."""
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64) + 1
    tl.store(sig_ptr + 3 * world_size + 1, tl.cast(rows, tl.int64))
    tl.store(sig_ptr + 3 * world_size, epoch)
    for i in range(world_size):
        peer = (rank + i) % world_size
        dl.signal_add(dl.remote_ptr(sig_table, peer, sig_ptr) + world_size + rank, 1)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    for s in range(world_size):
        dl.wait_at_least(sig_ptr + world_size + s, epoch, deadline, err_claim, err_record,
                         op_id, rank, s, epoch)


@dl.jit(do_not_specialize=("rank", "world_size", "pitch", "timeout_us", "op_id"))
def ag_pull_kernel(src_ptr, buf_ptr, buf_table, sig_ptr, sig_table, offsets_ptr, err_claim,
                   err_record, rank, world_size, pitch, timeout_us, op_id, BLOCK: tl.constexpr,
                   VEC: tl.constexpr):
    """Pull-mode producer (SMs instead of copy engines), launched on the side stream after the
    start barrier with a few programs. Chunk by chunk in consumer order (r, r+1, ...): all
    programs copy a slice of the chunk into the local gathered buffer (chunk r from ``src``,
    this rank's shard; chunk s from rank s's gathered buffer once ``ready[s]`` says its rows are
    there), then the last program to finish flags it (``flag[s] = epoch``); for chunk r it first
    writes this call's rows into every rank's ``rows[r]`` (size check) and tells every peer
    ``ready[r] = epoch``. (Reading a peer's own rows word instead would race with its next call.)

    Pad words beyond the ``ag_gemm`` layout: ``ready[s]`` at ``4W + s``, the per-chunk program
    count at ``5W + s`` (reset by the last program). ``VEC`` elements are 16 bytes (``pitch`` is
    a multiple of it, so the copies vectorize).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    pitch = pitch // VEC * VEC
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    for i in range(world_size):
        s = (rank + i) % world_size
        lo = tl.load(offsets_ptr + s).to(tl.int64)
        hi = tl.load(offsets_ptr + s + 1).to(tl.int64)
        src = src_ptr
        ok = epoch >= 0
        if i > 0:
            ok = dl.wait_at_least(sig_ptr + 4 * world_size + s, epoch, deadline, err_claim,
                                  err_record, op_id, rank, s, epoch)
            src = dl.peer_base(buf_table, s, rank, buf_ptr) + lo * pitch
        if ok:
            _copy_tiles(buf_ptr + lo * pitch, src, (hi - lo) * pitch, pid, nprog, BLOCK)
        tl.debug_barrier()
        count = sig_ptr + 5 * world_size + s
        if tl.atomic_add(count, 1, sem="acq_rel", scope="sys") == nprog - 1:
            tl.store(count, 0)
            if i == 0:  # this call's rows to every rank's size check, then ready[r] to peers
                sent = tl.load(sig_ptr + 3 * world_size + 1)
                for j in range(world_size):
                    tl.store(dl.remote_ptr(sig_table, j, sig_ptr) + 2 * world_size + rank, sent)
                dl.fence_sys()
                for j in range(1, world_size):
                    peer = dl.remote_ptr(sig_table, (rank + j) % world_size, sig_ptr)
                    dl.signal_set(peer + 4 * world_size + rank, epoch)
            dl.fence_sys()
            dl.signal_set(sig_ptr + s, epoch)


@dl.jit
def _tile_coords(tile, tiles_m, group_tiles, shift, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) tile order, M rotated by ``shift`` tiles (gather-mode swizzle)."""
    first_m = (tile // group_tiles) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = (first_m + (tile % group_tiles) % size_m + shift) % tiles_m
    pid_n = (tile % group_tiles) // size_m
    return pid_m, pid_n


@dl.jit
def tile_matmul(a_desc, b_desc, acc, off_m, off_n, K, B_KN: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc += A[off_m:, :K] @ B[:K, off_n:]`` over fixed ``BLOCK_K`` steps (TMA loads; B as
    ``[K, N]`` when ``B_KN`` else as ``[N, K]`` transposed). The K order never depends on M."""
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, ki * BLOCK_K])
        if B_KN:
            b = b_desc.load([ki * BLOCK_K, off_n])
        else:
            b = b_desc.load([off_n, ki * BLOCK_K]).T
        acc = tl.dot(a, b, acc)
    return acc


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
                           "rank", "world_size", "timeout_us", "op_id"))
def ag_gemm_kernel(a_desc, b_desc, bh_desc, c_desc, c_ptr, bias_ptr, sig_ptr, offsets_ptr,
                   err_claim, err_record, M, N, K, stride_cm, stride_cn, has_bias, tail_tiles,
                   rank, world_size, timeout_us, op_id,
                   B_KN: tl.constexpr, C_TMA: tl.constexpr, WAIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, SPLIT_TAIL: tl.constexpr = False):
    """Persistent GEMM ``C[M, N] = A[M, K] @ B[K, N] (+ bias)``; with ``WAIT`` A is the gathered
    buffer and each tile first waits for the chunks its rows come from.

    ``B_KN``: ``b_desc`` is over ``B [K, N]``, else over ``B^T [N, K]`` (a Linear weight).
    ``C_TMA``: C is stored through ``c_desc`` (blocks ``[BLOCK_M, BLOCK_N / 2]``), else with
    masked pointer stores (any strides).
    ``SPLIT_TAIL``: the last ``tail_tiles`` tiles (the host passes a partial last wave, at most
    half the grid, and 0 otherwise; the first ``tiles - tail_tiles`` are then a whole number of
    waves) run after the main loop as twice as many ``BLOCK_N / 2`` wide half tiles through
    ``bh_desc`` (B in half-width blocks), so the last wave is spread over up to twice the
    programs and takes about half as long (a half past N is skipped).
    (No flattened tile + K loop: ``tl.range(flatten=True)`` measured 0.75-0.83x cuBLAS in this
    kernel on the H200 against 0.89-0.96x plain, see ``_launch.GPU_CONFIGS``.)
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    main_tiles = tiles_m * tiles_n - tail_tiles  # (the host passes 0 without SPLIT_TAIL)
    group_tiles = GROUP_M * tiles_n
    shift = 0
    epoch = tl.zeros((), tl.int64)
    deadline = tl.zeros((), tl.int64)
    if WAIT:
        epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
        shift = tl.load(offsets_ptr + rank) // BLOCK_M  # own rows first
        deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    seen = tl.zeros((), tl.int64)  # chunks this program has seen land
    for tile in range(pid, main_tiles, nprog):
        pid_m, pid_n = _tile_coords(tile, tiles_m, group_tiles, shift, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if WAIT:
            seen = _wait_rows(sig_ptr, offsets_ptr, off_m, tl.minimum(off_m + BLOCK_M, M), rank,
                              world_size, epoch, deadline, err_claim, err_record, op_id, seen)
        # A zero accumulator (the first MMA need not read it) and the bias added after the K
        # loop (H200, one run: a plain kernel of the same tiles without the bias seed ran 1.4%
        # faster than this one with it).
        acc = tile_matmul(a_desc, b_desc, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), off_m,
                          off_n, K, B_KN, BLOCK_K)
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
                acc = tile_matmul(a_desc, bh_desc, tl.zeros((BLOCK_M, HALF), dtype=tl.float32),
                                  off_m, off_n, K, B_KN, BLOCK_K)
                _store_tile(acc, c_desc, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm,
                            stride_cn, has_bias, C_TMA, False)
