"""The one kernel behind every standalone collective: push to peers, then combine locally.

Each rank runs ``P`` programs (fixed per workspace). For a call of epoch ``e`` (read from the
signal pad, so CUDA-graph replays keep counting)::

    rank r, program p                                   rank d (any peer, d may be r)
    ------------------------------------------------    -----------------------------------
    for d in (r, r+1, ..., r-1) mod W:
        copy my part for d, tiles p, p+P, ...   ----->   data[e%2][slot r]
        (program 0) meta[e%2][r] = #elements    ----->   signal pad
        signal_add(arrivals[r] of d, 1) release ----->   arrivals[r] += 1
    for s in 0..W-1: wait arrivals[s] >= e*P (acquire, bounded by the deadline)
    combine data[e%2][slot 0..W-1] into out:
        GATHER: copy slot s to out[offset_s:] (offsets from meta: uneven shards work)
        REDUCE: out = (((0 + slot0) + slot1) + ...) in fp32, one rounding   (rank order)
    last program to finish: epoch = e

``SPLIT_SRC`` sends destination d only its row chunk ``split(src_rows, W)[d]`` (reduce-scatter);
otherwise every destination gets the whole input (all-gather, one-shot all-reduce).
``VEC`` divides every row length, slot and offset (the host picks 16 bytes' worth of elements when
the sizes allow it, else 1), so the copies vectorize to 16-byte accesses.
Data halves are fixed regions of the workspace (``half_elems`` each), so calls of different sizes
never overlap the half a slow peer may still be reading.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl


@dl.jit
def _split_start(rows, world_size, part):
    """First row of part ``part`` when ``rows`` are split over ``world_size`` ranks."""
    base = rows // world_size
    return part * base + tl.minimum(part, rows % world_size)


@dl.jit(do_not_specialize=("rank", "world_size", "src_rows", "row_elems", "out_elems", "half_elems",
                           "slot_elems", "timeout_us", "op_id"))
def push_combine_kernel(
    src_ptr, out_ptr, buf_ptr, buf_table, sig_ptr, sig_table, err_claim, err_record,
    rank, world_size, src_rows, row_elems, out_elems, half_elems, slot_elems, timeout_us, op_id,
    SPLIT_SRC: tl.constexpr, REDUCE: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    # Signal-pad words are written by other programs/ranks: volatile loads skip the L1 cache.
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64) + 1
    parity = epoch % 2
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    # ``x // VEC * VEC`` (exact: the host guarantees divisibility) tells the compiler that sizes
    # and offsets are multiples of VEC, so loads and stores vectorize; scalar hints do not.
    half_elems = half_elems // VEC * VEC
    slot_elems = slot_elems // VEC * VEC
    half_base = parity * half_elems
    row_elems = row_elems // VEC * VEC
    out_elems = out_elems // VEC * VEC

    # ---- push this rank's data into every rank's slot ``rank`` ---------------------------------
    for i in range(world_size):
        dst = (rank + i) % world_size
        if SPLIT_SRC:
            start = _split_start(src_rows, world_size, dst)
            count = (_split_start(src_rows, world_size, dst + 1) - start) * row_elems
            src_base = src_ptr + start * row_elems
        else:
            count = src_rows * row_elems
            src_base = src_ptr
        dst_base = dl.remote_ptr(buf_table, dst, buf_ptr) + half_base + rank * slot_elems
        dl.copy_tiles(dst_base, src_base, count, pid, nprog, BLOCK)
        dst_sig = dl.remote_ptr(sig_table, dst, sig_ptr)
        if pid == 0:
            tl.store(dst_sig + world_size + parity * world_size + rank, count.to(tl.int64))
        dl.signal_add(dst_sig + rank, 1)

    # ---- wait for every rank's data in this rank's slots ----------------------------------------
    ok = pid >= 0
    for s in range(world_size):
        arrived = dl.wait_at_least(sig_ptr + s, epoch * nprog, deadline, err_claim, err_record,
                                   op_id, rank, s, epoch)
        ok = ok & arrived
    total = tl.zeros((), tl.int64)
    if ok:
        for s in range(world_size):
            got = tl.load(sig_ptr + world_size + parity * world_size + s, volatile=True)
            if REDUCE:
                if got != out_elems:
                    dl.record_error(err_claim, err_record, op_id, rank, s, epoch, dl.SIZE_MISMATCH)
                ok = ok & (got == out_elems)
            total += got
        if not REDUCE:
            if total != out_elems:
                dl.record_error(err_claim, err_record, op_id, rank, -1, epoch, dl.SIZE_MISMATCH)
            ok = ok & (total == out_elems)

    # ---- combine ------------------------------------------------------------------------------
    if ok:
        if REDUCE:
            for off in range(pid * BLOCK, out_elems, nprog * BLOCK):
                off = tl.multiple_of(off, BLOCK)
                mask = off + offs < out_elems
                acc = tl.zeros((BLOCK,), tl.float32)
                for s in range(world_size):
                    x = tl.load(buf_ptr + half_base + s * slot_elems + off + offs, mask=mask,
                                cache_modifier=".cg")  # peers wrote it: bypass L1
                    acc += x.to(tl.float32)
                tl.store(out_ptr + off + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            dst_vecs = tl.zeros((), tl.int64)
            for s in range(world_size):
                got = tl.minimum(tl.load(sig_ptr + world_size + parity * world_size + s, volatile=True),
                                 slot_elems)
                got = got // VEC * VEC
                dl.copy_tiles(out_ptr + dst_vecs * VEC, buf_ptr + half_base + s * slot_elems,
                            got, pid, nprog, BLOCK)
                dst_vecs += got // VEC

    # ---- the last program to finish publishes the epoch ---------------------------------------
    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + 3 * world_size + 1, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.store(sig_ptr + 3 * world_size, epoch)
        tl.store(sig_ptr + 3 * world_size + 1, 0)
