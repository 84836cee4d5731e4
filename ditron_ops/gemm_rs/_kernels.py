"""Kernels of ``gemm_rs`` / ``gemm_ar``: partial GEMM with scattered epilogue stores, then a
rank-ordered reduction.

Schedule of one call (rank r, one stream; ``ag_start_kernel`` is the start barrier)::

    start barrier | GEMM a_r @ b_r, tiles of rank r+1's rows first ... own rows last;  | finish:
                  | each fp32 tile stored into slot r of its owner's buffer            | flag owners,
                  | (one-shot all-reduce: into slot r of every rank)                   | wait all flags,
                  |                                                                    | out = slot 0 + slot 1 + ...

Scatter-mode swizzle: a rank computes first the tiles its peers need and its own rows last, so
the stores to peers (NVLink on multi-GPU) overlap the rest of its GEMM. The partials stay fp32
and the owner adds them in rank order 0..W-1 and rounds once: the result does not depend on
arrival order, and with the fixed tile configuration each output row depends only on its own
input row (batch invariance).

Signal pad (the ``ag_gemm`` layout): ``flag[s]`` at ``s`` = epoch of the last call whose
partials from rank s have landed; start counts at ``[W, 2W)``; epoch at ``3W``.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl
from ..ag_gemm._kernels import _tile_coords, tile_matmul


@dl.jit(do_not_specialize=("M", "N", "K", "slot_rows", "rank", "world_size"))
def gemm_scatter_kernel(a_desc, b_desc, buf_ptr, buf_table, offsets_ptr, M, N, K, slot_rows,
                        rank, world_size,
                        BROADCAST: tl.constexpr, B_KN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in fp32 tiles; rows ``offsets[s]..offsets[s+1]`` go to slot
    ``rank`` of rank s (``BROADCAST``: every row to slot ``rank`` of every rank)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_tiles = GROUP_M * tiles_n
    if BROADCAST:
        shift = 0
    else:
        shift = tl.load(offsets_ptr + (rank + 1) % world_size) // BLOCK_M  # peers' rows first
    for tile in range(pid, tiles_m * tiles_n, nprog):
        pid_m, pid_n = _tile_coords(tile, tiles_m, group_tiles, shift, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tile_matmul(a_desc, b_desc, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                          off_m, off_n, K, B_KN, BLOCK_K)
        # Store in two BLOCK_N/2 halves: half the live address registers (no spills).
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(halves)
        _store_partial(acc0, buf_ptr, buf_table, offsets_ptr, off_m, off_n, M, N, slot_rows, rank,
                       world_size, BROADCAST, BLOCK_M, BLOCK_N // 2)
        _store_partial(acc1, buf_ptr, buf_table, offsets_ptr, off_m, off_n + BLOCK_N // 2, M, N,
                       slot_rows, rank, world_size, BROADCAST, BLOCK_M, BLOCK_N // 2)


@dl.jit
def _store_partial(acc, buf_ptr, buf_table, offsets_ptr, off_m, off_n, M, N, slot_rows, rank,
                   world_size, BROADCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store an fp32 tile at rows ``off_m..``, columns ``off_n..`` into slot ``rank`` of the
    owners of those rows (every rank with ``BROADCAST``)."""
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    col_ok = (rn < N)[None, :]
    slot = rank.to(tl.int64) * slot_rows * N
    if BROADCAST:
        for i in range(world_size):
            dst = (rank + 1 + i) % world_size
            base = dl.remote_ptr(buf_table, dst, buf_ptr) + slot + off_m.to(tl.int64) * N
            tl.store(base + (rm - off_m)[:, None] * N + rn[None, :], acc,
                     mask=(rm < M)[:, None] & col_ok)
    else:
        for s in range(world_size):
            lo = tl.load(offsets_ptr + s)
            hi = tl.load(offsets_ptr + s + 1)
            if (lo < off_m + BLOCK_M) & (hi > off_m):
                base = dl.remote_ptr(buf_table, s, buf_ptr) + slot + (off_m - lo).to(tl.int64) * N
                mine = (rm >= lo) & (rm < hi)
                tl.store(base + (rm - off_m)[:, None] * N + rn[None, :], acc,
                         mask=mine[:, None] & col_ok)


@dl.jit(do_not_specialize=("rows", "N", "stride_om", "slot_rows", "rank", "world_size",
                           "timeout_us", "op_id"))
def reduce_finish_kernel(buf_ptr, out_ptr, sig_ptr, sig_table, err_claim, err_record, rows, N,
                         stride_om, slot_rows, rank, world_size, timeout_us, op_id,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Flag every rank that this rank's partials have landed (they were stored by the previous
    kernel on this stream), wait for every rank's flag, then sum the slots in rank order."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
    if pid == 0:
        dl.fence_sys()
        for i in range(world_size):
            dst = (rank + i) % world_size
            dl.signal_set(dl.remote_ptr(sig_table, dst, sig_ptr) + rank, epoch)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    ok = pid >= 0
    for s in range(world_size):
        ok = ok & dl.wait_at_least(sig_ptr + s, epoch, deadline, err_claim, err_record, op_id,
                                   rank, s, epoch)
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
