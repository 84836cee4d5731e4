"""GPU tier (H200): paged flash_decode on a virtual world vs the contiguous op over the same keys
(bitwise in deterministic mode) and the plain-torch reference; graph replay over a changing
table; bad tables raised from the kernel's record; ``csr_to_block_table`` inside a graph."""
import threading

import pytest
import torch

import ditron_ops
from ditron_ops import reference
from ditron_ops.attention.paged_kv import gather_pages

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()


def _lens(group, b, s_max, empty_rank):
    """Ragged lengths with zeros; ``empty_rank`` holds no keys at all."""
    if group.rank == empty_rank:
        return [0] * b
    return [0 if (i + group.rank) % 5 == 0 else s_max - 97 * ((i + group.rank) % 4) for i in range(b)]


def _paged(group, b, hq, hkv, d, page, lens, dtype, seed=0, spare=5):
    """``(q, k_cache, v_cache, kv_lens, block_table)`` on the device: this rank's keys in shuffled
    pages, -1 past each sequence's pages; no pages at all when every length is 0."""
    dev = group.device
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(seed * 100 + group.rank)
    used = [-(-n // page) for n in lens]
    cols = max(max(used), 1) + 1
    total = sum(used) + spare if sum(used) else 0
    k = torch.randn(total, page, hkv, d, generator=gen).to(dtype=dtype, device=dev)
    v = torch.randn(total, page, hkv, d, generator=gen).to(dtype=dtype, device=dev)
    order = torch.randperm(total, generator=gen)
    table = torch.full((b, cols), -1, dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        table[i, :u] = order[at:at + u].int()
        at += u
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=dev), table.to(dev)


def _check(group, b, hq, hkv, d, page, s_max, dtype, deterministic, seed=0):
    lens = _lens(group, b, s_max, empty_rank=1 if group.world_size > 1 else -1)
    q, k, v, kv_lens, table = _paged(group, b, hq, hkv, d, page, lens, dtype, seed)
    out = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=deterministic,
                                  block_table=table)
    kc, vc = gather_pages(k, table), gather_pages(v, table)
    if deterministic:  # chunks follow key positions: the contiguous op's bits
        contiguous = ditron_ops.flash_decode(q, kc, vc, kv_lens, group, deterministic=True)
        assert torch.equal(out, contiguous)
    want = reference.flash_decode(q, kc, vc, kv_lens, group)
    err = (out.float() - want.float()).abs().max().item()
    assert err < 2e-2, err
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("page", [1, 16, 64, 256])
@pytest.mark.parametrize("deterministic", [True, False])
def test_matches_contiguous_and_reference(world_size, page, deterministic):
    """bf16, 32/8 heads, D = 128, up to 2000 keys per rank, rank 1 without pages."""
    assert ditron_ops.launch(_check, world_size, args=(5, 32, 8, 128, page, 2000, torch.bfloat16,
                                                       deterministic)) == [True] * world_size


@pytest.mark.parametrize("world_size,b,page,s_max", [(1, 64, 16, 1000), (2, 64, 16, 1000),
                                                     (1, 3, 64, 300), (4, 16, 8, 5000)])
def test_wide_direct_and_small_pages(world_size, b, page, s_max):
    """The WIDE config (default mode, many pairs, short sequences), one rank with one chunk per
    pair (split-KV writes the output), pages smaller than the key block; fp16, 64/8 heads, D = 64."""
    for det in (False, True):
        assert ditron_ops.launch(_check, world_size, args=(b, 64, 8, 64, page, s_max, torch.float16,
                                                           det, 3)) == [True] * world_size


def test_one_kv_tensor_equals_pair():
    def body(group):
        lens = _lens(group, 4, 3000, -1)
        q, k, v, kv_lens, table = _paged(group, 4, 32, 8, 128, 16, lens, torch.bfloat16, seed=4)
        pair = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
        one = ditron_ops.flash_decode(q, torch.stack([k, v], dim=1), None, kv_lens, group,
                                      deterministic=True, block_table=table)
        return torch.equal(one, pair)
    assert ditron_ops.launch(body, 2) == [True] * 2


def _invariance(group):
    lens = _lens(group, 8, 4096, -1)
    q, k, v, kv_lens, table = _paged(group, 8, 32, 8, 128, 16, lens, torch.bfloat16, seed=1)
    full = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
    for _ in range(10):
        assert torch.equal(ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True,
                                                   block_table=table), full)
    for sel in ([0], [5], [1, 6, 7], list(range(7, -1, -1))):
        part = ditron_ops.flash_decode(q[sel], k, v, kv_lens[sel], group, deterministic=True,
                                       block_table=table[sel])
        assert torch.equal(part, full[sel]), sel
    return True


def test_batch_invariance_and_run_to_run():
    assert ditron_ops.launch(_invariance, 4) == [True] * 4


def _graph(group, page):
    """Capture once; then move every sequence's keys to other pages (rewriting the table), change
    the lengths, and replay: the replay equals an eager call (the table is read on the device)."""
    lens = [1500, 700, 0, 1024] if group.rank != 1 else [3, 0, 900, 64]
    q, k, v, kv_lens, table = _paged(group, 4, 32, 8, 128, page, lens, torch.bfloat16, seed=2,
                                     spare=4096 // page)
    ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            out = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
    group.barrier()
    gen = torch.Generator().manual_seed(50 + group.rank)
    for i in range(3):
        new = torch.randperm(k.shape[0], generator=gen).to(group.device)[:table.numel()]
        new = new.view(table.shape).int()
        new_lens = kv_lens.clone()
        if i == 1:
            new_lens = (new_lens + 37 * (group.rank + 1)).clamp(max=table.shape[1] * page)
        kc, vc = gather_pages(k, table), gather_pages(v, table)  # the keys as they are now
        k2, v2 = k.clone(), v.clone()
        k2[new.long().flatten()] = kc.reshape(-1, page, *k.shape[2:])
        v2[new.long().flatten()] = vc.reshape(-1, page, *v.shape[2:])
        k.copy_(k2)
        v.copy_(v2)
        table.copy_(new)
        kv_lens.copy_(new_lens)
        graph.replay()
        group.synchronize()
        want = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
        group.synchronize()
        assert torch.equal(out, want), i
        ref = reference.flash_decode(q, gather_pages(k, table), gather_pages(v, table), kv_lens, group)
        assert (out.float() - ref.float()).abs().max().item() < 2e-2
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("page", [16, 256])
def test_cuda_graph_replay_after_table_changes(world_size, page):
    assert ditron_ops.launch(_graph, world_size, args=(page,)) == [True] * world_size


def _csr_graph(group):
    """``csr_to_block_table`` + the paged call captured together from static CSR tensors."""
    page, b, max_blocks = 16, 3, 8
    dev = group.device
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, 8, 128, generator=gen).to(torch.float16).to(dev)
    kv = torch.randn(40, 2, page, 2, 128, generator=gen).to(torch.float16).to(dev)
    indptr = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=dev)
    indices = torch.tensor([4, 9, 1, 30, 2, 3, 17, 8], dtype=torch.int32, device=dev)
    last = torch.tensor([5, 1, 16], dtype=torch.int32, device=dev)

    def step():
        table, lens = ditron_ops.csr_to_block_table(indptr, indices, last, max_blocks, page)
        return ditron_ops.flash_decode(q, kv, None, lens, group, deterministic=True, block_table=table)
    step()
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            out = step()
    group.barrier()
    indices.copy_(torch.tensor([11, 12, 13, 5, 6, 7, 0, 39], dtype=torch.int32, device=dev))
    last.copy_(torch.tensor([16, 1, 3], dtype=torch.int32, device=dev))
    graph.replay()
    group.synchronize()
    want = step()
    group.synchronize()
    assert torch.equal(out, want)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_csr_conversion_in_a_graph(world_size):
    assert ditron_ops.launch(_csr_graph, world_size) == [True] * world_size


def _bad_table(group, fix, arg, index, value):
    """Device tensors: no host check; the kernel reads clamped and records the first bad value,
    raised at the next host check."""
    dev = group.device
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 32, 128, generator=gen).to(torch.bfloat16).to(dev)
    k = torch.randn(6, 16, 8, 128, generator=gen).to(torch.bfloat16).to(dev)
    table = torch.tensor([[1, 3, 5], [4, 0, -1]], dtype=torch.int32)
    lens = torch.tensor([40, 20], dtype=torch.int32)
    for (i, j), x in fix.items():
        (table if i >= 0 else lens)[(i, j) if i >= 0 else j] = x
    with pytest.raises(ditron_ops.DitronError) as info:
        ditron_ops.flash_decode(q, k, k, lens.to(dev), group, block_table=table.to(dev))
        group.synchronize()
    err = info.value
    assert isinstance(err, ditron_ops.DitronInputError), err
    assert (err.argument, err.index, err.value) == (arg, index, value), err
    return True


@pytest.mark.parametrize("fix,arg,index,value", [
    ({(1, 1): -1}, "block_table.flatten()", 4, -1),
    ({(0, 2): 99}, "block_table.flatten()", 2, 99),
    ({(-1, 0): 49}, "kv_lens", 0, 49),
])
@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_table_raises_from_the_kernel(fix, arg, index, value, world_size):
    assert ditron_ops.launch(_bad_table, world_size,
                             args=(fix, arg, index, value)) == [True] * world_size


def _bad_input_in_replays(group):
    """A graph captured with good lengths, replayed after rank 0's length went past its table:
    rank 0's kernel records the bad input, and its waits still wait (the record does not stop
    them), so five replays in a row give both ranks the clamped result; only rank 0 raises."""
    lens = [1500, 700] if group.rank == 0 else [300, 64]
    q, k, v, kv_lens, table = _paged(group, 2, 32, 8, 128, 16, lens, torch.bfloat16, seed=9)
    table = table.clamp(min=0)  # every entry a page: only the length is out of range
    cap = table.shape[1] * 16
    bad = torch.tensor([cap + 500, 700] if group.rank == 0 else lens, dtype=torch.int32,
                       device=group.device)
    want = ditron_ops.flash_decode(q, k, v, bad.clamp(max=cap), group, deterministic=True,
                                   block_table=table)
    ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            out = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True, block_table=table)
    group.barrier()
    kv_lens.copy_(bad)
    torch.cuda.current_stream().synchronize()
    for i in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.current_stream().synchronize()  # not group.synchronize: no host check
        assert torch.equal(out, want), i
        group.barrier()
    if group.rank != 0:
        group.synchronize()
        return True
    with pytest.raises(ditron_ops.DitronInputError) as info:
        group.synchronize()
    assert (info.value.argument, info.value.index, info.value.value) == ("kv_lens", 0, cap + 500)
    return True


def test_bad_input_keeps_replays_synchronized():
    assert ditron_ops.launch(_bad_input_in_replays, 2) == [True] * 2


def _no_compile_at_a_new_capacity(group, deterministic, b, first, second):
    """The first call of a signature compiles every split-KV variant a later plan can pick
    (``split_variants``): a table long enough to flip the config (default mode: the wide one
    up to 4096 keys) or the chunks per program (deterministic) compiles nothing."""
    from ditron_ops.runtime import compiler

    out = []
    for i, keys in enumerate((first, second)):
        q, k, v, kv_lens, table = _paged(group, b, 32, 8, 64, 16, [keys] * b, torch.bfloat16,
                                         seed=11)
        group.barrier()
        before = compiler.compiled
        out.append(ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=deterministic,
                                           block_table=table))
        group.synchronize()
        group.barrier()
        if i == 1:
            assert compiler.compiled == before, (before, compiler.compiled)
    return True


@pytest.mark.parametrize("deterministic,b,first,second", [(True, 1, 1000, 16000),
                                                          (False, 64, 2000, 4500)])
def test_later_plans_compile_nothing(deterministic, b, first, second):
    assert ditron_ops.launch(_no_compile_at_a_new_capacity, 2,
                             args=(deterministic, b, first, second)) == [True] * 2


def _csr_invalid_row(group):
    dev = group.device
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=dev)
    indices = torch.tensor([4, 1, 0], dtype=torch.int32, device=dev)
    last = torch.tensor([16, 0], dtype=torch.int32, device=dev)  # row 1: 0 is invalid
    table, lens = ditron_ops.csr_to_block_table(indptr, indices, last, 4, 16)
    q = torch.randn(2, 8, 128, device=dev).to(torch.float16)
    kv = torch.randn(8, 2, 16, 2, 128, device=dev).to(torch.float16)
    with pytest.raises(ditron_ops.DitronInputError) as info:
        ditron_ops.flash_decode(q, kv, None, lens, group, block_table=table)
        group.synchronize()
    assert (info.value.argument, info.value.index, info.value.value) == ("kv_lens", 1, -1)
    return True


def test_csr_invalid_last_page_len_raises():
    assert ditron_ops.launch(_csr_invalid_row, 1) == [True]
