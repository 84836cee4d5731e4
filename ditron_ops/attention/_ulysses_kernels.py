"""Kernel of ``ulysses_attention``: packed q/k/v exchange, flash attention, and the output
exchange in the attention epilogue, in one persistent launch per call.

Rank r of W holds the sequence chunk r (``S_r`` rows) of every head; after the exchange it owns
query heads ``[r Hq_l, (r+1) Hq_l)`` (``Hq_l = Hq / W``) and their KV heads (``Hkv / W`` of
them, or the one its query heads use when ``W % Hkv == 0``: the destination addressing
replicates) over the whole sequence ``S = W S_r``. Schedule of one call (program p of P)::

    push   for d in r, r-1, ..., r+1:  q/k/v rows of d's heads -> d's receive buffers at rows
           [r S_r, (r+1) S_r) (head-major, no permute: the addressing does it);
           signal in[r] of d (1 per program, + UNIT - P from program 0)
    tiles  (b, head, query block) tiles p, then the next round's in snake order; a tile waits
           for in[c] of its query chunk c and for the key chunks it reads, as it reaches them
           (rotated: chunk r first, the one copied locally), attends them (online softmax,
           fp32), and stores its output rows straight into their owner c's output: this rank's
           own rows into ``out``, a peer's into its staging buffer + signal out[r] of c
    tail   for s != r: wait out[s], copy s's heads of the staging buffer into ``out``
    last program to finish: epoch = e

    rank r   | push q,k,v -> r, r-1, .. | tiles: wait chunk, attend, store/send | wait out, copy |
    rank r+1 |  push ..       | tiles (start when their first chunks landed) ...          | ...

The tail's copy is the only extra pass: peers can store only into symmetric memory (one process
per GPU), and the returned tensor must outlive the workspace's double buffering; this rank's own
rows (a 1/W share) skip it, and it copies each peer's part as soon as that peer's tiles landed,
while this rank's other programs may still compute. Programs push before they compute (by bytes
and FLOPs the push is 1-2% of the attention at 8k tokens, not yet measured) so peers' tiles
wait as little as possible.

Keys are visited chunk by chunk in a fixed order (r, r+1, ..., then 0, .., r-1; causal: only
chunks up to the tile's own, its diagonal blocks masked). When ``S_r`` is a multiple of
``BLOCK_N`` the chunks that have already landed are attended as one run (one pipelined loop,
no ramp per chunk); the blocks, their order and their masks are the same either way, so
results never depend on arrival order. No atomics touch data: bitwise identical run to run.

Co-residency: the grid is persistent (``P <= group.sm_share()``, the rank's share of the SMs
in a virtual world; one program in the interpreter, which runs a grid's programs one after the
other), so every program of every rank is resident at once and each wait depends only on
peers' pushes (which never wait) or on their tiles (which wait only for pushes). A program's
first tile may wait for a chunk that its own grid's programs push: they are resident too. In a
virtual world of W = 8 on 132 SMs the ranks' grids use 128 SMs (one program per SM: 230 KB of
shared memory and 255 registers a thread at 128x128 tiles, D = 128).

Signals (receiver's pad, never reset; a call adds exactly ``UNIT`` to each word a peer
signals, so ``flag >= epoch * UNIT`` means that peer's whole call landed)::

    [0, W)          in[s]     q/k/v chunk of rank s
    [W, 2W)         out[s]    output tiles from rank s (1 per tile + a complement from program 0)
    3W, 3W + 1      epoch, programs finished (reset by the last)
    [3W+2, 5W+2)    meta[e % 2][s]  rank s's shape fingerprint (checked: DitronSizeMismatchError;
                    after the counters, so W = 1 does not alias them)

Buffers are double buffered by epoch parity (two fixed halves of the workspace): rank s writes
half ``e % 2`` of rank d again at call ``e + 2``, after it waited for d's output tiles of call
``e + 1``, which d sends only after its call ``e`` finished reading.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl

UNIT = tl.constexpr(16777216)
"""What one call adds to each signal word of a peer (2^24: more than any grid's programs or any
call's tiles per owner; the host checks)."""
NEG_INF = tl.constexpr(float("-inf"))
LOG2E = tl.constexpr(1.4426950408889634)


@dl.jit
def _push_heads(src, sb, ss, sh, head0, dst, batch, seq_r, heads, seq, first, pid, nprog,
                D: tl.constexpr, BLOCK_R: tl.constexpr, VEC: tl.constexpr):
    """Rows ``[b, s, head0 + h, :]`` (``h < heads``) of this rank's shard into ``dst`` laid out
    ``[B, heads, seq, D]`` at sequence position ``first + s``; ``BLOCK_R`` head rows per tile,
    tiles ``pid, pid + nprog, ...``. Strides are multiples of ``VEC`` (16-byte vectors)."""
    sb = sb // VEC * VEC
    ss = ss // VEC * VEC
    sh = sh // VEC * VEC
    src += head0 * sh
    n = batch.to(tl.int64) * seq_r * heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    for t0 in range(pid * BLOCK_R, n, nprog * BLOCK_R):
        t = t0 + offs_r
        h = t % heads
        bs = t // heads
        s = bs % seq_r
        b = bs // seq_r
        ok = (t < n)[:, None]
        x = tl.load(src + (b * sb + s * ss + h * sh)[:, None] + offs_d[None, :], mask=ok)
        tl.store(dst + (((b * heads + h) * seq + first + s) * D)[:, None] + offs_d[None, :], x,
                 mask=ok)


@dl.jit
def _chunk_landed(seen, ok, s, blocking, sig_ptr, epoch, parity, fingerprint, world_size,
                  timeout_us, err_claim, err_record, op_id, rank):
    """Whether key chunk ``s`` is here: bit s of ``seen`` (this program saw it land this call;
    chunks from 63 on have no bit and are checked each time), else its ``in[s]`` flag, waited
    for (``blocking``, bounded) or polled once. A chunk that lands has its fingerprint checked.
    After a failed wait (``ok`` false) nothing more waits. Returns ``(seen, ok, landed)``."""
    one = tl.full((), 1, tl.int64)
    bit = tl.where(s < 63, one << tl.minimum(s, 62).to(tl.int64), 0)
    need = ((seen & bit) == 0) & ok
    landed = need == 0
    if need:
        target = epoch * UNIT
        if blocking:
            deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
            landed = dl.wait_at_least(sig_ptr + s, target, deadline, err_claim, err_record,
                                      op_id, rank, s, epoch)
            ok = ok & landed
        else:
            landed = tl.atomic_add(sig_ptr + s, 0, sem="acquire", scope="sys") >= target
        if landed:
            got = tl.load(sig_ptr + 3 * world_size + 2 + parity * world_size + s, volatile=True)
            if got != fingerprint:
                dl.record_error(err_claim, err_record, op_id, rank, s, epoch, dl.SIZE_MISMATCH)
            ok = ok & (got == fingerprint)
            seen = seen | bit
            dl.fence_proxy_async()  # peers' plain stores, read next through TMA
    return seen, ok, landed


@dl.jit
def _attend(acc, l_i, m_i, q, k_desc, v_desc, k_row, v_row, lo, split, hi, rows, qk_scale,
            causal, BLOCK_N: tl.constexpr):
    """Online softmax over keys ``[lo, hi)`` in blocks of ``BLOCK_N`` from ``lo``: blocks below
    ``split`` are whole and unmasked (the pipelined hot loop); the rest are masked to keys below
    ``hi`` and, when ``causal``, at most the query row. Scores in the exp2 domain, fp32."""
    for n in tl.range(lo, split, BLOCK_N):
        k = k_desc.load([k_row + n, 0])
        qk = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([v_row + n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    offs_n = tl.arange(0, BLOCK_N)
    for n in tl.range(split, hi, BLOCK_N):
        keys = n + offs_n
        key_ok = keys < hi
        mask = key_ok[None, :] & ((causal == 0) | (rows[:, None] >= keys[None, :]))
        k = k_desc.load([k_row + n, 0])
        qk = tl.where(mask, tl.dot(q, k.T) * qk_scale, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row without keys yet stays empty
        p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([v_row + n, 0])
        v = tl.where(key_ok[:, None], v, 0.0).to(v.dtype)  # rows past a chunk: other data
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@dl.jit(do_not_specialize=(
    "batch", "seq_r", "hq", "hkv", "hq_l", "hkv_l", "rank", "world_size",
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
    "stride_vb", "stride_vs", "stride_vh", "stride_ob", "stride_os", "stride_oh",
    "q_off", "k_off", "v_off", "stage_off", "half_elems", "causal", "sm_scale", "merge_runs",
    "pack", "fingerprint", "timeout_us", "op_id"))
def ulysses_attention_kernel(
        q_ptr, k_ptr, v_ptr, q_desc, k_desc, v_desc, buf_ptr, buf_table, out_ptr,
        sig_ptr, sig_table, err_claim, err_record,
        batch, seq_r, hq, hkv, hq_l, hkv_l, rank, world_size,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
        q_off, k_off, v_off, stage_off, half_elems, causal, sm_scale, merge_runs, pack,
        fingerprint, timeout_us, op_id,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        VEC: tl.constexpr):
    """One call (module docstring). ``q_desc`` / ``k_desc`` / ``v_desc`` view ``buf_ptr``'s
    elements as ``[rows, D]`` (blocks ``[BLOCK_M, D]`` and ``[BLOCK_N, D]``); the receive
    regions of a half start at element offsets ``q_off``, ``k_off``, ``v_off`` (head-major
    ``[B, H_l, S, D]``) and the staging buffer, laid out as ``out``, at ``stage_off``.

    ``pack == 0`` is plain local attention on one rank (``local_attention``): the descriptors
    are over ``[B, H, S, D]`` inputs, nothing is pushed or waited for, and ``out`` has the
    strides given. ``merge_runs``: ``S_r`` is a multiple of ``BLOCK_N`` (chunks that landed are
    attended in one loop). Every integer is unspecialized: a call with new sizes must not
    compile while peers wait.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    seq = seq_r * world_size
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64) + 1
    parity = epoch % 2
    half = parity * (half_elems // D * D)
    nqb = tl.cdiv(seq_r, BLOCK_M)
    unit = tl.full((), UNIT, tl.int64)
    # ``x // VEC * VEC``: the host keeps these multiples of 16 bytes; written so, the compiler
    # knows it and vectorizes the copies
    stride_ob = stride_ob // VEC * VEC
    stride_os = stride_os // VEC * VEC
    stride_oh = stride_oh // VEC * VEC
    q_off = q_off // VEC * VEC
    k_off = k_off // VEC * VEC
    v_off = v_off // VEC * VEC
    stage_off = stage_off // VEC * VEC

    # ---- push this rank's chunk of every destination's heads -----------------------------------
    if pack != 0:
        if pid == 0:  # complete every peer's out[rank] to UNIT for this call (tiles add 1 each)
            for i in range(1, world_size):
                peer = dl.remote_ptr(sig_table, (rank + i) % world_size, sig_ptr)
                dl.signal_add(peer + world_size + rank, unit - batch.to(tl.int64) * hq_l * nqb)
        for i in range(world_size):
            d = (rank - i + world_size) % world_size
            dst = dl.peer_base(buf_table, d, rank, buf_ptr) + half
            kv0 = d * hkv // world_size
            _push_heads(q_ptr, stride_qb, stride_qs, stride_qh, d * hq_l, dst + q_off, batch,
                        seq_r, hq_l, seq, rank * seq_r, pid, nprog, D, BLOCK_R, VEC)
            _push_heads(k_ptr, stride_kb, stride_ks, stride_kh, kv0, dst + k_off, batch, seq_r,
                        hkv_l, seq, rank * seq_r, pid, nprog, D, BLOCK_R, VEC)
            _push_heads(v_ptr, stride_vb, stride_vs, stride_vh, kv0, dst + v_off, batch, seq_r,
                        hkv_l, seq, rank * seq_r, pid, nprog, D, BLOCK_R, VEC)
            peer = dl.remote_ptr(sig_table, d, sig_ptr)
            if pid == 0:
                tl.store(peer + 3 * world_size + 2 + parity * world_size + rank,
                         fingerprint.to(tl.int64))
            dl.signal_add(peer + rank, tl.where(pid == 0, unit - nprog + 1, 1))

    # ---- attention tiles ----------------------------------------------------------------------
    seen = tl.zeros((), tl.int64)
    seen = tl.where(pack == 0, -1, seen)  # local attention: every chunk is there
    ok = pid >= 0
    qk_scale = sm_scale * LOG2E
    group = hq_l // hkv_l
    bh_n = batch * hq_l
    n_g = world_size * nqb
    n_tiles = n_g * bh_n
    q_row0 = ((half + q_off) // D).to(tl.int32)  # descriptor coordinates are 32-bit
    k_row0 = ((half + k_off) // D).to(tl.int32)
    v_row0 = ((half + v_off) // D).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    for rnd in range(0, tl.cdiv(n_tiles, nprog)):
        t = rnd * nprog + tl.where(rnd % 2 == 0, pid, nprog - 1 - pid)  # snake: balances LPT
        if t < n_tiles:
            g_lin = t // bh_n
            bh = t % bh_n
            # causal: longest rows first; else this rank's own chunk first
            g = tl.where(causal != 0, n_g - 1 - g_lin, (rank * nqb + g_lin) % n_g)
            c = g // nqb
            m0 = c * seq_r + (g % nqb) * BLOCK_M
            m_hi = tl.minimum(m0 + BLOCK_M, (c + 1) * seq_r)
            b = bh // hq_l
            h = bh % hq_l
            seen, ok, _ = _chunk_landed(seen, ok, c, True, sig_ptr, epoch, parity, fingerprint,
                                        world_size, timeout_us, err_claim, err_record, op_id,
                                        rank)
            q = q_desc.load([q_row0 + (b * hq_l + h) * seq + m0, 0])
            kvh = h // group
            k_row = k_row0 + (b * hkv_l + kvh) * seq
            v_row = v_row0 + (b * hkv_l + kvh) * seq
            rows = m0 + offs_m
            m_i = tl.full((BLOCK_M,), NEG_INF, tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, D), tl.float32)
            # up to two segments of consecutive chunks: [r S_r, end) then [0, r S_r)
            own = rank * seq_r
            first_lo = tl.where((causal != 0) & (rank > c), 0, own)
            first_hi = tl.where(causal != 0, m_hi, seq)
            second_hi = tl.where(first_lo == 0, 0, own)
            for part in range(2):
                lo = tl.where(part == 0, first_lo, 0)
                hi = tl.where(part == 0, first_hi, second_hi)
                x = lo
                while x < hi:
                    s = x // seq_r
                    seen, ok, _ = _chunk_landed(seen, ok, s, True, sig_ptr, epoch, parity,
                                                fingerprint, world_size, timeout_us, err_claim,
                                                err_record, op_id, rank)
                    y = tl.minimum(hi, (s + 1) * seq_r)
                    more = (merge_runs != 0) & (y < hi)
                    while more:
                        seen, ok, landed = _chunk_landed(seen, ok, y // seq_r, False, sig_ptr,
                                                         epoch, parity, fingerprint, world_size,
                                                         timeout_us, err_claim, err_record,
                                                         op_id, rank)
                        y = tl.where(landed, tl.minimum(hi, y + seq_r), y)
                        more = landed & (y < hi)
                    # whole unmasked blocks end where the causal mask starts (the diagonal)
                    lim = tl.where((causal != 0) & (part == 0) & (y == hi), m0 + 1, y)
                    split = x + tl.maximum(lim - x, 0) // BLOCK_N * BLOCK_N
                    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_desc, v_desc, k_row, v_row, x,
                                            split, y, rows, qk_scale, causal, BLOCK_N)
                    x = y
            # epilogue: the rows go straight to their owner c
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            row_ok = (rows < m_hi)[:, None]
            offs = (b.to(tl.int64) * stride_ob + (rows - c * seq_r).to(tl.int64) * stride_os
                    + (rank * hq_l + h) * stride_oh)
            ptrs = offs[:, None] + offs_d[None, :]
            if c == rank:
                tl.store(out_ptr + ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok)
            else:
                stage = dl.peer_base(buf_table, c, rank, buf_ptr) + half + stage_off
                tl.store(stage + ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok)
                dl.signal_add(dl.remote_ptr(sig_table, c, sig_ptr) + world_size + rank, 1)

    # ---- tail: the peers' heads of this rank's rows, from the staging buffer ------------------
    if pack != 0:
        n = batch.to(tl.int64) * seq_r * hq_l
        offs_r = tl.arange(0, BLOCK_R)
        for i in range(1, world_size):
            s = (rank + i) % world_size
            if ok:
                deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
                ok = dl.wait_at_least(sig_ptr + world_size + s, epoch * UNIT, deadline,
                                      err_claim, err_record, op_id, rank, s, epoch)
            if ok:
                for t0 in range(pid * BLOCK_R, n, nprog * BLOCK_R):
                    t = t0 + offs_r
                    h = t % hq_l
                    bs = t // hq_l
                    head = s * hq_l + h
                    src = (bs * hq + head) * D  # the staging buffer is contiguous [B, S_r, Hq, D]
                    dst = (bs // seq_r) * stride_ob + (bs % seq_r) * stride_os + head * stride_oh
                    mask = (t < n)[:, None]
                    x = tl.load(buf_ptr + half + stage_off + src[:, None] + offs_d[None, :],
                                mask=mask, cache_modifier=".cg")
                    tl.store(out_ptr + dst[:, None] + offs_d[None, :], x, mask=mask)

    tl.debug_barrier()
    finished = tl.atomic_add(sig_ptr + 3 * world_size + 1, 1, sem="acq_rel", scope="gpu")
    if finished == nprog - 1:
        tl.store(sig_ptr + 3 * world_size, epoch)
        tl.store(sig_ptr + 3 * world_size + 1, 0)
