"""Kernels of ``flash_decode``: local split-KV attention, then a rank-ordered LSE merge.

Schedule of one call (rank r; ``ag_start_kernel`` is the start barrier)::

    start barrier | split-KV: one program per (batch b, KV head, chunk of `chunk` keys)     | merge:
                  |   q of the G = Hq/Hkv query heads x this chunk's keys -> (o, lse)      |  chunks of r in order
                  |   (online softmax in fp32; a chunk past kv_lens[b] gives lse = -inf) |  -> (o_r, lse_r), pushed
                  |                                                                       |  to slot r of every rank;
                  |                                                                       |  wait; ranks 0..W-1 in order

Merge of two partials (fp32): ``lse = max + log(e^(lse_a - max) + e^(lse_b - max))``,
``o = o_a e^(lse_a - lse) + o_b e^(lse_b - lse)``; a partial with ``lse = -inf`` (no keys) is
skipped, so empty chunks and ranks change nothing, bit for bit. The merge order is fixed
(a rank's chunks left to right, then ranks 0..W-1), and the chunk size never depends on the
batch or the GPU, so with ``deterministic`` the output is bitwise reproducible and each query's
result is independent of the other queries in the batch.

Signal pad (``ag_gemm`` layout): ``arrivals[s]`` at ``s`` counts merge programs of rank s that
pushed here (cumulative, ``epoch * programs`` per call); start counts at ``[W, 2W)``; epoch ``3W``.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl

NEG_INF = tl.constexpr(float("-inf"))


@dl.jit(do_not_specialize=("chunk", "num_chunks", "stride_qb", "stride_qh", "stride_kb", "stride_ks",
                           "stride_kh", "stride_vb", "stride_vs", "stride_vh"))
def split_kv_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, o_part, lse_part, sm_scale, chunk, num_chunks,
                    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh,
                    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Partial attention of the G query heads of KV head ``program_id(1)`` over one chunk."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.program_id(2)
    length = tl.load(lens_ptr + b).to(tl.int32)
    start = c * chunk
    end = tl.minimum(start + chunk, length)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    heads = kvh * G + offs_g
    g_ok = offs_g < G
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)
    m = tl.full((BLOCK_G,), NEG_INF, tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        s = tl.where(n_ok[None, :], s, NEG_INF)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    has = l > 0
    o = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), NEG_INF)
    pair = (b * HQ + heads).to(tl.int64)
    tl.store(o_part + (pair * num_chunks + c)[:, None] * D + offs_d[None, :], o, mask=g_ok[:, None])
    tl.store(lse_part + pair * num_chunks + c, lse, mask=g_ok)


@dl.jit
def _merge(o_acc, lse_acc, o_new, lse_new):
    """Fold partial ``(o_new, lse_new)`` into the running ``(o_acc, lse_acc)`` (fp32)."""
    if lse_new != NEG_INF:
        if lse_acc == NEG_INF:
            o_acc = o_new
            lse_acc = lse_new
        else:
            top = tl.maximum(lse_acc, lse_new)
            lse = top + tl.log(tl.exp(lse_acc - top) + tl.exp(lse_new - top))
            o_acc = o_acc * tl.exp(lse_acc - lse) + o_new * tl.exp(lse_new - lse)
            lse_acc = lse
    return o_acc, lse_acc


@dl.jit(do_not_specialize=("pairs", "num_chunks", "rank", "world_size", "timeout_us", "op_id"))
def decode_merge_kernel(o_part, lse_part, out_ptr, buf_ptr, buf_table, sig_ptr, sig_table,
                        err_claim, err_record, pairs, num_chunks, rank, world_size, timeout_us,
                        op_id, D: tl.constexpr):
    """Merge this rank's chunks per (b, head), push to every rank, wait, merge ranks in order."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
    offs_d = tl.arange(0, D)
    row = D + 1  # o, then lse
    slot = pairs.to(tl.int64) * row
    for p in range(pid, pairs, nprog):
        o_acc = tl.zeros((D,), tl.float32)
        lse_acc = tl.full((), NEG_INF, tl.float32)
        base = tl.cast(p, tl.int64) * num_chunks
        for c in range(num_chunks):
            lse_c = tl.load(lse_part + base + c)
            o_c = tl.load(o_part + (base + c) * D + offs_d)
            o_acc, lse_acc = _merge(o_acc, lse_acc, o_c, lse_c)
        for i in range(world_size):
            dst = (rank + i) % world_size
            at = dl.remote_ptr(buf_table, dst, buf_ptr) + rank * slot + p * row
            tl.store(at + offs_d, o_acc)
            tl.store(at + D, lse_acc)
    for i in range(world_size):
        dl.signal_add(dl.remote_ptr(sig_table, (rank + i) % world_size, sig_ptr) + rank, 1)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    ok = pid >= 0
    for s in range(world_size):
        ok = ok & dl.wait_at_least(sig_ptr + s, epoch * nprog, deadline, err_claim, err_record,
                                   op_id, rank, s, epoch)
    if ok:
        for p in range(pid, pairs, nprog):
            o_acc = tl.zeros((D,), tl.float32)
            lse_acc = tl.full((), NEG_INF, tl.float32)
            for s in range(world_size):  # rank order
                at = buf_ptr + s * slot + p * row
                lse_s = tl.load(at + D, volatile=True)
                o_s = tl.load(at + offs_d, volatile=True)
                o_acc, lse_acc = _merge(o_acc, lse_acc, o_s, lse_s)
            tl.store(out_ptr + tl.cast(p, tl.int64) * D + offs_d, o_acc.to(out_ptr.dtype.element_ty))
