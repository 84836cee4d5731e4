"""The start barrier every fused op opens with (ag_gemm, one-shot gemm_ar, flash_decode).

One program bumps this rank's call count (the epoch at pad word ``3W``), stores the rows this
rank sends (``3W + 1``), adds 1 to ``start[r]`` (word ``W + r``) on every rank and waits until
every rank has started this call: a rank then knows its peers finished the previous call's
reads of its buffers (stream order), so one buffer suffices.
"""
from __future__ import annotations

import triton.language as tl

from ._jit import jit
from .signals import deadline_after, remote_ptr, signal_add, wait_at_least


@jit(do_not_specialize=("rank", "world_size", "rows", "timeout_us", "op_id"))
def start_barrier_kernel(sig_ptr, sig_table, err_claim, err_record, rank, world_size, rows,
                         timeout_us, op_id):
    """One program: bump this rank's epoch, tell every rank this call started, wait for all."""
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64) + 1
    tl.store(sig_ptr + 3 * world_size + 1, tl.cast(rows, tl.int64))
    tl.store(sig_ptr + 3 * world_size, epoch)
    for i in range(world_size):
        peer = (rank + i) % world_size
        signal_add(remote_ptr(sig_table, peer, sig_ptr) + world_size + rank, 1)
    deadline = deadline_after(timeout_us.to(tl.int64) * 1000)
    for s in range(world_size):
        wait_at_least(sig_ptr + world_size + s, epoch, deadline, err_claim, err_record, op_id,
                      rank, s, epoch)
