"""Kernels of ``flash_decode``: local split-KV attention, a chunk combine, a rank-ordered merge.

Schedule of one call (rank r)::

    split-KV: one program per (batch b,   | combine: per (b, head) pair,   | merge (W > 1 only):
    KV head, chunk of `chunk` keys): the  |   this rank's chunks -> (o_r,  |   signal every rank, wait for
    G = Hq/Hkv query heads x the chunk's  |   lse_r); one rank: write out; |   all, merge ranks 0..W-1
    keys -> (o, lse) (online softmax in   |   else push to slot r of every |   -> out
    fp32; no keys -> lse = -inf)          |   rank's exchange buffer       |

With W > 1 the start barrier (``language.barrier.start_barrier_kernel``) precedes the push: a slot is rewritten only
after every rank has entered this call, so nobody still reads the previous call's partials. One
rank with one chunk per pair skips the combine: split-KV writes the output (``DIRECT``; the
combine of one partial would return it unchanged).

Merge of n partials (fp32, used for chunks and for ranks): ``top = max lse_i``,
``w_i = e^(lse_i - top)`` (exactly 0 for an empty partial), ``o = sum w_i o_i / sum w_i``,
``lse = top + log(sum w_i)``. The sums run in a fixed order (chunks in fixed blocks of
``BLOCK_C`` positions, blocks left to right; ranks 0..W-1) and empty partials add exact zeros, so
a longer cache or an empty rank changes nothing. The chunk size never depends on the batch or the
GPU in deterministic mode, so the output is bitwise reproducible and each query's result is
independent of the other queries in the batch.

Signal pad (``ag_gemm`` layout): ``arrivals[s]`` at ``s`` counts calls whose partials rank s
pushed here (one signal per call, after the push kernel completed); start counts at ``[W, 2W)``;
epoch ``3W``.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as dl

NEG_INF = tl.constexpr(float("-inf"))


@dl.jit
def _flush(o_part, lse_part, acc, m, l, pair, num_parts, part, g_ok, D: tl.constexpr,
           DIRECT: tl.constexpr):
    """Store one partial ``(o, lse)`` of the program's query heads (``lse = -inf``: no keys).
    ``DIRECT``: ``o_part`` is the output ``[B * Hq, D]`` and ``o`` is stored in its dtype (the
    combine of a single partial returns it unchanged, so the bits are the same)."""
    has = l > 0
    o = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    row = pair * num_parts + part
    tl.store(o_part + row[:, None] * D + tl.arange(0, D)[None, :], o.to(o_part.dtype.element_ty),
             mask=g_ok[:, None])
    if not DIRECT:
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), NEG_INF)
        tl.store(lse_part + row, lse, mask=g_ok)


@dl.jit
def _table_entries(table_row, offs_n, hi, PAGE: tl.constexpr):
    """The table entries of the keys ``offs_n`` (one per key; 0 at and past ``hi``)."""
    return tl.load(table_row + offs_n // PAGE, mask=offs_n < hi, other=0)


@dl.jit
def _page_rows(table_row, entries, offs_n, n_ok, n0, num_pages, bad_first,
               BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Pages of the keys ``offs_n`` (block starting at ``n0``) and their slots: ``(page, slot,
    bad_first)``. An entry outside ``[0, num_pages)`` reads page 0 instead (never past the
    cache) and lowers ``bad_first`` (per lane, the first bad table column seen; an elementwise
    min, so the loop reduces nothing per block). ``PAGE >= BLOCK_N``: the block lies in one page
    (blocks start at multiples of ``BLOCK_N``), one scalar table read. Else ``entries``: the
    block's per-key entries (``_table_entries``), loaded one block ahead by the caller: K/V
    addresses that hang on a table load of the same iteration left Triton's pipeliner one
    K/V buffer and no load in flight under the math (sm_90a TTGIR; contiguous keys get two)."""
    if PAGE >= BLOCK_N:
        entry = tl.load(table_row + n0 // PAGE)
        bad = (entry < 0) | (entry >= num_pages)
        page = tl.where(bad, 0, entry)
        slot = n0 % PAGE + tl.arange(0, BLOCK_N)
        bad_first = tl.minimum(bad_first, tl.where(bad, n0 // PAGE, bad_first))
    else:
        bad = n_ok & ((entries < 0) | (entries >= num_pages))
        page = tl.where(bad, 0, entries)
        slot = offs_n % PAGE
        bad_first = tl.minimum(bad_first, tl.where(bad, offs_n // PAGE, bad_first))
    return page.to(tl.int64), slot.to(tl.int64), bad_first


@dl.jit(do_not_specialize=("lens_ptr", "heads", "part_len", "prog_len", "num_parts", "seq_len",
                           "rank", "op_id", "table_ptr", "stride_tb", "num_pages", "table_op"))
def split_kv_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, o_part, lse_part, sm_scale, heads, part_len, prog_len,
                    num_parts, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, seq_len, err_claim, err_record, rank, op_id,
                    table_ptr, stride_tb, num_pages, table_op,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr, FLUSH: tl.constexpr, DIRECT: tl.constexpr,
                    PAGE: tl.constexpr):
    """Attention of the G query heads of KV head ``program_id(1)`` over keys
    ``[s * prog_len, (s + 1) * prog_len)`` of batch ``program_id(0)`` (``s = program_id(2)``),
    one partial per ``part_len`` keys (``FLUSH``: several per program; else ``part_len ==
    prog_len``). A partial's value never depends on which program computed it. ``DIRECT`` (one
    rank, one partial per pair): the program's partial is the output, written to ``o_part``
    in the output's dtype (zeros for an empty sequence), and no combine follows. A length
    outside ``[0, seq_len]`` (the cache's S_max) is clamped into it, so no key past the cache
    is read, and recorded (``BAD_INPUT``: index ``b``, the value) for the next host check.

    ``PAGE`` > 0 (paged cache, ``_page_rows``): ``k_ptr``/``v_ptr`` are ``[num_pages, PAGE,
    Hkv, D]`` (``stride_kb``/``stride_vb`` the page strides), key ``n`` of sequence ``b`` lives in
    page ``table[b, n // PAGE]`` at slot ``n % PAGE``, ``seq_len`` is the table's capacity
    (``max_blocks x PAGE``; 0 without pages). Only the addresses differ from ``PAGE == 0``: the
    arithmetic is the same code, so the same keys give the same bits. A table entry outside
    ``[0, num_pages)`` reads page 0 and is recorded (op ``table_op``, index ``b x max_blocks +
    column``, the entry)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = tl.program_id(2) * prog_len
    n = tl.load(lens_ptr + b).to(tl.int64)  # int64 kv_lens: checked before any narrowing
    if ((n < 0) | (n > seq_len)) & (kvh == 0) & (tl.program_id(2) == 0):
        dl.record_error(err_claim, err_record, op_id, rank, b, n, dl.BAD_INPUT)
    hi = tl.minimum(lo + prog_len, tl.minimum(tl.maximum(n, 0), seq_len).to(tl.int32))
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    head = kvh * G + offs_g
    g_ok = offs_g < G
    pair = (b * heads + head).to(tl.int64)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)
    m = tl.full((BLOCK_G,), NEG_INF, tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    if PAGE == 0:
        k_base = k_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
        v_base = v_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh
    else:
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        table_row = table_ptr + b.to(tl.int64) * stride_tb
        no_bad = seq_len // PAGE + 1  # past every table column
        bad_first = tl.full((BLOCK_N,), 0, tl.int32) + no_bad
        entries = _table_entries(table_row, lo + tl.arange(0, BLOCK_N), hi, PAGE)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if PAGE == 0:
            k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
        else:
            page, slot, bad_first = _page_rows(table_row, entries, offs_n, n_ok, n0, num_pages,
                                               bad_first, BLOCK_N, PAGE)
            if PAGE < BLOCK_N:  # the next block's entries, one block ahead (``_page_rows``)
                entries = _table_entries(table_row, offs_n + BLOCK_N, hi, PAGE)
            k = tl.load(k_base + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        s = tl.where(n_ok[None, :], s, NEG_INF)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if PAGE == 0:
            v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
        else:
            v = tl.load(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
        if FLUSH:
            if ((n0 + BLOCK_N) % part_len == 0) | (n0 + BLOCK_N >= hi):
                _flush(o_part, lse_part, acc, m, l, pair, num_parts, n0 // part_len, g_ok, D, False)
                m = tl.full((BLOCK_G,), NEG_INF, tl.float32)
                l = tl.zeros((BLOCK_G,), tl.float32)
                acc = tl.zeros((BLOCK_G, D), tl.float32)
    if PAGE > 0:
        col = tl.min(bad_first, axis=0)
        if col < no_bad:  # one reduction per program, after the loop
            dl.record_error(err_claim, err_record, table_op, rank,
                            b.to(tl.int64) * (seq_len // PAGE) + col, tl.load(table_row + col),
                            dl.BAD_INPUT)
    if DIRECT:
        _flush(o_part, lse_part, acc, m, l, pair, 1, 0, g_ok, D, True)
    elif not FLUSH:
        if lo < hi:
            _flush(o_part, lse_part, acc, m, l, pair, num_parts, lo // part_len, g_ok, D, False)


@dl.jit
def _weights(lse, top):
    """``exp(lse - top)`` with empty partials (``lse = -inf``) weighing exactly 0."""
    safe = tl.where(top == NEG_INF, 0.0, top)
    return tl.where(lse == NEG_INF, 0.0, tl.exp(lse - safe))


@dl.jit
def _finish(acc, total, top):
    """``(o, lse)`` of a merge from its weighted sum ``acc``, weight ``total`` and max ``top``."""
    has = total > 0
    o = acc / tl.where(has, total, 1.0)[:, None]
    return o, tl.where(has, top + tl.log(tl.where(has, total, 1.0)), NEG_INF)


# lens_ptr unspecialized (here and in split-KV): a slice kv_lens[j:j+1] is not 16-byte aligned,
# and compiling that variant at plan build while peers spin can deadlock (DESIGN.md §4)
@dl.jit(do_not_specialize=("lens_ptr", "pairs", "heads", "part_len", "num_parts", "rank",
                           "world_size", "seq_len"))
def chunk_combine_kernel(o_part, lse_part, lens_ptr, out_ptr, buf_ptr, buf_table, pairs, heads,
                         part_len, num_parts, rank, world_size, seq_len, D: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, FINAL: tl.constexpr):
    """Merge this rank's partials (``part_len`` keys each; only those below ``kv_lens`` exist) of
    ``BLOCK_P`` (batch, head) pairs; FINAL (one rank): write the output, else push ``(o, lse)``
    to slot ``rank`` of every rank's exchange buffer.

    Max first, then the weighted sum in blocks of ``BLOCK_C`` partials (a fixed tree inside a
    block, blocks left to right), so the result depends only on the partials' values and positions.
    A length outside the cache reads only the partials split-KV wrote (its clamped length's:
    into ``[0, seq_len]``, split-KV's ``seq_len``; ``num_parts`` may cover more keys, a paged
    plan's rounded-up capacity).
    """
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < pairs
    length = tl.load(lens_ptr + offs_p // heads, mask=p_ok, other=0).to(tl.int64)
    length = tl.minimum(tl.maximum(length, 0), seq_len).to(tl.int32)
    valid = tl.minimum((length + part_len - 1) // part_len, num_parts)
    base = offs_p.to(tl.int64) * num_parts
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, D)
    top = tl.full((BLOCK_P,), NEG_INF, tl.float32)
    for c0 in range(0, num_parts, BLOCK_C):
        ok = p_ok[:, None] & (c0 + offs_c[None, :] < valid[:, None])
        lse = tl.load(lse_part + base[:, None] + c0 + offs_c[None, :], mask=ok, other=NEG_INF)
        top = tl.maximum(top, tl.max(lse, axis=1))
    acc = tl.zeros((BLOCK_P, D), tl.float32)
    total = tl.zeros((BLOCK_P,), tl.float32)
    for c0 in range(0, num_parts, BLOCK_C):
        ok = p_ok[:, None] & (c0 + offs_c[None, :] < valid[:, None])
        rows = base[:, None] + c0 + offs_c[None, :]
        w = _weights(tl.load(lse_part + rows, mask=ok, other=NEG_INF), top[:, None])
        o = tl.load(o_part + rows[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
        acc += tl.sum(o * w[:, :, None], axis=1)
        total += tl.sum(w, axis=1)
    o, lse = _finish(acc, total, top)
    if FINAL:
        tl.store(out_ptr + offs_p.to(tl.int64)[:, None] * D + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=p_ok[:, None])
    else:
        row = D + 1  # o, then lse
        at = rank * pairs.to(tl.int64) * row + offs_p.to(tl.int64) * row
        for i in range(world_size):
            dst = dl.remote_ptr(buf_table, (rank + i) % world_size, buf_ptr) + at
            tl.store(dst[:, None] + offs_d[None, :], o, mask=p_ok[:, None])
            tl.store(dst + D, lse, mask=p_ok)


@dl.jit(do_not_specialize=("pairs", "rank", "world_size", "timeout_us", "op_id"))
def decode_merge_kernel(out_ptr, buf_ptr, sig_ptr, sig_table, err_claim, err_record, pairs, rank,
                        world_size, timeout_us, op_id, D: tl.constexpr, BLOCK_P: tl.constexpr):
    """Signal every rank that this rank's partials landed, wait for all ranks', merge them in
    rank order (max first, then the weighted sum over ranks 0..W-1, fp32)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(sig_ptr + 3 * world_size, volatile=True).to(tl.int64)
    if pid == 0:
        for i in range(world_size):
            dl.signal_add(dl.remote_ptr(sig_table, (rank + i) % world_size, sig_ptr) + rank, 1)
    deadline = dl.deadline_after(timeout_us.to(tl.int64) * 1000)
    ok = pid >= 0
    for s in range(world_size):
        ok = ok & dl.wait_at_least(sig_ptr + s, epoch, deadline, err_claim, err_record, op_id,
                                   rank, s, epoch)
    if ok:
        offs_d = tl.arange(0, D)
        row = D + 1
        slot = pairs.to(tl.int64) * row
        for p0 in range(pid * BLOCK_P, pairs, nprog * BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            p_ok = offs_p < pairs
            at = buf_ptr + offs_p.to(tl.int64) * row
            top = tl.full((BLOCK_P,), NEG_INF, tl.float32)
            for s in range(world_size):
                top = tl.maximum(top, tl.load(at + s * slot + D, mask=p_ok, other=NEG_INF, volatile=True))
            acc = tl.zeros((BLOCK_P, D), tl.float32)
            total = tl.zeros((BLOCK_P,), tl.float32)
            for s in range(world_size):  # rank order
                w = _weights(tl.load(at + s * slot + D, mask=p_ok, other=NEG_INF, volatile=True), top)
                o = tl.load((at + s * slot)[:, None] + offs_d[None, :], mask=p_ok[:, None], other=0.0,
                            volatile=True)
                acc += o * w[:, None]
                total += w
            o, _ = _finish(acc, total, top)
            tl.store(out_ptr + offs_p.to(tl.int64)[:, None] * D + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=p_ok[:, None])
