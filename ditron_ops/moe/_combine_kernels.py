"""The MoE combine kernel: every token's expert outputs back to it, weighted and summed.

Terms as in ``_kernels`` (entries ``i = t * k + j``, compact rows, ``dest[i] = owner * CAP +
compact row``). One combine (rank r, P programs, one per SM)::

    publish my expert outputs        in place (all ranks' tensors addressable: a virtual world):
                                       rowmap[f] = row of y holding compact row f; no copy
                                     staged (other backends): y's kept rows -> my symmetric
                                       staging in compact order (skipped when y is the staging)
                                     where they are into my signal pad: y's (or the staging's)
                                       offset from my staging base, row stride, mapped or not
    ready_c[r] += 1 on every rank    (release)
    wait ready_c[s] >= epoch * P     (acquire)
    routes                           route[i] = element offset, from my staging base, of the row
                                       holding entry i on its owner (one pass over my units'
                                       entries, all loads in flight; each owner's own mode)
    sum                              per unit (BLOCK_T tokens x a segment of hidden chunks):
                                       routes and weights of the next unit loaded meanwhile;
                                       per chunk the k rows' loads all issued, then
                                       out[t] = ((0 + w_t0 * y[row_t0]) + w_t1 * y[row_t1]) + ...
                                       fp32, k order, one rounding
    finish_c[r] += 1 on every rank; wait finish_c[s] >= epoch * P   (peers are done reading my
      rows, so my caller may write them again: y, or the staging for zero-copy inputs)

Why this shape (H200, W = 8 virtual ranks sharing 132 SMs, 15 programs each): the combine moves
about ``k H`` bytes read per token and streams them from HBM, so it is bound by the bytes in
flight per SM, not by arithmetic. The routing (slot rows, weights) is resolved once per entry
in the route pass and loaded once per unit, a unit ahead, so no dependent load chain sits
between a step's row loads: each of the 16 warps issues its k 16-byte loads back to back (8 KB
x k per SM per step) and never waits for another warp. A staged combine moves 3 + 1/k bytes of
memory traffic per byte it sums (y read, staging written, staging read, out written), an
in-place one 1 + 1/k. Units are token blocks while there are SPREAD of them per program, else
token blocks x hidden segments, so small token counts still spread over all programs; the work
split never changes the arithmetic of an element (bitwise the same for any split, any batch).

The products are not fused into FMAs (``enable_fp_fusion=False``), so a torch reference of the
same operations is bitwise equal.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl
from ._kernels import SIG_DONE_C, SIG_EPOCH_C, SIG_READY_D, _compact_row, _copy_rows

SIG_Y_OFF = tl.constexpr(4)  # where a rank's combine rows are: byte offset from its staging base,
SIG_Y_STRIDE = tl.constexpr(5)  # row stride (elements),
SIG_Y_MAPPED = tl.constexpr(6)  # 1: row of compact row f = rowmap[f] (in place), 0: f (staged)
_NO_ROUTE = tl.constexpr(-(2**62))  # an entry without a row (a multiple of every VEC)


@dl.jit
def _publish_rows(y_ptr, y_stride, sig_ptr, yst_sym, rowmap_sym, counts_ptr, offsets_ptr, cstart_ptr,
                  EL, capacity, pid, nprog, BLOCK_F: tl.constexpr, BLOCK_S: tl.constexpr):
    """In-place combine, owner side: where my expert outputs are, for my peers to read them in
    place. ``rowmap[f]`` = the row of y holding compact row f (-1: not kept)."""
    total = tl.minimum(tl.load(cstart_ptr + EL), capacity)
    for f0 in range(pid * BLOCK_F, total, nprog * BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        f_ok = f < total
        row, keep = _compact_row(f, f_ok, cstart_ptr, counts_ptr, offsets_ptr, EL, BLOCK_S)
        tl.store(rowmap_sym + f, tl.where(keep, row, -1), mask=f_ok)


@dl.jit
def _route_entries(route_ptr, dest_ptr, table_ptr, sig_ptr, yst_sym, rowmap_sym, rank, capacity,
                   n_tokens, n_mine, seg_count, pid, nprog, TOPK: tl.constexpr, KP: tl.constexpr,
                   BLOCK_T: tl.constexpr, UNITS: tl.constexpr):
    """The entries of this program's units (UNITS units per step, their loads all in flight):
    ``route[t * k + j]`` = element offset, from my staging base, of the row holding entry
    (t, j) on its owner, ``_NO_ROUTE`` if dropped. Each owner said where its rows are (its
    signal pad): y's offset from its staging base and row stride, and whether its rows are
    mapped (in place: the row of compact row f is ``rowmap[f]``) or compact (staged: row f)."""
    elem: tl.constexpr = yst_sym.dtype.element_ty.primitive_bitwidth // 8
    lane = tl.arange(0, UNITS * BLOCK_T * KP)
    j = lane % KP
    t = (lane // KP) % BLOCK_T
    i = lane // (KP * BLOCK_T)
    me = tl.load(table_ptr + rank)
    for i0 in range(0, n_mine, UNITS):
        tok = ((pid + (i0 + i) * nprog) // seg_count) * BLOCK_T + t
        ok = (i0 + i < n_mine) & (tok < n_tokens) & (j < TOPK)
        e = tok * TOPK + j
        d = tl.load(dest_ptr + e, mask=ok, other=-1)
        valid = d >= 0
        safe = tl.maximum(d, 0)
        compact = safe % capacity
        delta = tl.load(table_ptr + safe // capacity, mask=valid, other=0) - me  # bytes, 16 | delta
        owner_sig = sig_ptr + delta // 8
        y_off = tl.load(owner_sig + SIG_Y_OFF, mask=valid, other=0, cache_modifier=".cg")
        y_stride = tl.load(owner_sig + SIG_Y_STRIDE, mask=valid, other=0, cache_modifier=".cg")
        mapped = tl.load(owner_sig + SIG_Y_MAPPED, mask=valid, other=0, cache_modifier=".cg") != 0
        row = tl.load(rowmap_sym + delta // 4 + compact, mask=valid & mapped, other=0, cache_modifier=".cg")
        row = tl.where(mapped, row, compact)
        off = (delta + y_off) // 16 * (16 // elem) + row.to(tl.int64) * y_stride
        tl.store(route_ptr + e, tl.where(valid, off, _NO_ROUTE), mask=ok)


@dl.jit
def _unit_routes(route_ptr, w_ptr, u, seg_count, n_tokens, has_w, TOPK: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Routing of unit ``u``'s tokens, one ``[BLOCK_T]`` tensor per slot: (row offsets, weights)."""
    tok = (u // seg_count) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < n_tokens
    offs = ()
    ws = ()
    for jj in tl.static_range(TOPK):
        e = tok * TOPK + jj
        offs = offs + (tl.load(route_ptr + e, mask=t_ok, other=_NO_ROUTE, cache_modifier=".cg"),)
        ws = ws + (tl.load(w_ptr + e, mask=t_ok & (has_w != 0), other=1.0),)
    return offs, ws


@dl.jit(do_not_specialize=(
    "n_tokens", "copy_y", "y_stride", "rank", "world_size", "experts_local", "capacity", "hidden",
    "stage_stride", "has_w", "timeout_us", "op_id"))
def combine_kernel(y_ptr, w_ptr, dest_ptr, out_ptr, counts_ptr, offsets_ptr, cstart_ptr,
                   n_tokens, copy_y, y_stride,
                   route_ptr, sig_ptr, table_ptr, yst_sym, rowmap_sym, err_claim, err_record,
                   rank, world_size, experts_local, capacity, hidden, stage_stride,
                   has_w, timeout_us, op_id,
                   IN_PLACE: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, KC: tl.constexpr,
                   VEC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                   UNITS: tl.constexpr, SPREAD: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_S: tl.constexpr):
    """One combine of this rank (see the module docstring): ``out[t] = sum_j w[t, j] *
    y_owner[row of (t, j)]`` in fp32, j in order, one rounding (absent weights: 1)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + SIG_EPOCH_C, volatile=True).to(tl.int64) + 1
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    hidden = hidden // VEC * VEC  # multiples of VEC (host-checked): 16-byte row accesses
    y_stride = y_stride // VEC * VEC
    stage_stride = stage_stride // VEC * VEC
    EL = experts_local
    # work units: (block of BLOCK_T tokens, segment of the hidden chunks); segments only split
    # the hidden dimension when there are too few token blocks to keep SPREAD units per program
    n_tb = tl.cdiv(n_tokens, BLOCK_T)
    n_hc = tl.cdiv(hidden, BLOCK_H)
    per_seg = tl.cdiv(n_hc, tl.minimum(n_hc, tl.maximum(1, tl.cdiv(SPREAD * nprog, tl.maximum(n_tb, 1)))))
    seg_count = tl.cdiv(n_hc, per_seg)
    n_units = n_tb * seg_count
    n_mine = tl.maximum(n_units - pid + nprog - 1, 0) // nprog

    # ---- my expert outputs, for my peers: in place (rows map) or copied into my staging -------
    if pid == 0:  # where they are: y (in place) or my staging, its row stride, mapped or compact
        if IN_PLACE:
            tl.store(sig_ptr + SIG_Y_OFF,
                     y_ptr.to(tl.int64, bitcast=True) - yst_sym.to(tl.int64, bitcast=True))
            tl.store(sig_ptr + SIG_Y_STRIDE, y_stride.to(tl.int64))
            tl.store(sig_ptr + SIG_Y_MAPPED, tl.full((), 1, tl.int64))
        else:
            tl.store(sig_ptr + SIG_Y_OFF, tl.zeros((), tl.int64))
            tl.store(sig_ptr + SIG_Y_STRIDE, stage_stride.to(tl.int64))
            tl.store(sig_ptr + SIG_Y_MAPPED, tl.zeros((), tl.int64))
    if IN_PLACE:
        _publish_rows(y_ptr, y_stride, sig_ptr, yst_sym, rowmap_sym, counts_ptr, offsets_ptr,
                      cstart_ptr, EL, capacity, pid, nprog, BLOCK_F, BLOCK_S)
    elif copy_y != 0:
        total = tl.minimum(tl.load(cstart_ptr + EL), capacity)
        for f0 in range(pid * BLOCK_R, total, nprog * BLOCK_R):
            f = f0 + tl.arange(0, BLOCK_R)
            f_ok = f < total
            row, keep = _compact_row(f, f_ok, cstart_ptr, counts_ptr, offsets_ptr, EL, BLOCK_S)
            _copy_rows(yst_sym, f, stage_stride, y_ptr + row.to(tl.int64) * y_stride, keep, hidden,
                       BLOCK_C)
    for i in range(world_size):
        peer = (rank + i) % world_size
        dl.signal_add(dl.peer_base(table_ptr, peer, rank, sig_ptr) + SIG_READY_D + world_size + rank, 1)
    ok = pid >= 0
    for peer in range(world_size):
        ok = ok & dl.wait_at_least(sig_ptr + SIG_READY_D + world_size + peer, epoch * nprog, deadline,
                                   err_claim, err_record, op_id, rank, peer, epoch)

    # ---- weighted sum of every token's rows, k order, fp32 -----------------------------------
    if ok:
        _route_entries(route_ptr, dest_ptr, table_ptr, sig_ptr, yst_sym, rowmap_sym, rank, capacity,
                       n_tokens, n_mine, seg_count, pid, nprog, TOPK, KP, BLOCK_T, UNITS)
        tl.debug_barrier()  # this program's routes, written by its other threads
        routes = _unit_routes(route_ptr, w_ptr, pid, seg_count, n_tokens, has_w, TOPK, BLOCK_T)
        for i in range(0, n_mine):
            u = pid + i * nprog
            offs, ws = routes
            # the next unit's routing loads are in flight while this unit's rows stream
            routes = _unit_routes(route_ptr, w_ptr, u + nprog, seg_count, n_tokens, has_w, TOPK, BLOCK_T)
            tok = (u // seg_count) * BLOCK_T + tl.arange(0, BLOCK_T)
            t_ok = tok < n_tokens
            out_rows = out_ptr + tok.to(tl.int64) * hidden
            c_lo = (u % seg_count) * per_seg
            for c in range(c_lo, tl.minimum(c_lo + per_seg, n_hc)):
                cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
                c_ok = cols < hidden
                acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
                for j0 in tl.static_range(0, TOPK, KC):
                    vals = ()  # KC slots' row loads issued together, then summed in k order
                    for jj in tl.static_range(KC):
                        if j0 + jj < TOPK:
                            off = offs[j0 + jj]
                            valid = off != _NO_ROUTE
                            rows = yst_sym + tl.multiple_of(tl.where(valid, off, 0), VEC)
                            vals = vals + (tl.load(rows[:, None] + cols[None, :],
                                                   mask=valid[:, None] & c_ok[None, :], other=0.0,
                                                   cache_modifier=".cg"),)
                    for jj in tl.static_range(KC):
                        if j0 + jj < TOPK:
                            valid = offs[j0 + jj] != _NO_ROUTE
                            acc = tl.where(valid[:, None],
                                           acc + ws[j0 + jj][:, None] * vals[jj].to(tl.float32), acc)
                tl.store(out_rows[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=t_ok[:, None] & c_ok[None, :])

    # ---- every rank has read my rows: my caller may overwrite them ---------------------------
    for i in range(world_size):
        peer = (rank + i) % world_size
        dl.signal_add(dl.peer_base(table_ptr, peer, rank, sig_ptr) + SIG_READY_D + 2 * world_size + rank, 1)
    for peer in range(world_size):
        dl.wait_at_least(sig_ptr + SIG_READY_D + 2 * world_size + peer, epoch * nprog, deadline,
                         err_claim, err_record, op_id, rank, peer, epoch)
    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + SIG_DONE_C, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.store(sig_ptr + SIG_EPOCH_C, epoch)
        tl.store(sig_ptr + SIG_DONE_C, 0)
