"""Kernels of ``ag_gemm``'s producers (the consumer is the core's ``persistent_gemm_kernel``):
the publish after a copy-engine copy, the SM pull producer, and the one-launch push call.

Above ``_ag_launch.PUSH_MAX_BYTES`` the all-gather is copy-engine work (no SM): after the start
barrier, a side stream copies this rank's shard into every rank's gathered buffer and then
``ag_publish_kernel`` writes the call's epoch into that rank's flag for it. Overlap schedule
(rank r of W=4)::

    main stream   start barrier | GEMM tiles of chunk r | chunk r+1 | chunk r+2 | chunk r+3
    side stream                 | copy A_r -> rank r, flag | -> rank r+1, flag | -> r+2 | -> r+3
                                  (copy engines)             ^ a tile waits for the flags of the
                                                               chunks its rows come from

Pull mode (``"pull"``, ``ag_pull_kernel``) runs the side stream's part on a few SMs instead:
each rank copies its own shard locally, announces it (``ready``), and pulls the peers' chunks
from their gathered buffers in the same order. Measured slower on one H200 (0.61-0.75x the
copy-engine path at W=4, the bench's ``producer`` rows), so copy engines stay the default.
History: benchmarks/NOTES.md, ag_gemm.

Push (``ag_gemm_push_kernel``, small gathers): the whole call is one kernel whose programs
first push this rank's rows into every rank that has started the call, then run the tiles
(``gemm_tiles``) as the consumer does: one launch instead of four, a copy and a stream fork
and join, for calls whose host cost exceeds their device time.

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
from ._core_kernels import gemm_tiles


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


@dl.jit(do_not_specialize=("M", "N", "K", "stride_cm", "stride_cn", "has_bias", "tail_tiles",
                           "rank", "world_size", "timeout_us", "op_id", "sa_row", "sb_row", "pitch",
                           "copiers"))
def ag_gemm_push_kernel(a_desc, b_desc, bh_desc, c_desc, c_ptr, bias_ptr, sig_ptr, sig_table,
                        offsets_ptr, src_ptr, buf_ptr, buf_table, err_claim, err_record, M, N, K,
                        stride_cm, stride_cn, has_bias, tail_tiles, rank, world_size, timeout_us,
                        op_id, sa_ptr, sb_ptr, sa_row, sb_row, pitch, copiers,
                        B_KN: tl.constexpr, C_TMA: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, SPLIT_TAIL: tl.constexpr, COPY_BLOCK: tl.constexpr,
                        SCALE: tl.constexpr = 0):
    """The whole fused call in one launch (the ``"push"`` producer, for small all-gathers whose
    eager host cost would otherwise be four launches, a copy and a stream fork and join):

    1. start: the call's epoch is the pad's completed-call count (word ``3W``) plus one; program
       0 counts this rank's start on every rank (``start[r]``, as the start barrier does);
    2. push: for each destination in consumer order (r, r+1, ...), once it has started this
       call (so its previous call's GEMM is done with its gathered buffer), the first
       ``copiers`` programs (all of them on a GPU; one in the interpreter, which runs programs
       one after another) copy their slices of this rank's rows (``src``, ``pitch`` elements a
       row) into it; the last of them to finish a destination writes its ``rows[r]`` and then
       its ``flag[r]`` (system-scope release), counting on the pad's words ``[5W, 6W)`` (reset
       by the last);
    3. the persistent tile loop (``gemm_tiles``), each tile waiting for its chunks' flags;
    4. the last program to finish stores the epoch as the completed-call count (``3W``;
       programs count on word ``6W``), which the start barrier of the copy-engine path reads
       too, so both producers may alternate on one workspace.

    All of a rank's programs are resident (grid within its SM share), so a tile's wait never
    needs a program that has not started; the interpreter runs one program per rank.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    w = world_size
    epoch = tl.load(sig_ptr + 3 * w, volatile=True).to(tl.int64) + 1
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    if pid == 0:
        for i in range(w):
            peer = (rank + i) % w
            dl.signal_add(dl.remote_ptr(sig_table, peer, sig_ptr) + w + rank, 1)
    lo = tl.load(offsets_ptr + rank).to(tl.int64)
    hi = tl.load(offsets_ptr + rank + 1).to(tl.int64)
    copiers = tl.minimum(copiers, nprog)
    if pid < copiers:
        for i in range(w):
            dst = (rank + i) % w
            ok = dl.wait_at_least(sig_ptr + w + dst, epoch, deadline, err_claim, err_record,
                                  op_id, rank, dst, epoch)
            if ok:
                dl.copy_tiles(dl.peer_base(buf_table, dst, rank, buf_ptr) + lo * pitch, src_ptr,
                              (hi - lo) * pitch, pid, copiers, COPY_BLOCK)
            tl.debug_barrier()
            count = sig_ptr + 5 * w + dst
            if tl.atomic_add(count, 1, sem="acq_rel", scope="sys") == copiers - 1:
                tl.store(count, 0)
                peer = dl.remote_ptr(sig_table, dst, sig_ptr)
                tl.store(peer + 2 * w + rank, hi - lo)
                dl.fence_sys()
                dl.signal_set(peer + rank, epoch)
    gemm_tiles(a_desc, b_desc, bh_desc, c_desc, c_ptr, bias_ptr, sig_ptr, offsets_ptr, err_claim,
               err_record, M, N, K, stride_cm, stride_cn, has_bias, tail_tiles, rank, w, epoch,
               deadline, op_id, sa_ptr, sb_ptr, sa_row, sb_row, B_KN, C_TMA, True, BLOCK_M,
               BLOCK_N, BLOCK_K, GROUP_M, SPLIT_TAIL, SCALE)
    tl.debug_barrier()
    if tl.atomic_add(sig_ptr + 6 * w, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.store(sig_ptr + 6 * w, 0)
        tl.store(sig_ptr + 3 * w, epoch)
