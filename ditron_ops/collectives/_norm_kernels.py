"""The kernel of ``all_reduce_rmsnorm``: rank-ordered all-reduce, residual add, RMSNorm and an
optional e4m3 quantization in one launch per rank.

Each rank runs ``P`` programs (fixed per workspace). A call of epoch ``e`` (read from the signal
pad, so CUDA-graph replays keep counting) uses only half ``e % 2`` of the data buffer (halves at
fixed places, ``half_bytes`` apart: ``_norm_launch``'s docstring)::

    rank r, program p
    -----------------------------------------------------------------------------------------
    copy x -> my xbuf[e%2] (tiles p, p+P, ...)
    (p = 0) meta[e%2][r] = T*H on every rank, all of them before any arrival below
    arrivals[r] += 2 (one-shot) or 1 (two-shot) on every rank (release)
    wait arrivals[s] >= 2eP (one-shot) or (2e-1)P (two-shot), every s   | every x readable
    check meta[e%2][s] == T*H, every s (else SIZE_MISMATCH)
    one-shot: rows t = p, p+P, ... < T:                             -> out, res_out of row t
    two-shot: my rows t in [lo_r, hi_r), t = lo_r+p, ...:          -> my staging[e%2]
        h   = round(((0 + xbuf_0[t]) + xbuf_1[t]) + ... + xbuf_{W-1}[t])   (fp32, rank order)
        res = round(h + residual[t])
        y   = round(res * rstd * w),  rstd = 1 / sqrt(sum(res^2) / H + eps)  (fp32)
        scale = amax * fp32(1/448), codes = e4m3(y / scale)  (per row or per 128 columns)
    two-shot only:
        arrivals[r] += 1 on every rank (release); wait arrivals[s] >= 2eP for every s
        copy every owner's staged rows (normed, res, codes, scales) into my outputs
    last program to finish: epoch = e

Signal pad words (int64): ``arrivals[src]`` at ``[0, W)``, the epoch at ``3W``, the finished
programs at ``3W + 1``, ``meta[parity][src]`` (the size check) at ``4W + 2 + parity * W + src``.

Size words before arrivals: a two-shot counter takes both phases' adds, so a peer's count can
reach ``(2e-1)P`` with some of its programs' phase-2 adds before its program 0 got to this rank.
Program 0 therefore writes the size word to every rank before its first arrival; a phase-2 add
comes from a program that waited for all of its own rank's phase-1 adds (program 0's among
them, released after its size words), so the word is visible before the count is reached.

Buffer reuse: rank r writes half ``e % 2`` again at epoch ``e + 2``, after it waited in call
``e + 1`` for every peer's arrival, which a peer sends only after its call ``e`` (its reads of
half ``e % 2``) finished (stream order). So double buffering needs no acknowledgement, for any
sequence of T and algorithms: every region of a call lies in its parity's half.

Fixed order: the sum over ranks is 0..W-1; the sum of squares over H is chunk by chunk in
``BLOCK_H`` blocks (the host picks BLOCK_H and the warps from H alone) and the kernel is compiled
without FMA contraction, so a row's bits depend on neither T, nor the other rows, nor which rank
or program computed it. One-shot and two-shot agree bitwise when ``residual`` is the same on
every rank (as the op requires): two-shot adds the owner's residual rows, one-shot this rank's.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
"""``scale = amax * fp32(1 / 448)``: what torch computes for ``amax / 448`` on CUDA (a tensor
divided by a Python scalar is multiplied by the scalar's fp32 reciprocal), so the codes match
an engine's torch quantization on the GPU bit for bit (true division differed in 1 of ~4 rows)."""
QUANT_ROW = tl.constexpr(1)
QUANT_128 = tl.constexpr(2)


@dl.jit
def _split_start(rows, world_size, part):
    """First row of part ``part`` when ``rows`` are split over ``world_size`` ranks."""
    base = rows // world_size
    return part * base + tl.minimum(part, rows % world_size)


@dl.jit
def _peer_row(xbuf_ptr, buf_table, s, rank, world_size, src_off, o, mask):
    """Columns ``o`` of rank ``s``'s staged row; +0.0 for ``s >= world_size`` (a masked load;
    the clamped rank keeps the pointer-table read inside its W entries)."""
    peer = dl.peer_base(buf_table, tl.minimum(s, world_size - 1), rank, xbuf_ptr) + src_off
    return tl.load(peer + o, mask=mask & (s < world_size), other=0.0, cache_modifier=".cg")


@dl.jit
def _reduce_chunk(xbuf_ptr, buf_table, rank, world_size, src_off, res_row, o, mask):
    """``round(round(sum_s x_s) + residual)`` of columns ``o`` of one row, as fp32. Four
    peers' rows are loaded before any is added (one load latency per four ranks, not per rank),
    then added in rank order 0..W-1: the sum's order is fixed. A rank past W gives +0.0, which
    changes no sum (one that starts at +0.0 is never -0.0), so the bits are the one-at-a-time
    loop's."""
    dt = res_row.dtype.element_ty
    acc = tl.zeros(o.shape, tl.float32)
    for s in range(0, world_size, 4):
        x0 = _peer_row(xbuf_ptr, buf_table, s, rank, world_size, src_off, o, mask)
        x1 = _peer_row(xbuf_ptr, buf_table, s + 1, rank, world_size, src_off, o, mask)
        x2 = _peer_row(xbuf_ptr, buf_table, s + 2, rank, world_size, src_off, o, mask)
        x3 = _peer_row(xbuf_ptr, buf_table, s + 3, rank, world_size, src_off, o, mask)
        acc = (((acc + x0.to(tl.float32)) + x1.to(tl.float32)) + x2.to(tl.float32)) \
            + x3.to(tl.float32)
    h = acc.to(dt).to(tl.float32)  # the all-reduce's one rounding
    res = tl.load(res_row + o, mask=mask, other=0.0).to(tl.float32)
    return (h + res).to(dt).to(tl.float32)


@dl.jit
def _rstd(sumsq, cols, eps):
    """``1 / sqrt(sumsq / H + eps)`` with correctly rounded division and root (as torch's
    CPU math; the GPU's approximate ``rsqrt`` would differ by an ulp)."""
    mean = tl.math.div_rn(sumsq, cols.to(tl.float32))
    return tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@dl.jit
def _e4m3_bits(q):
    """The e4m3 (``float8_e4m3fn``) byte of fp32 ``q`` (``|q| <= 448``), rounded to nearest even,
    in integer and exact fp32 arithmetic: one path for the GPU and the interpreter (whose own
    fp32 -> fp8 conversion drops the carry into the exponent and the sign of -0)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|q| >= 2^-6): round the fp32 mantissa to 3 bits (a carry moves into the
    # exponent), then rebias the exponent from 127 to 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: multiples of 2^-9; adding 1.5 * 2^14 rounds to them (the fp32 ulp there)
    a = tl.abs(q)
    sub = (((a + 24576.0) - 24576.0) * 512.0).to(tl.int32)  # 0..8 (8: the smallest normal)
    code = tl.where(mag < 0x3C800000, sub, normal)  # 0x3C800000: 2^-6
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN (a NaN input row) -> e4m3fn's NaN
    return (code | sign).to(tl.uint8)


@dl.jit
def _quant_groups(y, codes_row, scales_row, c0, cols, BLOCK_H: tl.constexpr):
    """e4m3 codes of the chunk ``y`` (fp32 values of the rounded output) starting at column
    ``c0``, one scale per 128 columns (``BLOCK_H`` and ``c0`` are multiples of 128)."""
    G: tl.constexpr = BLOCK_H // 128
    g = tl.arange(0, G)
    o2 = c0 + g[:, None] * 128 + tl.arange(0, 128)[None, :]
    y2 = tl.reshape(y, (G, 128))  # row-major: y2[g, c] = y[128 g + c]
    scale = tl.max(tl.abs(y2), axis=1) * INV_FP8_MAX
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.math.div_rn(y2, tl.broadcast_to(safe[:, None], (G, 128)))
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(codes_row + o2, _e4m3_bits(q), mask=o2 < cols)
    tl.store(scales_row + c0 // 128 + g, scale, mask=c0 // 128 + g < cols // 128)


@dl.jit
def _quant_row(y, amax, codes_row, o, mask):
    """e4m3 codes of one chunk ``y`` with the row's scale ``amax * fp32(1/448)``; returns the
    scale."""
    scale = amax * INV_FP8_MAX
    safe = tl.where(scale > 0, scale, 1.0)
    # (div_rn does not broadcast: the divisor is made a block of y's shape)
    q = tl.math.div_rn(y, tl.full(y.shape, 1.0, tl.float32) * safe)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(codes_row + o, _e4m3_bits(q), mask=mask)
    return scale


@dl.jit
def _norm_row(xbuf_ptr, buf_table, rank, world_size, src_off, res_row, w_ptr, out_row, res_out_row,
              codes_row, scales_row, cols, eps,
              QUANT: tl.constexpr, BLOCK_H: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """One row: reduce, add, normalize, quantize; writes the ``*_row`` pointers."""
    dt = out_row.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    if ONE_CHUNK:  # H <= BLOCK_H: the row stays in registers
        mask = offs < cols
        v = _reduce_chunk(xbuf_ptr, buf_table, rank, world_size, src_off, res_row, offs, mask)
        tl.store(res_out_row + offs, v.to(dt), mask=mask)
        rstd = _rstd(tl.sum(v * v, axis=0), cols, eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (v * rstd * w).to(dt)
        tl.store(out_row + offs, y, mask=mask)
        if QUANT == QUANT_ROW:
            yf = y.to(tl.float32)
            scale = _quant_row(yf, tl.max(tl.abs(yf), axis=0), codes_row, offs, mask)
            tl.store(scales_row, scale)
        if QUANT == QUANT_128:
            _quant_groups(y.to(tl.float32), codes_row, scales_row, 0, cols, BLOCK_H)
    else:  # chunks of BLOCK_H, in column order; later passes reread what this program stored
        sumsq = tl.zeros((), tl.float32)
        for c0 in range(0, cols, BLOCK_H):
            o = c0 + offs
            mask = o < cols
            v = _reduce_chunk(xbuf_ptr, buf_table, rank, world_size, src_off, res_row, o, mask)
            tl.store(res_out_row + o, v.to(dt), mask=mask)
            sumsq += tl.sum(v * v, axis=0)
        tl.debug_barrier()  # this CTA's stores are visible to all its threads
        rstd = _rstd(sumsq, cols, eps)
        amax = tl.zeros((), tl.float32)
        for c0 in range(0, cols, BLOCK_H):
            o = c0 + offs
            mask = o < cols
            v = tl.load(res_out_row + o, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + o, mask=mask, other=0.0).to(tl.float32)
            y = (v * rstd * w).to(dt)
            tl.store(out_row + o, y, mask=mask)
            if QUANT == QUANT_ROW:
                amax = tl.maximum(amax, tl.max(tl.abs(y.to(tl.float32)), axis=0))
            if QUANT == QUANT_128:
                _quant_groups(y.to(tl.float32), codes_row, scales_row, c0, cols, BLOCK_H)
        if QUANT == QUANT_ROW:
            tl.debug_barrier()
            scale = tl.zeros((), tl.float32)
            for c0 in range(0, cols, BLOCK_H):
                o = c0 + offs
                mask = o < cols
                y = tl.load(out_row + o, mask=mask, other=0.0).to(tl.float32)
                scale = _quant_row(y, amax, codes_row, o, mask)
            tl.store(scales_row, scale)


@dl.jit(do_not_specialize=("rank", "world_size", "rows", "cols", "half_bytes", "timeout_us",
                           "op_id"))
def ar_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, codes_ptr, scales_ptr,
    xbuf_ptr, stn_ptr, str_ptr, stc_ptr, sts_ptr, buf_table,
    sig_ptr, sig_table, err_claim, err_record,
    rank, world_size, rows, cols, eps, half_bytes, timeout_us, op_id,
    TWO_SHOT: tl.constexpr, QUANT: tl.constexpr, BLOCK_H: tl.constexpr, ONE_CHUNK: tl.constexpr,
    VEC: tl.constexpr, COPY_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    w = world_size
    epoch = tl.load(sig_ptr + 3 * w, volatile=True).to(tl.int64) + 1
    parity = epoch % 2
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    # ``n // VEC * VEC`` (exact: the host guarantees divisibility) lets copies vectorize
    cols = cols // VEC * VEC
    ELEM: tl.constexpr = xbuf_ptr.dtype.element_ty.primitive_bitwidth // 8
    # this call's half (parity), in elements of each region's dtype; the halves are 128-byte
    # multiples, so the element counts are exact
    x_off = parity * (half_bytes // ELEM // VEC * VEC)  # x, normed and residual regions
    c_off = parity * half_bytes  # codes (bytes)
    s_off = parity * (half_bytes // 4)  # scales (fp32)
    total = rows * cols
    meta = 4 * w + 2 + parity * w  # meta[parity][src]: the elements src staged (size check)

    # ---- stage x in my symmetric buffer, tell every rank --------------------------------------
    dl.copy_tiles(xbuf_ptr + x_off, x_ptr, total, pid, nprog, COPY_BLOCK)
    # the size word on every rank before any arrival (the module docstring says why)
    if pid == 0:
        for i in range(w):
            dst_sig = dl.remote_ptr(sig_table, (rank + i) % w, sig_ptr)
            tl.store(dst_sig + meta + rank, total.to(tl.int64))
    # arrivals[src] counts 2 per program and call: one-shot adds both now, two-shot one now
    # and one when its rows are staged (so a peer's count is 2 * e * P after call e either way)
    # (signal_add: a CTA barrier, then a system-scope release after the stores above)
    staged = 2 * epoch * nprog
    for i in range(w):
        dl.signal_add(dl.remote_ptr(sig_table, (rank + i) % w, sig_ptr) + rank,
                      1 if TWO_SHOT else 2)

    ok = pid >= 0
    for s in range(w):
        ok = ok & dl.wait_at_least(sig_ptr + s, staged - nprog if TWO_SHOT else staged, deadline,
                                   err_claim, err_record, op_id, rank, s, epoch)
    if ok:
        for s in range(w):
            got = tl.load(sig_ptr + meta + s, volatile=True)
            if got != total:
                dl.record_error(err_claim, err_record, op_id, rank, s, epoch, dl.SIZE_MISMATCH)
            ok = ok & (got == total)

    # ---- rows: one-shot all of them into the outputs, two-shot mine into my staging ----------
    if TWO_SHOT:
        lo = _split_start(rows, w, rank)
        hi = _split_start(rows, w, rank + 1)
    else:
        lo = 0
        hi = rows
    groups = 1 if QUANT == QUANT_ROW else cols // 128
    if ok:
        for t in range(lo + pid, hi, nprog):
            if TWO_SHOT:  # staging rows are relative to my first row
                st = (t - lo) * cols
                on, orr = stn_ptr + x_off + st, str_ptr + x_off + st
                oc = stc_ptr + c_off + st
                osc = sts_ptr + s_off + (t - lo) * groups
            else:
                on, orr, oc = out_ptr + t * cols, res_out_ptr + t * cols, codes_ptr + t * cols
                osc = scales_ptr + t * groups
            _norm_row(xbuf_ptr, buf_table, rank, w, x_off + t * cols, res_ptr + t * cols, w_ptr,
                      on, orr, oc, osc, cols, eps, QUANT, BLOCK_H, ONE_CHUNK)

    # ---- two-shot: every owner's staged rows into my outputs ---------------------------------
    if TWO_SHOT:
        if ok:  # (a rank that failed sends nothing: its peers time out too, none reads garbage)
            for i in range(w):
                dl.signal_add(dl.remote_ptr(sig_table, (rank + i) % w, sig_ptr) + rank, 1)
        for s in range(w):
            ok = ok & dl.wait_at_least(sig_ptr + s, staged, deadline, err_claim, err_record,
                                       op_id, rank, s, epoch)
        if ok:
            for i in range(w):
                s = (rank + i) % w
                first = _split_start(rows, w, s)
                n = (_split_start(rows, w, s + 1) - first) * cols
                dst = first * cols
                dl.copy_tiles(out_ptr + dst, dl.peer_base(buf_table, s, rank, stn_ptr)
                              + x_off, n, pid, nprog, COPY_BLOCK)
                dl.copy_tiles(res_out_ptr + dst, dl.peer_base(buf_table, s, rank, str_ptr)
                              + x_off, n, pid, nprog, COPY_BLOCK)
                if QUANT != 0:
                    dl.copy_tiles(codes_ptr + dst, dl.peer_base(buf_table, s, rank, stc_ptr)
                                  + c_off, n, pid, nprog, COPY_BLOCK)
                    dl.copy_tiles(scales_ptr + first * groups,
                                  dl.peer_base(buf_table, s, rank, sts_ptr) + s_off,
                                  n // cols * groups, pid, nprog, COPY_BLOCK)

    # ---- the last program to finish publishes the epoch ---------------------------------------
    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + 3 * w + 1, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.store(sig_ptr + 3 * w, epoch)
        tl.store(sig_ptr + 3 * w + 1, 0)
