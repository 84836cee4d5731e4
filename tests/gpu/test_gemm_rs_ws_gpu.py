"""GPU tier (sm_90): the warp-specialized core as gemm_rs / gemm_ar's producer (``PUSH``).

``_rs_launch.PRODUCER_CORE = "ws"`` on virtual worlds W in {1, 2, 3, 4, 8}: the WS GEMM pushes
fp32 tiles into the owners' slots (reduce-scatter, gemm_ar two-shot) or every rank's (gemm_ar
one-shot), the finish kernel sums them in rank order. Integer-valued operands make every
partial and sum exact, so each result must equal the float64 reduction rounded once; uneven
and empty shards, back-to-back calls of new shapes, graph replay."""
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.gemm import _rs_launch, _ws_launch

from gemm_helpers import ints as _ints  # (tests/gpu/)
from gemm_helpers import skip_unless_ws as _sm90

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()


def _operands(group, m, n, k, dtype, seed, weight_layout, ks=None):
    """This rank's ``a [M, K_r]``, ``b [K_r, N]`` (K slices ``ks``, default 64 columns apart
    per rank) and the float64 sum over all ranks' products."""
    w = group.world_size
    ks = ks or [k + 64 * q for q in range(w)]
    a_all = [_ints(m, ks[q], seed=100 * seed + q, dtype=dtype) for q in range(w)]
    b_all = [_ints(n, ks[q], seed=200 * seed + q, dtype=dtype).t() if weight_layout
             else _ints(ks[q], n, seed=200 * seed + q, dtype=dtype) for q in range(w)]
    total = sum(x.double() @ y.double() for x, y in zip(a_all, b_all))
    return a_all[group.rank], b_all[group.rank], total


def _last_plan(group):
    return next(reversed(group.plans._plans.values()))


def _check_rs(group, sizes, n, k, dtype, seed, weight_layout=True, ks=None, ws=True):
    """gemm_rs exact; ``ws``: the WS producer ran on this rank (else the portable kernel)."""
    m = sum(sizes)
    a, b, total = _operands(group, m, n, k, dtype, seed, weight_layout, ks)
    got = ditron_ops.gemm_rs(a, b, group, impl="fused", shard_sizes=list(sizes),
                             deterministic=False)
    if m > 0:  # (no rows anywhere: the op returns before any plan)
        plan = _last_plan(group)
        assert isinstance(plan, _rs_launch.RsPlan)
        assert (plan.ws_gemm is not None) == (ws and m > _ws_launch.SKINNY_M), \
            f"rank {group.rank}: WS producer chosen: {plan.ws_gemm is not None}"
    lo = sum(sizes[:group.rank])
    group.synchronize()
    want = total[lo:lo + sizes[group.rank]].to(dtype)
    assert torch.equal(got, want), f"rank {group.rank}: {sizes} x {n} x {k}"


def _check_ar(group, m, n, k, dtype, seed, algorithm):
    a, b, total = _operands(group, m, n, k, dtype, seed, True)
    got = ditron_ops.gemm_ar(a, b, group, impl="fused", algorithm=algorithm,
                             deterministic=False)
    group.synchronize()
    assert torch.equal(got, total.to(dtype)), f"rank {group.rank}: {algorithm} {m}x{n}x{k}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_gemm_rs_and_ar_on_the_ws_producer_are_exact(monkeypatch, world_size):
    _sm90()
    monkeypatch.setattr(_rs_launch, "PRODUCER_CORE", "ws")

    def body(group):
        w = group.world_size
        _check_rs(group, [1024 // w] * w, 1536, 512, torch.bfloat16, 0)
        _check_rs(group, [300 + 37 * q for q in range(w)], 1008, 256, torch.float16, 1,
                  weight_layout=False)
        _check_rs(group, [200] * w, 1000, 256, torch.bfloat16, 9, ws=False)  # (N % 16: portable)
        # rank 1's K slice off 32-byte sectors: it runs the portable kernel beside WS peers
        ks = [256 + 64 * q + (8 if q == 1 else 0) for q in range(w)]
        _check_rs(group, [160 + 16 * q for q in range(w)], 768, 0, torch.bfloat16, 10, ks=ks,
                  ws=group.rank != 1)
        for i in range(3):  # back to back, new sizes each call (empty shards included)
            _check_rs(group, [(i * 97 + q * 131) % 700 for q in range(w)], 640 + 64 * i,
                      256 + 128 * i, torch.bfloat16, 2 + i)
        _check_ar(group, 777, 1280, 384, torch.bfloat16, 7, "one_shot")
        _check_ar(group, 1000, 768, 256, torch.bfloat16, 8, "two_shot")
        return _graph_replay(group)
    assert ditron_ops.launch(body, world_size) == [True] * world_size


def _graph_replay(group):
    w = group.world_size
    sizes = [256 + 64 * q for q in range(w)]
    m, n, k = sum(sizes), 768, 512
    static = _ints(m, k, seed=group.rank)
    b = _ints(n, k, seed=50 + group.rank).t()
    ditron_ops.gemm_rs(static, b, group, impl="fused", shard_sizes=sizes, deterministic=False)
    assert _last_plan(group).ws_gemm is not None
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(),
                              capture_error_mode="thread_local"):
            out = ditron_ops.gemm_rs(static, b, group, impl="fused", shard_sizes=sizes,
                                     deterministic=False)
    group.barrier()
    lo = sum(sizes[:group.rank])
    for i in range(2):
        static.copy_(_ints(m, k, seed=10 * (i + 1) + group.rank))
        graph.replay()
        group.synchronize()
        mine = static.double() @ b.double()
        parts = group.all_gather_object(mine.cpu())
        total = sum(parts).cuda()
        assert torch.equal(out, total[lo:lo + sizes[group.rank]].to(out.dtype)), f"replay {i}"
    return True
