"""Kernels of the MoE token exchange: routing layout and dispatch (the combine: ``_combine_kernels``).

Terms (per rank r of W; E experts, EL = E / W of them on each rank, expert e on rank e // EL;
k routing slots per token; an *entry* is one slot ``i = t * k + j`` of token t)::

    count_s[e]   entries of rank s routed to expert e
    compact row  the position of an entry in its expert owner's receive order:
                 experts in order, then source ranks, then entries of a source in (t, j) order
                 compact(e, s, pos) = sum_{e' < e on the owner} N[e'] + sum_{s' < s} count_s'[e] + pos
    pos          rank of the entry among its source's entries of the same expert, (t, j) order
                 (deterministic: counted; default: an integer atomic's arrival order)

Layouts map a compact row to an output row: ``expert_contig`` adds each earlier expert's
alignment padding, ``expert_padded`` puts expert e's w-th row at ``e * W * T_max + w``.

One dispatch (rank r)::

    layout kernels (no wait)         dispatch kernel, P programs per rank (waits)
    ------------------------------   --------------------------------------------------------------
    chunk: idx -> idx32, rank of     send: sorted[start_r[e] + pos] = i (my entries, expert-major);
      each entry in its 128-entry      x rows -> my staging (fp8: quantized), weights -> staging;
      chunk, chunk histograms          program 0 pushes count_r[0..E) + meta to every rank;
    scan: histograms -> prefixes,      every program: ready_d[r] += 1 on every rank (release)
      count_r                        wait: ready_d[s] >= epoch * P for every s (acquire)
    (default mode: one kernel,       tables from every rank's counts: N, prefix sums, segments
      pos = atomic_add(count[e]))    dest[i] = owner * CAP + compact row (my entries), or -1
                                     receive: every compact row f < min(N_r, CAP) of my experts:
                                       (expert, source s, q) by search, entry = s.sorted[..+q],
                                       out[row(f)] = s.x_staging[entry // k] (remote loads)

With fp8 the staging holds e4m3 codes and scales (``_quantize_tile``); in the ``split``
variant (``_launch.FP8_VARIANTS``) ``quantize_kernel`` writes them, a kernel of its own
launched (no wait) before the dispatch kernel, which then skips its staging pass.

Staging is double buffered by the dispatch epoch's parity: rank r rewrites half ``e % 2`` at
epoch ``e + 2`` only after it waited, at ``e + 1``, for every peer's ready signal, which a peer
sends after its epoch-``e`` reads (stream order). A dispatch with a cached handle skips the
layout: it stages, signals, waits, and gathers the rows its handle lists (``src_of_row``).

The combine kernel is in ``_combine_kernels``. Counts, offsets and every size are read and
computed on the device; nothing here depends on a host value that changes per call except the
token count.
"""
from __future__ import annotations

import triton.language as tl

from .. import _env
from .. import language as dl

# signal pad words (int64): epochs and done counters, then W arrival counters per purpose
SIG_EPOCH_D = tl.constexpr(0)
SIG_DONE_D = tl.constexpr(1)
SIG_EPOCH_C = tl.constexpr(2)
SIG_DONE_C = tl.constexpr(3)
SIG_HEAD = 8
SIG_READY_D = tl.constexpr(SIG_HEAD)  # + W: ready_c, + 2W: finish_c

META = 4
"""Words after each source's E counts: tokens, bad-input kind, two values."""
_META = tl.constexpr(META)

BAD_IDS, BAD_TOKENS, OVERFLOW = 1, 2, 3
"""Kinds of the MoE error record (and of the bad-input meta word)."""
_BAD_IDS, _BAD_TOKENS, _OVERFLOW = tl.constexpr(BAD_IDS), tl.constexpr(BAD_TOKENS), tl.constexpr(OVERFLOW)
_NO_BAD = tl.constexpr(2**63 - 1)
_BIG = tl.constexpr(2**30)

if _env.use_interpreter():

    @dl.jit
    def _e4m3(v):
        """fp32 -> e4m3fn bits, round to nearest even, saturating (infinities too), NaN to the
        NaN code 0x7F with v's sign bit as torch's cast keeps it (the interpreter's own fp8
        cast does not carry a rounding into the exponent, so it is done on the bits here)."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        u = bits & 0x7FFFFFFF
        a = tl.where(u > 0x7F800000, 0.0, u.to(tl.float32, bitcast=True))  # NaN: its code below
        normal = tl.minimum(((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - 960, 126)
        tiny = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # multiples of 2^-9, ties to even
        code = tl.where(u > 0x7F800000, 0x7F, tl.where(a < 0.015625, tiny, normal))
        return (sign | code).to(tl.uint8)

    @dl.jit
    def _fma(a, b, c):
        """fp32 ``a * b + c`` with one rounding (the interpreter's ``tl.fma`` rounds the product
        first): the exact product in fp64, the sum rounded to odd in fp64 (TwoSum's error
        says which way), then to nearest fp32, which is the fused result (53 >= 24 + 2 bits)."""
        p = a.to(tl.float64) * b.to(tl.float64)
        c64 = c.to(tl.float64)
        s = p + c64
        z = s - p
        err = (p - (s - z)) + (c64 - z)
        bits = s.to(tl.int64, bitcast=True)
        odd = tl.where((err != 0) & ((bits & 1) == 0), tl.where((err > 0) == (s > 0), bits + 1, bits - 1), bits)
        return odd.to(tl.float64, bitcast=True).to(tl.float32)

else:

    @dl.jit
    def _e4m3(v):
        """fp32 -> e4m3fn bits (hardware cast: round to nearest even, saturating infinities
        too; NaN to a NaN code, 0x7F or 0xFF)."""
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @dl.jit
    def _fma(a, b, c):
        """fp32 ``a * b + c`` with one rounding (``fma.rn.f32``)."""
        return tl.fma(a, b, c)


@dl.jit
def _pow2_ceil(x):
    """Smallest power of two >= x (x positive, normal), exact on the bits."""
    bits = x.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23
    return up.to(tl.float32, bitcast=True)


QUANT_DIV, QUANT_RCP = 0, 1
"""fp8 quotient ``x / scale`` per value: an IEEE division, or the group's reciprocal and two
corrections (``_quotient``); the same codes."""
_QUANT_RCP = tl.constexpr(QUANT_RCP)


@dl.jit
def _quotient(v, scale, QUANT: tl.constexpr):
    """``v / scale`` (``scale [R, G]`` per 128-value group of ``v [R, G, 128]``, positive):
    rounded to nearest fp32 wherever ``|v / scale| >= 2^-20``, elsewhere a value under 2^-10
    of ``v``'s sign (zeros included), so the e4m3 codes are the IEEE division's (normal
    scales, as ``max(amax, 1e-4) / 448`` is for finite values). A group holding an infinity
    has scale ``+inf``: ``+-0`` of ``v``'s sign for finite ``v``, NaN for ``+-inf``, as
    IEEE division; NaN ``v``: NaN.

    ``QUANT_RCP``: one IEEE division per group, ``y = 1 / scale``, then per value ``q = v y``
    and two corrections ``q -= (scale q - v) y`` (fused): the first makes ``q`` faithful, the
    second correctly rounded (Markstein's theorem: faithful ``q``, ``y`` within half an ulp;
    no underflow above 2^-20). Written with ``scale q - v`` so ``-0`` stays ``-0``. Why: an
    IEEE division per value is a ~10-instruction chain behind its own slow-path branch, which
    the compiler does not interleave with the next; this is 5 branch-free instructions.
    Scale ``+inf`` (``y = 0``) is used as 0 in the corrections, a select per group rather
    than per value: ``inf * 0`` would turn the whole group NaN; with 0 they add signed zeros
    to ``q = v * 0``, which is already the division's ``+-0`` (NaN for ``+-inf``)."""
    if QUANT == _QUANT_RCP:
        r = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        y = tl.broadcast_to(r[:, :, None], v.shape)
        ny = tl.broadcast_to((r * -1.0)[:, :, None], v.shape)
        s = tl.broadcast_to(tl.where(scale == float("inf"), 0.0, scale)[:, :, None], v.shape)
        nv = v * -1.0  # a negation (``-v`` is ``0 - v``: +0 for +0, and one more instruction)
        q = v * y
        q = _fma(_fma(s, q, nv), ny, q)
        return _fma(_fma(s, q, nv), ny, q)
    else:
        return tl.div_rn(v, tl.broadcast_to(scale[:, :, None], v.shape))


@dl.jit
def _record(claim_ptr, record_ptr, kind, src, a, b, c, epoch):
    """First MoE error of this rank into the host-readable record: status, kind, source rank,
    three values, epoch (status written last)."""
    zero = tl.zeros((), tl.int64)
    if tl.atomic_cas(claim_ptr, zero, zero + 1, sem="relaxed", scope="gpu") == 0:
        tl.store(record_ptr + 1, tl.cast(kind, tl.int64))
        tl.store(record_ptr + 2, tl.cast(src, tl.int64))
        tl.store(record_ptr + 3, tl.cast(a, tl.int64))
        tl.store(record_ptr + 4, tl.cast(b, tl.int64))
        tl.store(record_ptr + 5, tl.cast(c, tl.int64))
        tl.store(record_ptr + 6, tl.cast(epoch, tl.int64))
        dl.fence_sys()
        tl.store(record_ptr, 1)


# ---- layout (no waits) -------------------------------------------------------------------------

@dl.jit
def _expert_ids(raw, live, num_experts):
    """Routing ids as int32: -1 for none, for lanes past the entries and for ids outside [-1, E)."""
    return tl.where(live & (raw >= 0) & (raw < num_experts), raw, -1).to(tl.int32)


@dl.jit
def _normalize(idx_ptr, idx32_ptr, bad_ptr, offs, live, num_experts):
    """Routing ids of entries ``offs`` as int32 (-1: none). Ids outside [-1, E) count as -1 and
    the smallest such entry (index << 32 | low 32 bits of its id) goes to ``bad_ptr``."""
    raw = tl.load(idx_ptr + offs, mask=live, other=-1)
    bad = live & ((raw < -1) | (raw >= num_experts))
    e = _expert_ids(raw, live, num_experts)
    tl.store(idx32_ptr + offs, e, mask=live)
    key = tl.where(bad, (offs.to(tl.int64) << 32) | (raw.to(tl.int64) & 0xFFFFFFFF), _NO_BAD)
    first = tl.min(key, axis=0)
    if first != _NO_BAD:
        tl.atomic_min(bad_ptr, first, sem="relaxed", scope="gpu")
    return e


@dl.jit(do_not_specialize=("n_entries", "num_experts"))
def layout_chunk_kernel(idx_ptr, idx32_ptr, pos_ptr, hist_ptr, bad_ptr, n_entries, num_experts,
                        CH: tl.constexpr, JB: tl.constexpr, EB: tl.constexpr):
    """Deterministic layout, pass 1 (one program per chunk of CH entries): each entry's rank
    among the chunk's earlier entries of its expert, and the chunk's histogram over experts.

    The chunk's entries are compared JB at a time (their ids loaded again), counting for each
    entry the earlier (``pos``) and all (``total``) entries of its expert; the histogram is
    zeros, then each expert's last entry of the chunk writes its ``total``. A program holds
    a ``[CH, JB]`` tile, never ``[CH, CH]`` or ``[CH, E]``: few registers, so a program fits on
    an SM beside a dispatch program (a virtual world's ranks share the SMs; at 255 registers
    it did not fit beside the fp8 dispatch's 176)."""
    c = tl.program_id(0)
    if c * CH < n_entries:
        lane = tl.arange(0, CH)
        offs = c * CH + lane
        live = offs < n_entries
        e = _normalize(idx_ptr, idx32_ptr, bad_ptr, offs, live, num_experts)
        ei = e[:, None]
        li = lane[:, None]
        earlier = tl.zeros((CH, JB), tl.int32)
        alike = tl.zeros((CH, JB), tl.int32)
        for j0 in range(0, CH, JB):  # counts per (entry, lane of the step), summed at the end
            lj = j0 + tl.arange(0, JB)
            oj = c * CH + lj
            ej = _expert_ids(tl.load(idx_ptr + oj, mask=oj < n_entries, other=-1), oj < n_entries,
                             num_experts)
            same = ej[None, :] == ei
            earlier += (same & (lj[None, :] < li)).to(tl.int32)
            alike += same.to(tl.int32)
        pos = tl.sum(earlier, axis=1)
        total = tl.sum(alike, axis=1)
        tl.store(pos_ptr + offs, pos, mask=live)
        hist = hist_ptr + c * num_experts
        for e0 in range(0, num_experts, EB):
            ex = e0 + tl.arange(0, EB)
            tl.store(hist + ex, tl.zeros((EB,), tl.int32), mask=ex < num_experts)
        tl.debug_barrier()  # the zeros before the counts (same words, other threads)
        tl.store(hist + tl.maximum(e, 0), total, mask=(e >= 0) & (pos == total - 1))


@dl.jit(do_not_specialize=("n_entries", "num_experts"))
def layout_scan_kernel(hist_ptr, count_ptr, n_entries, num_experts, CH: tl.constexpr,
                       CB: tl.constexpr, EB: tl.constexpr):
    """Deterministic layout, pass 2 (one program per EB experts): chunk histograms -> exclusive
    prefixes over chunks (in place), and this rank's count per expert."""
    ex = tl.program_id(0) * EB + tl.arange(0, EB)
    e_ok = ex < num_experts
    chunks = tl.cdiv(n_entries, CH)
    carry = tl.zeros((EB,), tl.int32)
    for c0 in range(0, chunks, CB):
        cs = c0 + tl.arange(0, CB)
        m = (cs < chunks)[:, None] & e_ok[None, :]
        ptrs = hist_ptr + cs[:, None] * num_experts + ex[None, :]
        h = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(count_ptr + ex, carry, mask=e_ok)


@dl.jit(do_not_specialize=("n_entries", "num_experts"))
def layout_atomic_kernel(idx_ptr, idx32_ptr, pos_ptr, count_ptr, bad_ptr, n_entries, num_experts,
                         CH: tl.constexpr):
    """Default layout (one pass): each entry's position is an atomic increment of its expert's
    count (``count`` is zero on entry: the dispatch kernel's last program resets it)."""
    c = tl.program_id(0)
    if c * CH < n_entries:
        offs = c * CH + tl.arange(0, CH)
        live = offs < n_entries
        e = _normalize(idx_ptr, idx32_ptr, bad_ptr, offs, live, num_experts)
        valid = e >= 0
        pos = tl.atomic_add(count_ptr + tl.maximum(e, 0), 1, mask=valid, sem="relaxed", scope="gpu")
        tl.store(pos_ptr + offs, pos, mask=valid)


# ---- shared pieces of the exchange kernels ----------------------------------------------------

@dl.jit
def _position(pos_ptr, prefix_ptr, ii, e, valid, num_experts, det, CH: tl.constexpr):
    """Final position of entries ``ii`` among this rank's entries of their expert."""
    pos = tl.load(pos_ptr + ii, mask=valid, other=0)
    chunk_prefix = tl.load(prefix_ptr + (ii // CH) * num_experts + e, mask=valid & (det != 0), other=0)
    return pos + chunk_prefix


@dl.jit
def _exclusive_scan(src, dst, n, BLOCK: tl.constexpr):
    """``dst[i] = src[0] + ... + src[i-1]`` for i < n; returns the total."""
    run = tl.zeros((), tl.int32)
    for i0 in range(0, n, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        ok = offs < n
        v = tl.load(src + offs, mask=ok, other=0)
        tl.store(dst + offs, tl.cumsum(v, axis=0) - v + run, mask=ok)
        run += tl.sum(v, axis=0)
    return run


@dl.jit
def _copy_rows(dst_ptr, dst_rows, dst_stride, src_rows, keep, ncols, BLOCK_H: tl.constexpr):
    """``dst[dst_rows[i], :ncols] = *src_rows[i]`` for rows with ``keep`` (src bypasses L1: a
    peer may have written it)."""
    dst_base = dst_ptr + dst_rows.to(tl.int64) * dst_stride
    for h0 in range(0, ncols, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = keep[:, None] & (cols < ncols)[None, :]
        v = tl.load(src_rows[:, None] + cols[None, :], mask=m, cache_modifier=".cg")
        tl.store(dst_base[:, None] + cols[None, :], v, mask=m)


@dl.jit
def _x_tile(x_ptr, blk, chk, end, n_chunks, n_tokens, hidden, BLOCK_R: tl.constexpr,
            BLOCK_H: tl.constexpr):
    """The tile of row block ``blk`` and hidden chunk ``chk`` (tile ``blk * n_chunks + chk``)
    as a ``[BLOCK_R, BLOCK_H / 128, 128]`` tile in x's dtype (0 past the rows, and for tiles
    from ``end`` on)."""
    rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    NG: tl.constexpr = BLOCK_H // 128
    col = chk * BLOCK_H + tl.arange(0, NG)[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m = ((rows < n_tokens) & (blk * n_chunks + chk < end))[:, None, None] & (col < hidden)
    return tl.load(x_ptr + rows.to(tl.int64)[:, None, None] * hidden + col, mask=m, other=0.0)


@dl.jit
def _quantize_tile(cur, rows, h0, n_tokens, hidden, stage_x, stage_s, round_scale,
                   QUANT: tl.constexpr, BLOCK_H: tl.constexpr):
    """A loaded ``[R, BLOCK_H / 128, 128]`` tile of rows ``rows`` from column ``h0``: its
    e4m3 codes and fp32 scales ``max(amax, 1e-4) / 448`` (optionally rounded up to a power of
    two) into the staging."""
    NG: tl.constexpr = BLOCK_H // 128
    groups = tl.arange(0, NG)
    v = cur.to(tl.float32)
    col = h0 + groups[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    m = (rows < n_tokens)[:, None, None] & (col < hidden)
    # IEEE divisions (``/`` lowers to an approximate one on the GPU): torch's bits
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4), 448.0)
    scale = tl.where(round_scale != 0, _pow2_ceil(scale), scale)
    q = _quotient(v, scale, QUANT)
    tl.store(stage_x + rows.to(tl.int64)[:, None, None] * hidden + col, _e4m3(q), mask=m)
    g_ok = (rows < n_tokens)[:, None] & (h0 + groups[None, :] * 128 < hidden)
    tl.store(stage_s + rows.to(tl.int64)[:, None] * (hidden // 128) + h0 // 128 + groups[None, :],
             scale, mask=g_ok)


@dl.jit
def _stage_tokens(x_ptr, stage_x, stage_s, n_tokens, hidden, round_scale, pid, nprog,
                  FP8: tl.constexpr, QUANT: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """This rank's token rows into its staging half; fp8: e4m3 per token and 128 channels
    (``_quantize_tile``), amax, scale and codes of a tile from one load of it, the next
    tile's load in flight meanwhile."""
    if FP8:
        # Each program quantizes a contiguous share of the (row block, hidden chunk) tiles,
        # row-block-major: 128 tokens of 7168 in 8-row blocks are 112 tiles, 7 or 8 for each
        # of 15 programs (dealt by row blocks, 16 blocks of 7 tiles, one program had 14).
        n_chunks = tl.cdiv(hidden, BLOCK_H)
        n_tiles = tl.cdiv(n_tokens, BLOCK_R) * n_chunks
        first = (pid * n_tiles) // nprog
        end = ((pid + 1) * n_tiles) // nprog
        blk = first // n_chunks  # the next tile's row block and chunk
        chk = first % n_chunks
        nxt = _x_tile(x_ptr, blk, chk, end, n_chunks, n_tokens, hidden, BLOCK_R, BLOCK_H)
        for _ in range(first, end):
            cur = nxt  # the next tile's load issued before this one's is waited for
            rows = blk * BLOCK_R + tl.arange(0, BLOCK_R)
            h0 = chk * BLOCK_H
            wrap = chk + 1 == n_chunks
            chk = tl.where(wrap, 0, chk + 1)
            blk += wrap.to(tl.int32)
            nxt = _x_tile(x_ptr, blk, chk, end, n_chunks, n_tokens, hidden, BLOCK_R, BLOCK_H)
            _quantize_tile(cur, rows, h0, n_tokens, hidden, stage_x, stage_s, round_scale, QUANT, BLOCK_H)
    else:
        for t0 in range(pid * BLOCK_R, n_tokens, nprog * BLOCK_R):
            rows = t0 + tl.arange(0, BLOCK_R)
            r_ok = rows < n_tokens
            base = rows.to(tl.int64) * hidden
            for h0 in range(0, hidden, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                m = r_ok[:, None] & (cols < hidden)[None, :]
                v = tl.load(x_ptr + base[:, None] + cols[None, :], mask=m)
                tl.store(stage_x + base[:, None] + cols[None, :], v, mask=m)


@dl.jit
def _count_tables(cnt, scr, rank, world_size, num_experts, experts_local, alignment,
                  BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr):
    """Tables of this call's counts (``cnt``: every source's row of E counts), in this
    program's scratch ``scr`` (int32)::

        N[e]      entries of all ranks for expert e          at E
        CS[e]     compact start of expert e on its owner      at 2E
        EXS[s,e]  count_0[e] + ... + count_{s-1}[e]          at 4E
        INC[s,e]  EXS[s,e] + count_s[e]                      at 4E + WE
        SRC[s,e]  count_s[0] + ... + count_s[e-1]            at 4E + 2WE
        AL[el]    contiguous-layout start of my expert el     at 4E + 3WE   (EL + 1 words)
        total     entries for my experts                      at 4E + 3WE + EL + 1

    Returns the total entries routed to this rank's experts.
    """
    E = num_experts
    t_n = scr + E
    t_cs = scr + 2 * E
    t_g = scr + 3 * E
    t_exs = scr + 4 * E
    t_inc = t_exs + world_size * E
    t_src = t_inc + world_size * E
    t_al = t_src + world_size * E
    row = E + _META
    for e0 in range(0, E, BLOCK_E):
        ex = e0 + tl.arange(0, BLOCK_E)
        e_ok = ex < E
        carry = tl.zeros((BLOCK_E,), tl.int32)
        for s0 in range(0, world_size, BLOCK_W):
            ss = s0 + tl.arange(0, BLOCK_W)
            m = (ss < world_size)[:, None] & e_ok[None, :]
            c = tl.load(cnt + ss[:, None] * row + ex[None, :], mask=m, other=0, cache_modifier=".cg")
            inc = tl.cumsum(c, axis=0) + carry[None, :]
            at = ss[:, None] * E + ex[None, :]
            tl.store(t_exs + at, inc - c, mask=m)
            tl.store(t_inc + at, inc, mask=m)
            carry += tl.sum(c, axis=0)
        tl.store(t_n + ex, carry, mask=e_ok)
    for s0 in range(0, world_size, BLOCK_W):
        ss = s0 + tl.arange(0, BLOCK_W)
        s_ok = ss < world_size
        carry = tl.zeros((BLOCK_W,), tl.int32)
        for e0 in range(0, E, BLOCK_E):
            ex = e0 + tl.arange(0, BLOCK_E)
            m = s_ok[:, None] & (ex < E)[None, :]
            c = tl.load(cnt + ss[:, None] * row + ex[None, :], mask=m, other=0, cache_modifier=".cg")
            tl.store(t_src + ss[:, None] * E + ex[None, :], tl.cumsum(c, axis=1) - c + carry[:, None], mask=m)
            carry += tl.sum(c, axis=1)
    tl.debug_barrier()
    _exclusive_scan(t_n, t_g, E, BLOCK_E)
    tl.debug_barrier()
    for e0 in range(0, E, BLOCK_E):
        ex = e0 + tl.arange(0, BLOCK_E)
        e_ok = ex < E
        g = tl.load(t_g + ex, mask=e_ok, other=0)
        g0 = tl.load(t_g + (ex // experts_local) * experts_local, mask=e_ok, other=0)
        tl.store(t_cs + ex, g - g0, mask=e_ok)
    run = tl.zeros((), tl.int32)
    total = tl.zeros((), tl.int32)
    for l0 in range(0, experts_local, BLOCK_E):
        el = l0 + tl.arange(0, BLOCK_E)
        l_ok = el < experts_local
        n = tl.load(t_n + rank * experts_local + el, mask=l_ok, other=0)
        padded = (n + alignment - 1) // alignment * alignment
        tl.store(t_al + el, tl.cumsum(padded, axis=0) - padded + run, mask=l_ok)
        run += tl.sum(padded, axis=0)
        total += tl.sum(n, axis=0)
    tl.store(t_al + experts_local, run)
    tl.debug_barrier()
    return total


@dl.jit
def _search(ends_ptr, stride, values, count, mask, BLOCK: tl.constexpr):
    """Per value: how many of the ``count`` nondecreasing ``ends_ptr[i * stride]`` are <= it."""
    found = tl.zeros(values.shape, tl.int32)
    for i0 in range(0, count, BLOCK):
        ii = i0 + tl.arange(0, BLOCK)
        ok = ii < count
        ends = tl.load(ends_ptr + ii * stride, mask=ok, other=_BIG)
        found += tl.sum(((ends[None, :] <= values[:, None]) & mask[:, None]).to(tl.int32), axis=1)
    return found


@dl.jit
def _compact_row(f, f_ok, cstart_ptr, counts_ptr, offsets_ptr, EL,
                 BLOCK_E: tl.constexpr):
    """Compact received row ``f`` (rows of the local experts back to back, expert ``e``'s from
    ``cstart[e]``): ``(row in the layout, kept)``, kept when within its expert's count."""
    el = tl.minimum(_search(cstart_ptr + 1, 1, f, EL - 1, f_ok, BLOCK_E), EL - 1)
    w = f - tl.load(cstart_ptr + el, mask=f_ok, other=0)
    keep = f_ok & (w < tl.load(counts_ptr + el, mask=f_ok, other=0))
    return tl.load(offsets_ptr + el, mask=f_ok, other=0) + w, keep


# ---- dispatch ----------------------------------------------------------------------------------

@dl.jit(do_not_specialize=(
    "n_tokens", "bad_kind", "bad_value", "rank", "world_size", "topk", "num_experts",
    "experts_local", "max_tokens", "capacity", "hidden", "rows_out", "cnt_half", "idx_half",
    "x_half", "s_half", "scratch_words", "cached", "padded", "alignment", "has_w", "det",
    "round_scale", "timeout_us", "op_id"))
def dispatch_kernel(
        x_ptr, w_ptr, src_ptr, dest_ptr, out_x, out_s, out_w, counts_ptr, offsets_ptr, cstart_ptr,
        n_tokens, bad_kind, bad_value,
        idx32_ptr, pos_ptr, prefix_ptr, count_ptr, bad_ptr, scratch_ptr,
        sig_ptr, table_ptr, cnt_sym, sorted_sym, wst_sym, xst_sym, sst_sym,
        err_claim, err_record, moe_claim, moe_record,
        rank, world_size, topk, num_experts, experts_local, max_tokens, capacity, hidden, rows_out,
        cnt_half, idx_half, x_half, s_half, scratch_words,
        cached, padded, alignment, has_w, det, round_scale, timeout_us, op_id,
        FP8: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_SR: tl.constexpr, BLOCK_SH: tl.constexpr, BLOCK_I: tl.constexpr,
        BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr, QUANT: tl.constexpr,
        STAGE: tl.constexpr):
    """One dispatch of this rank (see the module docstring). ``cached``: the layout comes from
    a handle (``src_ptr`` = its ``src_of_row``, ``counts/offsets/cstart`` its tensors, read);
    else it is computed (those tensors and ``dest_ptr`` are written). ``STAGE`` False (fp8
    only): ``quantize_kernel``, launched just before, staged the tokens."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + SIG_EPOCH_D, volatile=True).to(tl.int64) + 1
    parity = epoch % 2
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    hidden = hidden // VEC * VEC  # a multiple of VEC (host-checked): 16-byte row accesses
    x_half = x_half // VEC * VEC
    E = num_experts
    EL = experts_local
    n_entries = n_tokens * topk
    span = max_tokens * topk  # entries per source in src_of_row's packing
    per_expert = world_size * max_tokens
    scr = scratch_ptr + pid * scratch_words
    my_x = xst_sym + parity * x_half
    my_s = sst_sym + parity * s_half
    my_sorted = sorted_sym + parity * idx_half
    my_w = wst_sym + parity * idx_half
    my_cnt = cnt_sym + parity * cnt_half

    # ---- send -------------------------------------------------------------------------------
    if cached == 0:
        _exclusive_scan(count_ptr, scr, E, BLOCK_E)  # my experts' starts in my sorted list
        tl.debug_barrier()
        for i0 in range(pid * BLOCK_I, n_entries, nprog * BLOCK_I):
            ii = i0 + tl.arange(0, BLOCK_I)
            e = tl.load(idx32_ptr + ii, mask=ii < n_entries, other=-1)
            valid = e >= 0
            es = tl.maximum(e, 0)
            pos = _position(pos_ptr, prefix_ptr, ii, es, valid, E, det, CH)
            tl.store(my_sorted + tl.load(scr + es, mask=valid, other=0) + pos, ii, mask=valid)
    if STAGE:
        _stage_tokens(x_ptr, my_x, my_s, n_tokens, hidden, round_scale, pid, nprog, FP8, QUANT,
                      BLOCK_SR, BLOCK_SH)
    if has_w != 0:
        for i0 in range(pid * BLOCK_I, n_entries, nprog * BLOCK_I):
            ii = i0 + tl.arange(0, BLOCK_I)
            ok = ii < n_entries
            tl.store(my_w + ii, tl.load(w_ptr + ii, mask=ok), mask=ok)
    if cached == 0:
        if pid == 0:  # my counts and meta into row ``rank`` of every rank's count table
            bad = tl.load(bad_ptr)
            kind = tl.where(bad != _NO_BAD, _BAD_IDS, bad_kind)
            val_a = tl.where(bad != _NO_BAD, (bad >> 32).to(tl.int32), bad_value)
            val_b = tl.where(bad != _NO_BAD, (bad & 0xFFFFFFFF).to(tl.int32), max_tokens)
            for i in range(world_size):
                peer = (rank + i) % world_size
                dst = dl.peer_base(table_ptr, peer, rank, cnt_sym) + parity * cnt_half + rank * (E + _META)
                for e0 in range(0, E, BLOCK_E):
                    ex = e0 + tl.arange(0, BLOCK_E)
                    tl.store(dst + ex, tl.load(count_ptr + ex, mask=ex < E), mask=ex < E)
                tl.store(dst + E, n_tokens)
                tl.store(dst + E + 1, kind)
                tl.store(dst + E + 2, val_a)
                tl.store(dst + E + 3, val_b)
    for i in range(world_size):
        peer = (rank + i) % world_size
        dl.signal_add(dl.peer_base(table_ptr, peer, rank, sig_ptr) + SIG_READY_D + rank, 1)

    # ---- wait for every rank's staging --------------------------------------------------------
    ok = pid >= 0
    for peer in range(world_size):
        ok = ok & dl.wait_at_least(sig_ptr + SIG_READY_D + peer, epoch * nprog, deadline, err_claim,
                                   err_record, op_id, rank, peer, epoch)

    # ---- layout and receive -------------------------------------------------------------------
    if ok:
        if cached == 0:
            mine = _count_tables(my_cnt, scr, rank, world_size, E, EL, alignment, BLOCK_W, BLOCK_E)
            t_n = scr + E
            t_cs = scr + 2 * E
            t_exs = scr + 4 * E
            t_inc = t_exs + world_size * E
            t_src = t_inc + world_size * E
            t_al = t_src + world_size * E
            if pid == 0:
                _layout_outputs(counts_ptr, offsets_ptr, cstart_ptr, my_cnt, t_n, t_cs, t_al, mine,
                                moe_claim, moe_record, rank, world_size, E, EL, capacity, per_expert,
                                rows_out, padded, epoch, BLOCK_E)
            # where my entries land: owner * CAP + compact row, -1 when dropped (overflow)
            for i0 in range(pid * BLOCK_I, n_entries, nprog * BLOCK_I):
                ii = i0 + tl.arange(0, BLOCK_I)
                i_ok = ii < n_entries
                e = tl.load(idx32_ptr + ii, mask=i_ok, other=-1)
                valid = e >= 0
                es = tl.maximum(e, 0)
                w = tl.load(t_exs + rank * E + es, mask=valid, other=0) + _position(
                    pos_ptr, prefix_ptr, ii, es, valid, E, det, CH)
                compact = tl.load(t_cs + es, mask=valid, other=0) + w
                keep = valid & (compact < capacity) & ((padded == 0) | (w < per_expert))
                tl.store(dest_ptr + ii, tl.where(keep, (es // EL) * capacity + compact, -1), mask=i_ok)
            total = tl.minimum(mine, capacity)
            for f0 in range(pid * BLOCK_R, total, nprog * BLOCK_R):
                f = f0 + tl.arange(0, BLOCK_R)
                f_ok = f < total
                el = tl.minimum(_search(t_cs + rank * EL + 1, 1, f, EL - 1, f_ok, BLOCK_E), EL - 1)
                e = rank * EL + el
                w = f - tl.load(t_cs + e, mask=f_ok, other=0)
                s = tl.minimum(_search_sources(t_inc, e, w, f_ok, world_size, E, BLOCK_W), world_size - 1)
                q = w - tl.load(t_exs + s * E + e, mask=f_ok, other=0)
                keep = f_ok & ((padded == 0) | (w < per_expert))
                row = tl.where(padded != 0, el * per_expert + w, tl.load(t_al + el, mask=f_ok, other=0) + w)
                at = tl.load(t_src + s * E + e, mask=keep, other=0) + q
                entry = tl.load(dl.peer_base(table_ptr, s, rank, sorted_sym) + parity * idx_half + at,
                                mask=keep, other=0, cache_modifier=".cg")
                _receive_rows(out_x, out_s, out_w, src_ptr, row, keep, s, entry, table_ptr, rank,
                              xst_sym, sst_sym, wst_sym, parity, x_half, s_half, idx_half, hidden,
                              topk, span, has_w, 1, FP8, BLOCK_H)
        else:
            total = tl.minimum(tl.load(cstart_ptr + EL), capacity)
            for f0 in range(pid * BLOCK_R, total, nprog * BLOCK_R):
                f = f0 + tl.arange(0, BLOCK_R)
                f_ok = f < total
                row, keep = _compact_row(f, f_ok, cstart_ptr, counts_ptr, offsets_ptr, EL, BLOCK_E)
                src = tl.load(src_ptr + row, mask=keep, other=-1)
                keep = keep & (src >= 0)
                src = tl.maximum(src, 0)
                _receive_rows(out_x, out_s, out_w, src_ptr, row, keep, src // span, src % span,
                              table_ptr, rank, xst_sym, sst_sym, wst_sym, parity, x_half, s_half,
                              idx_half, hidden, topk, span, has_w, 0, FP8, BLOCK_H)

    # ---- the last program to finish publishes the epoch and clears the layout scratch -----------
    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + SIG_DONE_D, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        if cached == 0:
            for e0 in range(0, E, BLOCK_E):
                ex = e0 + tl.arange(0, BLOCK_E)
                tl.store(count_ptr + ex, tl.zeros((BLOCK_E,), tl.int32), mask=ex < E)
            tl.store(bad_ptr, _NO_BAD)
        tl.store(sig_ptr + SIG_EPOCH_D, epoch)
        tl.store(sig_ptr + SIG_DONE_D, 0)


@dl.jit(do_not_specialize=("n_tokens", "hidden", "x_half", "s_half", "round_scale"))
def quantize_kernel(x_ptr, sig_ptr, xst_sym, sst_sym, n_tokens, hidden, x_half, s_half, round_scale,
                    QUANT: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """fp8 dispatch, ``split`` variant (no waits): this rank's tokens quantized into the
    staging half of the coming dispatch epoch; the dispatch kernel (``STAGE`` False) then only
    moves bytes. Why: the fused staging loop runs on the dispatch's few large programs (one per
    SM), here many small ones fill the SMs. Grid-stride over the ``BLOCK_R`` x ``BLOCK_H`` tiles
    of ``n_tokens`` (a fixed grid, a few programs per SM: ``_launch.GPU_QUANT_PER_SM``), not a
    program per tile of the token bound, most of them idle at small counts. Same tile
    function, same bits. Writing the half is safe for the dispatch kernel's reason (stream
    order: this rank's previous dispatch waited for every peer's reads of it)."""
    epoch = tl.load(sig_ptr + SIG_EPOCH_D, volatile=True).to(tl.int64) + 1
    parity = epoch % 2
    hidden = hidden // VEC * VEC
    x_half = x_half // VEC * VEC
    n_chunks = tl.cdiv(hidden, BLOCK_H)
    n_tiles = tl.cdiv(n_tokens, BLOCK_R) * n_chunks
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        blk = tile // n_chunks
        chk = tile % n_chunks
        cur = _x_tile(x_ptr, blk, chk, tile + 1, n_chunks, n_tokens, hidden, BLOCK_R, BLOCK_H)
        _quantize_tile(cur, blk * BLOCK_R + tl.arange(0, BLOCK_R), chk * BLOCK_H, n_tokens, hidden,
                       xst_sym + parity * x_half, sst_sym + parity * s_half, round_scale, QUANT, BLOCK_H)


@dl.jit
def _search_sources(t_inc, e, w, mask, world_size, num_experts, BLOCK_W: tl.constexpr):
    """Per row: the source rank whose segment of expert ``e`` holds within-expert row ``w``."""
    found = tl.zeros(w.shape, tl.int32)
    for s0 in range(0, world_size, BLOCK_W):
        ss = s0 + tl.arange(0, BLOCK_W)
        m = mask[:, None] & (ss < world_size)[None, :]
        inc = tl.load(t_inc + ss[None, :] * num_experts + e[:, None], mask=m, other=_BIG)
        found += tl.sum(((inc <= w[:, None]) & m).to(tl.int32), axis=1)
    return found


@dl.jit
def _receive_rows(out_x, out_s, out_w, src_ptr, row, keep, s, entry, table_ptr, rank,
                  xst_sym, sst_sym, wst_sym, parity, x_half, s_half, idx_half, hidden, topk, span,
                  has_w, store_src, FP8: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows ``row`` of the outputs from entries ``entry`` of source ranks ``s`` (their staging
    of this epoch's parity): the token row (fp8: with its scales, loaded in the same steps),
    the weight, and (``store_src``) the source as ``s * span + entry``."""
    t = (entry // topk).to(tl.int64)
    x_rows = dl.peer_base(table_ptr, s, rank, xst_sym) + parity * x_half + t * hidden
    dst_rows = out_x + row.to(tl.int64) * hidden
    if FP8:
        NG: tl.constexpr = BLOCK_H // 128
        groups = hidden // 128
        s_rows = dl.peer_base(table_ptr, s, rank, sst_sym) + parity * s_half + t * groups
        dst_s = out_s + row.to(tl.int64) * groups
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = keep[:, None] & (cols < hidden)[None, :]
        v = tl.load(x_rows[:, None] + cols[None, :], mask=m, cache_modifier=".cg")
        if FP8:
            g = h0 // 128 + tl.arange(0, NG)
            gm = keep[:, None] & (g < groups)[None, :]
            sc = tl.load(s_rows[:, None] + g[None, :], mask=gm, cache_modifier=".cg")
            tl.store(dst_s[:, None] + g[None, :], sc, mask=gm)
        tl.store(dst_rows[:, None] + cols[None, :], v, mask=m)
    if has_w != 0:
        w = tl.load(dl.peer_base(table_ptr, s, rank, wst_sym) + parity * idx_half + entry, mask=keep,
                    other=0.0, cache_modifier=".cg")
        tl.store(out_w + row, w, mask=keep)
    tl.store(src_ptr + row, s * span + entry, mask=keep & (store_src != 0))


@dl.jit
def _layout_outputs(counts_ptr, offsets_ptr, cstart_ptr, my_cnt, t_n, t_cs, t_al, mine,
                    moe_claim, moe_record, rank, world_size, E, EL, capacity, per_expert, rows_out,
                    padded, epoch, BLOCK_E: tl.constexpr):
    """Program 0 after the count exchange: this rank's kept counts, layout offsets and compact
    starts; the first bad input of any source, else the first overflowing expert, into the
    MoE error record."""
    first = tl.full((), _BIG, tl.int32)
    for l0 in range(0, EL, BLOCK_E):
        el = l0 + tl.arange(0, BLOCK_E)
        ok = el < EL
        n = tl.load(t_n + rank * EL + el, mask=ok, other=0)
        cs = tl.load(t_cs + rank * EL + el, mask=ok, other=0)
        kept = tl.minimum(n, tl.maximum(capacity - cs, 0))
        kept = tl.where(padded != 0, tl.minimum(kept, per_expert), kept)
        off = tl.where(padded != 0, el * per_expert, tl.minimum(tl.load(t_al + el, mask=ok, other=0), rows_out))
        tl.store(counts_ptr + el, kept, mask=ok)
        tl.store(offsets_ptr + el, off, mask=ok)
        tl.store(cstart_ptr + el, cs, mask=ok)
        first = tl.minimum(first, tl.min(tl.where(ok & (kept < n), el, _BIG), axis=0))
    tl.store(offsets_ptr + EL, tl.where(padded != 0, EL * per_expert, tl.minimum(tl.load(t_al + EL), rows_out)))
    tl.store(cstart_ptr + EL, mine)
    bad_src = tl.full((), _BIG, tl.int32)
    for s in range(world_size):
        kind = tl.load(my_cnt + s * (E + _META) + E + 1, cache_modifier=".cg")
        bad_src = tl.where((bad_src == _BIG) & (kind != 0), s, bad_src)
    if bad_src != _BIG:
        meta = my_cnt + bad_src * (E + _META) + E
        _record(moe_claim, moe_record, tl.load(meta + 1, cache_modifier=".cg"), bad_src,
                tl.load(meta + 2, cache_modifier=".cg"), tl.load(meta + 3, cache_modifier=".cg"), 0, epoch)
    elif first != _BIG:
        n = tl.load(t_n + rank * EL + first)
        cs = tl.load(t_cs + rank * EL + first)
        room = tl.maximum(tl.minimum(capacity - cs, tl.where(padded != 0, per_expert, capacity)), 0)
        _record(moe_claim, moe_record, _OVERFLOW, rank, rank * EL + first, n, room, epoch)
