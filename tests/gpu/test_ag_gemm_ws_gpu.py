"""GPU tier (sm_90): the warp-specialized core as ag_gemm's waiting consumer (``WAIT``).

The kernel's waits alone (one process, a hand-set signal pad: arrival, a chunk that never
lands, a chunk of the wrong size), then ag_gemm with ``CONSUMER_CORE = "ws"`` on virtual worlds,
both SM-free producers, exact on integer-valued operands, graph replay."""
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.gemm import _ag_launch, _ws_launch
from ditron_ops.runtime import error_record as er
from ditron_ops import reference

from gemm_helpers import ints as _ints  # (tests/gpu/)
from gemm_helpers import skip_unless_ws as _sm90

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()


def _pad(chunks, epoch=5, flags=None, sizes=None):
    """Signal pad of a call at ``epoch``: arrival flags, chunk sizes at ``2W``, epoch at
    ``3W``; offsets of the chunks' first rows."""
    w = len(chunks)
    sig = torch.zeros(6 * w + 8, dtype=torch.int64, device="cuda")
    sig[:w] = torch.tensor(flags if flags is not None else [epoch] * w)
    sig[2 * w:3 * w] = torch.tensor(sizes if sizes is not None else chunks)
    sig[3 * w] = epoch
    offsets = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32,
                           device="cuda")
    return sig, offsets


def _run_waiting(chunks, n, k, sig, offsets, timeout_us=200_000, op=7, rank=1):
    m = sum(chunks)
    a, b = _ints(m, k, seed=1), _ints(n, k, seed=2).t()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    claim = torch.zeros(1, dtype=torch.int64, device="cuda")
    record = torch.zeros(er.ERR_WORDS, dtype=torch.int64, device="cuda")
    core = _ws_launch.WsGemm(a, b, out, None, 16,
                             (sig, offsets, claim, record, rank, len(chunks), timeout_us, op))
    assert core.plan.mode == _ws_launch.MODE_DP and core.plan.grid <= 16
    core.run(a, b, out, None)
    torch.cuda.synchronize()
    return out, (a.double() @ b.double()).to(torch.bfloat16), claim.item(), record.tolist()


def test_ws_waiting_consumer_exact_when_chunks_landed():
    _sm90()
    chunks = [300, 1, 0, 211, 512]  # an empty chunk, one of a single row, ragged rows
    sig, offsets = _pad(chunks)
    for rank in range(len(chunks)):  # own rows first: every rotation of the tile rows
        out, want, claim, record = _run_waiting(chunks, 704, 512, sig, offsets, rank=rank)
        assert torch.equal(out, want), f"rank {rank}"
        assert claim == 0 and record[er.ERR_STATUS] == 0


def test_ws_waiting_consumer_records_a_timeout():
    _sm90()
    chunks = [256, 256, 256]
    sig, offsets = _pad(chunks, epoch=9, flags=[9, 8, 9])  # chunk 1 never lands
    _, _, claim, record = _run_waiting(chunks, 256, 256, sig, offsets, timeout_us=2000, op=7)
    assert claim == er.KIND_TIMEOUT
    assert record[er.ERR_STATUS] == 1 and record[er.ERR_KIND] == er.KIND_TIMEOUT
    assert (record[er.ERR_OP], record[er.ERR_RANK], record[er.ERR_PEER],
            record[er.ERR_EPOCH]) == (7, 1, 1, 9)


def test_ws_waiting_consumer_records_a_size_mismatch():
    _sm90()
    chunks = [256, 384]
    sig, offsets = _pad(chunks, sizes=[256, 383])
    _, _, claim, record = _run_waiting(chunks, 256, 256, sig, offsets)
    assert claim == er.KIND_SIZE_MISMATCH and record[er.ERR_PEER] == 1


def _check_exact(group, sizes, n, k, dtype, seed, weight_layout=True, bias=True):
    a = _ints(sizes[group.rank], k, seed=100 * seed + group.rank, dtype=dtype)
    b = _ints(n, k, seed=seed, dtype=dtype).t() if weight_layout else _ints(k, n, seed=seed,
                                                                              dtype=dtype)
    bvec = _ints(n, seed=seed + 1, dtype=dtype) if bias else None
    got = ditron_ops.ag_gemm(a, b, group, bias=bvec, impl="fused", shard_sizes=list(sizes))
    if sum(sizes) > _ws_launch.SKINNY_M:  # (smaller products: the portable core's tiles)
        plan = next(reversed(group.plans._plans.values()))
        assert isinstance(plan, _ag_launch.AgGemmPlan) and plan.ws_core is not None, \
            "the WS consumer was not chosen"
    full = reference.all_gather(a, group, list(sizes))
    want = full.double() @ b.double() + (bvec.double() if bias else 0)
    group.synchronize()
    assert torch.equal(got, want.to(dtype)), f"rank {group.rank}: {sizes} x {n} x {k}"


@pytest.mark.parametrize("producer", ["copy", "pull"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ag_gemm_ws_consumer_exact(monkeypatch, world_size, producer):
    _sm90()
    monkeypatch.setattr(_ag_launch, "CONSUMER_CORE", "ws")
    monkeypatch.setattr(_ag_launch, "PRODUCER", producer)

    def body(group):
        w = group.world_size
        _check_exact(group, [1024 // w] * w, 1536, 1024, torch.bfloat16, 0)
        _check_exact(group, [300 + 37 * q for q in range(w)], 1000, 512, torch.float16, 1,
                     weight_layout=False)
        for i in range(3):  # back to back, new sizes each call (empty shards included)
            _check_exact(group, [(i * 97 + q * 131) % 700 for q in range(w)], 640 + 64 * i,
                         256 + 128 * i, torch.bfloat16, 2 + i, bias=i % 2 == 0)
        return _graph_replay(group)
    assert ditron_ops.launch(body, world_size) == [True] * world_size


def _graph_replay(group):
    w = group.world_size
    sizes = [256 + 64 * q for q in range(w)]
    a = _ints(sizes[group.rank], 512, seed=group.rank)
    b = _ints(768, 512, seed=50).t()
    static = a.clone()
    ditron_ops.ag_gemm(static, b, group, impl="fused", shard_sizes=sizes)  # warm-up: the plan
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(),
                              capture_error_mode="thread_local"):
            out = ditron_ops.ag_gemm(static, b, group, impl="fused", shard_sizes=sizes)
    group.barrier()
    for i in range(2):
        static.copy_(_ints(sizes[group.rank], 512, seed=10 * (i + 1) + group.rank))
        graph.replay()
        group.synchronize()
        full = reference.all_gather(static, group, sizes)
        assert torch.equal(out, (full.double() @ b.double()).to(out.dtype)), f"replay {i}"
    return True
