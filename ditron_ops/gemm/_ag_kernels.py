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
from their gathered buffers in the same order. Measured slower on one H200 (0.61-0.75x the
copy-engine path at W=4, the bench's ``producer`` rows), so copy engines stay the default.
History: benchmarks/NOTES.md, ag_gemm.

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
            dl.copy_tiles(buf_ptr + lo * pitch, src, (hi - lo) * pitch, pid, nprog, BLOCK)
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


@dl.jit(do_not_specialize=("dst", "rank", "world_size"))
def ag_publish_kernel(sig_ptr, sig_table, dst, rank, world_size):
    """Copy-engine producer: after this rank's chunk has been copied into rank ``dst``'s
    gathered buffer (stream order), tell ``dst`` how many rows came (``rows[r]``, from this
    rank's word ``3W + 1``) and then that they landed (``flag[r]`` = this call's epoch, word
    ``3W``), with a system-scope release. One program; the words are this rank's device values,
    so CUDA-graph replays publish each replay's epoch."""
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True)
    rows = tl.load(sig_ptr + 3 * world_size + 1, volatile=True)
    peer = dl.remote_ptr(sig_table, dst, sig_ptr)
    tl.store(peer + 2 * world_size + rank, rows)
    dl.fence_sys()
    dl.signal_set(peer + rank, epoch)
