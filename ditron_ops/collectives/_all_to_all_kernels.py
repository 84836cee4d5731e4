"""Kernel of ``all_to_all``: push every destination its part, already in the output layout.

Canonical view (host side, ``all_to_all._canonical``): the input is ``[P0, Dp, P1, Dq, P2]``
with ``p < q`` the two exchanged dims (``P2`` the contiguous elements after ``q``). Part ``d``
of rank ``r`` is a set of ``rows = P0 x LP x P1`` rows of ``run = LQ x P2`` contiguous
elements; a row's offset in the source and in rank ``d``'s staging (laid out as the output)::

    src row (p0, i, p1) = ((p0 SDP + d A1 + i) P1 + p1) SDQ P2 + d A3 P2
    dst row (p0, i, p1) = ((p0 DDP + r A2 + i) P1 + p1) DDQ P2 + r A4 P2

so no permute runs anywhere: the addressing does it. Schedule (rank r, P programs)::

    for d in r, r+1, ..., r-1:  copy part d -> half e%2 of rank d's staging (tiles p, p+P, ..)
                                (program 0) meta[e%2][r] of d = shape fingerprint
                                signal_add(arrivals[r] of d): 1 per program, + UNIT - P from 0
    wait arrivals[s] >= e * UNIT for every s (acquire, bounded); check fingerprints
    copy half e%2 of the staging -> out (one flat copy: it is the output layout)
    last program to finish: epoch = e

A call adds exactly ``UNIT`` to ``arrivals[r]`` of every rank, whatever the number of programs,
and a rank's calls are stream ordered, so ``arrivals[s] >= e * UNIT`` means all of rank s's
call ``e`` has landed. Halves alternate with the epoch: a rank writes half ``e % 2`` of a peer
again at ``e + 2``, after it waited for that peer's ``e + 1`` data, which the peer pushes only
after it finished copying out call ``e``.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl

UNIT = tl.constexpr(16777216)
"""What one call adds to each ``arrivals`` word (2^24; more than the programs of any grid)."""


@dl.jit
def _copy_part(src, dst, rows, run, p1, lp, sdp, sdq, ddp, ddq, p2, pid, nprog,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``(p0, i, p1)`` of one part, ``run`` elements each, tiles ``pid, pid + nprog, ..``."""
    col_blocks = tl.cdiv(run, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    for t in range(pid, tl.cdiv(rows, BLOCK_R) * col_blocks, nprog):
        row = ((t // col_blocks) * BLOCK_R + offs_r).to(tl.int64)
        col = (t % col_blocks) * BLOCK_C + offs_c
        pp1 = row % p1
        rest = row // p1
        i = rest % lp
        p0 = rest // lp
        s_off = ((p0 * sdp + i) * p1 + pp1) * (sdq * p2)
        d_off = ((p0 * ddp + i) * p1 + pp1) * (ddq * p2)
        mask = (row < rows)[:, None] & (col < run)[None, :]
        x = tl.load(src + s_off[:, None] + col[None, :], mask=mask)
        tl.store(dst + d_off[:, None] + col[None, :], x, mask=mask)


@dl.jit(do_not_specialize=("rank", "world_size", "p0", "lp", "p1", "lq", "p2", "sdp", "a1", "ddp",
                           "a2", "sdq", "a3", "ddq", "a4", "numel", "half_elems", "fingerprint",
                           "timeout_us", "op_id"))
def all_to_all_kernel(x_ptr, out_ptr, buf_ptr, buf_table, sig_ptr, sig_table, err_claim,
                      err_record, rank, world_size, p0, lp, p1, lq, p2, sdp, a1, ddp, a2, sdq, a3,
                      ddq, a4, numel, half_elems, fingerprint, timeout_us, op_id,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr):
    """One all-to-all call (schedule in the module docstring). ``VEC`` divides ``p2`` and
    ``half_elems`` (the host checks), so rows start on 16-byte boundaries and copies vectorize."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64) + 1
    parity = epoch % 2
    unit = tl.full((), UNIT, tl.int64)
    p2 = p2 // VEC * VEC
    half_base = parity * (half_elems // VEC * VEC)
    numel = numel // VEC * VEC  # a multiple of p2
    rows = p0.to(tl.int64) * lp * p1
    run = lq * p2
    for i in range(world_size):
        d = (rank + i) % world_size
        src = x_ptr + (d * a1).to(tl.int64) * p1 * sdq * p2 + d * a3 * p2
        dst = (dl.peer_base(buf_table, d, rank, buf_ptr) + half_base
               + (rank * a2).to(tl.int64) * p1 * ddq * p2 + rank * a4 * p2)
        _copy_part(src, dst, rows, run, p1, lp, sdp, sdq, ddp, ddq, p2, pid, nprog, BLOCK_R,
                   BLOCK_C)
        peer_sig = dl.remote_ptr(sig_table, d, sig_ptr)
        if pid == 0:
            tl.store(peer_sig + world_size + parity * world_size + rank, fingerprint.to(tl.int64))
        dl.signal_add(peer_sig + rank, tl.where(pid == 0, unit - nprog + 1, 1))

    ok = pid >= 0
    for s in range(world_size):
        if ok:
            deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
            ok = dl.wait_at_least(sig_ptr + s, epoch * UNIT, deadline, err_claim, err_record,
                                  op_id, rank, s, epoch)
            if ok:
                got = tl.load(sig_ptr + world_size + parity * world_size + s, volatile=True)
                if got != fingerprint:
                    dl.record_error(err_claim, err_record, op_id, rank, s, epoch,
                                    dl.SIZE_MISMATCH)
                ok = ok & (got == fingerprint)
    if ok:
        offs = tl.arange(0, BLOCK_R * BLOCK_C)
        for off in range(pid * BLOCK_R * BLOCK_C, numel, nprog * BLOCK_R * BLOCK_C):
            mask = off + offs < numel
            x = tl.load(buf_ptr + half_base + off + offs, mask=mask, cache_modifier=".cg")
            tl.store(out_ptr + off + offs, x, mask=mask)

    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + 3 * world_size + 1, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.store(sig_ptr + 3 * world_size, epoch)
        tl.store(sig_ptr + 3 * world_size + 1, 0)
