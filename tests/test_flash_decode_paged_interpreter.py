"""Paged flash_decode on the CPU virtual world (interpreter): against the contiguous op over the
same keys gathered (bitwise, deterministic mode) and the plain-torch reference; the block-table
checks; ``csr_to_block_table``."""
import time

import pytest
import torch

import ditron_ops
from ditron_ops import reference
from ditron_ops.attention.paged_kv import gather_pages

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _paged(group, b, hq, hkv, d, page, lens, dtype=torch.float32, seed=0, spare=3, junk=-1):
    """``(q, k_cache, v_cache, kv_lens, block_table)``: this rank's ``lens(i, rank)`` keys of
    sequence i in shuffled pages (a few spare pages; table entries past a sequence's pages hold
    ``junk``, which must never be read). A rank whose lengths are all 0 gets no pages at all."""
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    gen = torch.Generator().manual_seed(seed * 100 + group.rank)
    n = [lens(i, group.rank) for i in range(b)]
    used = [-(-x // page) for x in n]
    cols = max(max(used), 1) + 1  # at least one column past the longest sequence
    total = sum(used) + spare if sum(used) else 0
    k = torch.randn(total, page, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total, page, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.full((b, cols), junk, dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        table[i, :u] = torch.tensor(order[at:at + u], dtype=torch.int32)
        at += u
    return q, k, v, torch.tensor(n, dtype=torch.int32), table


def _against_contiguous(group, paged, deterministic=True, dtype=torch.float32):
    """The paged call equals the contiguous call over the gathered keys (bitwise when
    deterministic) and the reference; returns the output."""
    q, k, v, lens, table = paged
    out = ditron_ops.flash_decode(q, k, v, lens, group, deterministic=deterministic,
                                  block_table=table)
    kc, vc = gather_pages(k, table), gather_pages(v, table)
    if deterministic:
        assert torch.equal(out, ditron_ops.flash_decode(q, kc, vc, lens, group, deterministic=True))
    want = reference.flash_decode(q, kc, vc, lens, group)
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err
    return out


@pytest.mark.parametrize("page,dtype", [(1, torch.float32), (4, torch.float16), (16, torch.float32),
                                        (32, torch.float16)])
def test_shuffled_pages_ragged_lens_empty_rank_w3(page, dtype):
    """W = 3: ragged lengths (0 on some rows), rank 2 holds no pages; pages smaller than the
    key block (gathered per key), equal to it and larger (one table read per block)."""
    lens = lambda i, r: 0 if r == 2 else (0, 7, 45, 33)[(i + r) % 4]  # noqa: E731

    def body(group):
        _against_contiguous(group, _paged(group, 4, 4, 2, 64, page, lens, dtype), dtype=dtype)
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3


def test_one_kv_tensor_and_default_mode():
    """One ``[num_blocks, 2, page, Hkv, D]`` tensor (v_cache=None) gives the bits of the pair;
    the default mode matches the reference; one rank (split-KV writes the output directly)."""
    def body(group):
        q, k, v, lens, table = _paged(group, 3, 8, 2, 128, 8, lambda i, r: (19, 0, 40)[i] - 3 * r * (i != 1))
        pair = _against_contiguous(group, (q, k, v, lens, table))
        one = ditron_ops.flash_decode(q, torch.stack([k, v], dim=1), None, lens, group,
                                      deterministic=True, block_table=table)
        assert torch.equal(one, pair)
        _against_contiguous(group, (q, k, v, lens, table), deterministic=False)
        return True
    assert ditron_ops.launch(body, 2) == [True] * 2
    assert ditron_ops.launch(body, 1) == [True]


def test_several_chunks_match_contiguous_bits():
    """More than one deterministic chunk (512 keys) per sequence, pages of 64: the chunks
    follow key positions, not pages, so the bits equal the contiguous op's."""
    def body(group):
        _against_contiguous(group, _paged(group, 1, 2, 1, 64, 64, lambda i, r: 1100 - 77 * r,
                                          junk=10**6))
        return True
    assert ditron_ops.launch(body, 2) == [True] * 2


def test_batch_invariance_and_other_rows_tables():
    """Deterministic: a row's output depends only on its own query, table row and length
    (slices of the batch, and other rows' tables rewritten, give the same bits)."""
    def body(group):
        q, k, v, lens, table = _paged(group, 4, 4, 2, 64, 4, lambda i, r: 9 + 7 * i + r, seed=3)
        full = ditron_ops.flash_decode(q, k, v, lens, group, deterministic=True, block_table=table)
        for sel in ([0], [2], [3, 1]):
            part = ditron_ops.flash_decode(q[sel], k, v, lens[sel], group, deterministic=True,
                                           block_table=table[sel])
            assert torch.equal(part, full[sel]), sel
        q2, other, lens2 = q.clone(), table.clone(), lens.clone()  # rows 1.. move down one
        q2[1:], other[1:], lens2[1:] = q[1:].roll(1, 0), table[1:].roll(1, 0), lens[1:].roll(1)
        again = ditron_ops.flash_decode(q2, k, v, lens2, group, deterministic=True, block_table=other)
        assert torch.equal(again[0], full[0])
        assert torch.equal(again[2], full[1]) and torch.equal(again[1], full[3])
        return True
    assert ditron_ops.launch(body, 2) == [True] * 2


def test_csr_to_block_table():
    """FlashInfer's (indptr, indices, last_page_len) -> the table and lengths; -1 past each
    sequence's pages; a sequence without pages has length 0; the call equals the table's."""
    from ditron_ops import csr_to_block_table

    indptr = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    indices = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
    last = torch.tensor([2, 1, 4], dtype=torch.int32)
    table, lens = csr_to_block_table(indptr, indices, last, 4, 4)
    assert table.dtype == torch.int32 and lens.dtype == torch.int32
    assert table.tolist() == [[5, 2, 7, -1], [-1, -1, -1, -1], [0, -1, -1, -1]]
    assert lens.tolist() == [10, 0, 4]
    out = (torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    got = csr_to_block_table(indptr.long(), indices.long(), last.long(), 4, 4, out=out)
    assert got[0] is out[0] and torch.equal(out[0], table) and torch.equal(out[1], lens)
    short, short_lens = csr_to_block_table(indptr, indices, last, 2, 4)  # too short: the length
    assert short.tolist()[0] == [5, 2] and short_lens.tolist() == [10, 0, 4]  # tells (checked later)
    empty = csr_to_block_table(torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 2, 16)
    assert empty[0].tolist() == [[-1, -1]] * 2 and empty[1].tolist() == [0, 0]
    with pytest.raises(ValueError, match="B \\+ 1"):
        csr_to_block_table(indptr[:-1], indices, last, 4, 4)
    with pytest.raises(ValueError, match="power of two"):
        csr_to_block_table(indptr, indices, last, 4, 3)

    def body(group):
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(3, 4, 64, generator=gen)
        kv = torch.randn(8, 2, 4, 2, 64, generator=gen)
        a = ditron_ops.flash_decode(q, kv, None, lens, group, deterministic=True, block_table=table)
        padded = torch.where(table >= 0, table, 0)
        b = ditron_ops.flash_decode(q, kv, None, lens, group, deterministic=True, block_table=padded)
        return torch.equal(a, b)
    assert ditron_ops.launch(body, 1) == [True]


def test_csr_invalid_rows_are_marked():
    """``last_page_len`` outside ``[1, page_size]`` for a sequence with pages, a negative page
    count or pages past ``kv_indices``: length -1 (no host read), which flash_decode reports as
    ``DitronInputError`` on kv_lens; rows without pages ignore ``last_page_len``."""
    from ditron_ops import csr_to_block_table

    indptr = torch.tensor([0, 2, 2, 3, 4, 3, 5], dtype=torch.int32)  # row 4: -1 pages; row 5 past nnz
    indices = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
    last = torch.tensor([0, 0, 4, 5, 1, 1], dtype=torch.int32)  # row 0: 0 (bad), row 1: no pages
    table, lens = csr_to_block_table(indptr, indices, last, 2, 4)
    assert lens.tolist() == [-1, 0, 4, -1, -1, -1]
    assert table.tolist()[:4] == [[5, 2], [-1, -1], [7, -1], [0, -1]]
    ok = csr_to_block_table(indptr[:4], indices, torch.tensor([4, 0, 1]), 2, 4)[1]
    assert ok.tolist() == [8, 0, 1]

    def body(group):
        q, kv = torch.randn(6, 4, 64), torch.randn(8, 2, 4, 2, 64)
        with pytest.raises(ditron_ops.DitronInputError) as info:
            ditron_ops.flash_decode(q, kv, None, lens, group, block_table=table)
        assert (info.value.argument, info.value.index, info.value.value) == ("kv_lens", 0, -1)
        assert "csr_to_block_table" in str(info.value)
        return True
    assert ditron_ops.launch(body, 1) == [True]


def test_growing_table_plans_and_bits():
    """A table that grows by a page per step: plans are made for the width rounded up
    (``plan_blocks``: 9 and 10 share one, 17..20 one), and every width gives the contiguous
    call's bits (chunks follow key positions); a length past this width's capacity but inside
    the planned one is still clamped to this width's (split-KV and the combine)."""
    from ditron_ops.attention.paged_kv import plan_blocks

    assert [plan_blocks(n) for n in (0, 1, 8, 9, 10, 11, 17, 20, 21, 33)] == [
        0, 1, 8, 10, 10, 12, 20, 20, 24, 40]

    def body(group):
        gen = torch.Generator().manual_seed(5 + group.rank)
        page, cols = 4, 21
        q = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(5))
        k, v = torch.randn(2 * cols + 3, page, 1, 64, generator=gen), torch.randn(2 * cols + 3, page, 1, 64, generator=gen)
        full = torch.randperm(2 * cols + 3, generator=gen)[:2 * cols].view(2, cols).int()
        plans = []
        for width in (9, 10, 17, 20, 21):
            table = full[:, :width]
            lens = torch.tensor([width * page - 3, width * page - 6 * group.rank], dtype=torch.int32)
            _against_contiguous(group, (q, k, v, lens, table))
            plans.append(sum(1 for key in group.plans._plans  # the paged calls' plans
                             if isinstance(key[-1], tuple) and key[-1][0] == "block_table"))
        table = full[:, :9]  # planned for 10 pages: a length of 38 is past this table's 36 keys
        want = ditron_ops.flash_decode(q, k, v, torch.tensor([36, 20], dtype=torch.int32), group,
                                       softmax_scale=0.125, deterministic=True, block_table=table)
        group.check = lambda: None  # the kernel's record, not the host check
        try:
            got = torch.ops.ditron.flash_decode_paged(q, k, v, torch.tensor([38, 20], dtype=torch.int32),
                                                      table, group.group_name, 0.125, True)
        finally:
            del group.check
        assert torch.equal(got, want)
        with pytest.raises(ditron_ops.DitronInputError):
            group.synchronize()
        return plans
    for plans in ditron_ops.launch(body, 2):
        assert plans == [1, 1, 2, 2, 3], plans


def test_split_variants_bind(monkeypatch):
    """``split_variants``: deterministic mode may launch one or several partials per program,
    the default mode the wide config too when the pairs fill the GPU three times over; a plan
    build binds (on a GPU: compiles) the ones it does not launch, paged or not."""
    from ditron_ops.attention import flash_decode as api

    assert api.split_variants(torch.device("cpu"), 8, True) == (
        (api.SPLIT_CONFIG, False), (api.SPLIT_CONFIG, True))
    monkeypatch.setattr(api, "sm_count", lambda device: 4)
    cuda = torch.device("cuda")
    assert api.split_variants(cuda, 12, False) == ((api.SPLIT_CONFIG, False),
                                                   (api.WIDE_SPLIT_CONFIG, False))
    assert api.split_variants(cuda, 11, False) == ((api.SPLIT_CONFIG, False),)
    bound = []
    monkeypatch.setattr(api, "_bound_split_kv", lambda *a, **kw: bound.append((a[7], a[8], kw)))
    q, k = torch.zeros(1, 4, 64), torch.zeros(3, 16, 2, 64)
    table = torch.zeros(1, 2, dtype=torch.int32)
    api._compile_split_variants(q, k, k, torch.zeros(1, dtype=torch.int32), q, q, 0.1,
                                (512, 512, 1, 1), api.SPLIT_CONFIG, (q, q, 0), table, True, 2)
    assert [(plan[1] != plan[0], cfg, kw["table"] is table) for plan, cfg, kw in bound] == [
        (True, api.SPLIT_CONFIG, True)]


def test_one_tensor_views_made_once():
    """``split_kv`` of one ``[blocks, 2, page, Hkv, D]`` tensor: the same views call after call,
    dropped with the tensor (they hold its storage, not the tensor)."""
    import gc
    import weakref

    from ditron_ops.attention import paged_kv

    kv = torch.randn(3, 2, 4, 1, 64)
    k, v = paged_kv.split_kv(kv, None)
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
    again = paged_kv.split_kv(kv, None)
    assert again[0] is k and again[1] is v
    kv.resize_(2, 2, 4, 1, 64)  # new metadata: new views
    assert paged_kv.split_kv(kv, None)[0].shape[0] == 2
    gone = weakref.ref(kv)
    key = id(kv)
    del kv, k, v, again
    gc.collect()
    assert gone() is None and key not in paged_kv._VIEWS


def _base(**bad):
    args = dict(q=torch.zeros(2, 4, 64), k=torch.zeros(6, 16, 2, 64), v=torch.zeros(6, 16, 2, 64),
                lens=torch.zeros(2, dtype=torch.int32), table=torch.zeros(2, 3, dtype=torch.int32))
    args.update(bad)
    return args


@pytest.mark.parametrize("bad,exc,match", [
    (dict(table=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "int32"),
    (dict(table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "max_blocks"),
    (dict(table=torch.zeros(6, dtype=torch.int32)), ValueError, "dimension"),
    (dict(table=torch.zeros(3, 2, dtype=torch.int32).t()), ValueError, "stride"),
    (dict(k=torch.zeros(6, 12, 2, 64), v=torch.zeros(6, 12, 2, 64)), ValueError, "power of two"),
    (dict(k=torch.zeros(6, 512, 2, 64), v=torch.zeros(6, 512, 2, 64)), ValueError, "power of two"),
    (dict(v=torch.zeros(6, 8, 2, 64)), ValueError, "equal"),
    (dict(v=None), ValueError, "v_cache=None"),
    (dict(q=torch.zeros(2, 3, 64)), ValueError, "multiple of Hkv"),
])
def test_validation(bad, exc, match):
    def body(group):
        a = _base(**bad)
        with pytest.raises(exc, match=match):
            ditron_ops.flash_decode(a["q"], a["k"], a["v"], a["lens"], group, block_table=a["table"])
        assert group._workspaces == {}
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("lens,table_fix,arg,index,value", [
    ([3, 20], {(1, 1): -1}, "block_table.flatten()", 4, -1),        # -1 inside kv_lens
    ([33, 1], {(0, 2): 6}, "block_table.flatten()", 2, 6),          # past num_blocks
    ([49, 0], {}, "kv_lens", 0, 49),                                # longer than the table
    ([-2, 0], {}, "kv_lens", 0, -2),
])
@pytest.mark.parametrize("through_op,world_size", [(False, 1), (True, 1), (True, 2)])
def test_bad_tables_raise(lens, table_fix, arg, index, value, through_op, world_size):
    """Host tensors: checked before the launch. Through the op (no host check, as on a GPU):
    the kernel reads clamped (a bad entry reads page 0, a length past the table stops at
    its end) and records it; ``DitronInputError`` at the next host check. Entries past a
    sequence's pages (row 1's -1) are never checked. W = 2: only rank 0's values are bad, and
    the host check before the waiting kernels is skipped (as on a GPU, where the record lands
    after it, or under CUDA-graph replay): the recorded bad input must not shorten rank 0's
    waits, so three calls in a row give both ranks the clamped result, and only rank 0
    raises."""
    def body(group):
        gen = torch.Generator().manual_seed(2)
        a = _base(q=torch.randn(2, 4, 64, generator=gen), k=torch.randn(6, 16, 2, 64, generator=gen),
                  v=torch.randn(6, 16, 2, 64, generator=gen))
        table = torch.tensor([[1, 3, 5], [4, 0, -1]], dtype=torch.int32)
        bad = group.rank == 0
        kv_lens = torch.tensor(lens if bad else [3, 20], dtype=torch.int32)
        for (i, j), x in table_fix.items() if bad else ():
            table[i, j] = x
        if through_op:
            safe = torch.where((table >= 0) & (table < 6), table, 0)
            clamped = kv_lens.clamp(0, 48)
            want = ditron_ops.flash_decode(a["q"], a["k"], a["v"], clamped, group, softmax_scale=0.125,
                                           deterministic=True, block_table=safe)
            group.check = lambda: None  # no host check until synchronize (see the docstring)
            try:
                got = [torch.ops.ditron.flash_decode_paged(a["q"], a["k"], a["v"], kv_lens, table,
                                                           group.group_name, 0.125, True)
                       for _ in range(3)]
            finally:
                del group.check
            for o in got:
                assert torch.equal(o, want)
            if not bad:
                group.synchronize()
                return True
            with pytest.raises(ditron_ops.DitronError) as info:
                group.synchronize()
        else:
            with pytest.raises(ditron_ops.DitronError) as info:
                ditron_ops.flash_decode(a["q"], a["k"], a["v"], kv_lens, group, block_table=table)
        err = info.value
        assert isinstance(err, ditron_ops.DitronInputError), err
        assert (err.argument, err.index, err.value) == (arg, index, value), err
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("deterministic", [True, False])
def test_bad_entry_in_a_later_block_of_small_pages_is_recorded(deterministic):
    """Pages smaller than the key block (per-key entries, loaded one block ahead): a bad entry
    in the second block reads page 0, is recorded with its column and value, and the result is
    the call over the clamped table."""
    def body(group):
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(1, 4, 64, generator=gen)
        k, v = (torch.randn(8, 4, 2, 64, generator=gen) for _ in range(2))
        table = torch.tensor([[1, 3, 5, 7, 0, 99, 2, 4]], dtype=torch.int32)  # column 5 bad
        kv_lens = torch.tensor([30], dtype=torch.int32)  # 8 columns, the last one half full
        safe = torch.where(table < 8, table, 0)
        want = ditron_ops.flash_decode(q, k, v, kv_lens, group, softmax_scale=0.125,
                                       deterministic=deterministic, block_table=safe)
        group.check = lambda: None  # no host check until synchronize (as on a GPU)
        try:
            got = torch.ops.ditron.flash_decode_paged(q, k, v, kv_lens, table, group.group_name,
                                                      0.125, deterministic)
        finally:
            del group.check
        assert torch.equal(got, want)
        with pytest.raises(ditron_ops.DitronInputError) as info:
            group.synchronize()
        assert (info.value.argument, info.value.index, info.value.value) == (
            "block_table.flatten()", 5, 99)
        return True
    assert ditron_ops.launch(body, 1) == [True]


def test_a_bad_input_on_one_rank_is_raised_after_the_call_waits():
    """Rank 0's length is past its table (a device tensor: no host check): its split kernel
    records it, and the call's own host check comes before that launch, so rank 0 still
    meets rank 1 in the waits; rank 1 gets its result and rank 0 the ``DitronInputError`` at
    ``synchronize``. Checked after the split launch, the record made rank 0 leave before the
    waits and rank 1 time out (H200, W = 2)."""
    def body(group):
        gen = torch.Generator().manual_seed(2)
        a = _base(q=torch.randn(2, 4, 64, generator=gen), k=torch.randn(6, 16, 2, 64, generator=gen),
                  v=torch.randn(6, 16, 2, 64, generator=gen))
        table = torch.tensor([[1, 3, 5], [4, 0, -1]], dtype=torch.int32)
        kv_lens = torch.tensor([49 if group.rank == 0 else 3, 20], dtype=torch.int32)
        torch.ops.ditron.flash_decode_paged(a["q"], a["k"], a["v"], kv_lens, table, group.group_name,
                                            0.125, True)
        if group.rank == 1:
            group.synchronize()
            return True
        with pytest.raises(ditron_ops.DitronInputError) as info:
            group.synchronize()
        assert (info.value.argument, info.value.value) == ("kv_lens", 49)
        return True
    assert ditron_ops.launch(body, 2, timeout_s=3.0) == [True, True]


def test_timeout_after_a_bad_input_stops_the_later_waits():
    """A bad input recorded first, then a timeout: the record keeps the first error (the input)
    while the claim word rises to the timeout, so the merge's wait after the expired start
    barrier returns at once (one bound in all, not two)."""
    def body(group):
        q, k, v, lens, table = _paged(group, 1, 2, 1, 64, 16, lambda i, r: 20)
        bad = lens + 100 * (group.rank == 0)  # rank 0: past its table
        group.check = lambda: None  # no host check until the end (a GPU's or a graph's view)
        try:
            torch.ops.ditron.flash_decode_paged(q, k, v, bad, table, group.group_name, 0.125, True)
            group.timeout_s = 1.5
            if group.rank == 1:
                return "skipped"
            t0 = time.monotonic()
            torch.ops.ditron.flash_decode_paged(q, k, v, bad, table, group.group_name, 0.125, True)
            waited = time.monotonic() - t0
        finally:
            del group.check
        with pytest.raises(ditron_ops.DitronInputError) as info:
            group.synchronize()
        assert info.value.argument == "kv_lens" and info.value.value == 120
        return waited
    waited, skipped = ditron_ops.launch(body, 2, timeout_s=10.0)
    assert skipped == "skipped" and 1.4 < waited < 2.9, waited


def test_opcheck_and_compile():
    def body(group):
        q, k, v, lens, table = _paged(group, 2, 4, 2, 64, 4, lambda i, r: 10 + i)
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.ditron.flash_decode_paged.default,
                              (q, k, v, lens, table, group.group_name, 0.125, True), test_utils=utils)
        step = lambda x: ditron_ops.flash_decode(x * 1.0, k, v, lens, group, deterministic=True,  # noqa: E731
                                                 block_table=table)
        torch._dynamo.reset()
        return torch.equal(torch.compile(step, fullgraph=True)(q), step(q))
    assert ditron_ops.launch(body, 1) == [True]


def test_serving_bench_rows_quick(tmp_path):
    """``bench.serving_decode.paged_rows`` in its quick form on the CPU: one row per mode with
    the contiguous baseline and SDPA's time; ``paged_cache`` keeps every key."""
    from ditron_ops.bench.harness import BenchConfig
    from ditron_ops.bench.serving_decode import paged_rows
    from ditron_ops.testing.checks import paged_cache

    k, v = torch.randn(2, 37, 2, 64), torch.randn(2, 37, 2, 64)
    kp, vp, table = paged_cache(k, v, 16)
    assert table.shape == (2, 3) and torch.equal(gather_pages(kp, table)[:, :37], k)
    assert torch.equal(gather_pages(vp, table)[:, :37], v)
    cfg = BenchConfig(world_sizes=(2,), dtype=torch.float32, dtype_name="fp32", quick=True,
                      device=torch.device("cpu"), out_dir=tmp_path, rounds=1, target_ms=1.0)
    rows = paged_rows(cfg)
    assert [(r.bench, r.world_size, r.impl) for r in rows] == [
        ("serving", 2, "flash_decode paged det=False"), ("serving", 2, "flash_decode paged det=True")]
    assert all(r.time_us > 0 and r.baseline_us > 0 and r.extra["sdpa_us"] > 0 for r in rows)
