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
                           "timeout_ns", "op_id"))
def push_combine_kernel(
    src_ptr, out_ptr, buf_ptr, buf_table, sig_ptr, sig_table, err_claim, err_record,
    rank, world_size, src_rows, row_elems, out_elems, half_elems, timeout_ns, op_id,
    SPLIT_SRC: tl.constexpr, REDUCE: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    epoch = tl.load(sig_ptr + 3 * world_size).to(tl.int64) + 1
    parity = epoch % 2
    deadline = dl.deadline_after(timeout_ns)
    slot_elems = half_elems // world_size
    half_base = parity * half_elems

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
        for off in range(pid * BLOCK, count, nprog * BLOCK):
            mask = off + offs < count
            tl.store(dst_base + off + offs, tl.load(src_base + off + offs, mask=mask), mask=mask)
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
            got = tl.load(sig_ptr + world_size + parity * world_size + s)
            if REDUCE:
                if got != out_elems:
                    dl.record_error(err_claim, err_record, op_id, rank, s, epoch, dl.KIND_SIZE_MISMATCH)
                ok = ok & (got == out_elems)
            total += got
        if not REDUCE:
            if total != out_elems:
                dl.record_error(err_claim, err_record, op_id, rank, -1, epoch, dl.KIND_SIZE_MISMATCH)
            ok = ok & (total == out_elems)

    # ---- combine ------------------------------------------------------------------------------
    if ok:
        if REDUCE:
            for off in range(pid * BLOCK, out_elems, nprog * BLOCK):
                mask = off + offs < out_elems
                acc = tl.zeros((BLOCK,), tl.float32)
                for s in range(world_size):
                    x = tl.load(buf_ptr + half_base + s * slot_elems + off + offs, mask=mask)
                    acc += x.to(tl.float32)
                tl.store(out_ptr + off + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            dst_off = tl.zeros((), tl.int64)
            for s in range(world_size):
                got = tl.load(sig_ptr + world_size + parity * world_size + s)
                for off in range(pid * BLOCK, got, nprog * BLOCK):
                    mask = off + offs < got
                    x = tl.load(buf_ptr + half_base + s * slot_elems + off + offs, mask=mask)
                    tl.store(out_ptr + dst_off + off + offs, x, mask=mask)
                dst_off += got

    # ---- the last program to finish publishes the epoch ---------------------------------------
    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + 3 * world_size + 1, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.store(sig_ptr + 3 * world_size, epoch)
        tl.store(sig_ptr + 3 * world_size + 1, 0)
