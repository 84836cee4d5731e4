"""gemm_rs / gemm_ar on the CPU virtual world (interpreter): order-exact results, determinism,
batch invariance, arrival-order independence, torch integration and autograd."""
import time

import pytest
import torch

import ditron_ops
from ditron_ops import reference
from ditron_ops.testing.ag_gemm_checks import interpreter_split_tail
from ditron_ops.testing.gemm_rs_checks import check_gemm_reduce, check_tp_mlp_autograd, gemm_rs_inputs, spy_own_tail

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world_size,m,n,k", [(1, 7, 5, 9), (2, 9, 11, 7), (3, 17, 20, 33), (4, 3, 6, 5)])
def test_order_exact(world_size, m, n, k, dtype):
    for algorithm in ("one_shot", "two_shot"):
        ditron_ops.launch(lambda g: check_gemm_reduce(g, m, n, k, dtype, algorithm=algorithm,
                                                      weight_layout=world_size % 2 == 0), world_size)


def test_custom_shard_sizes():
    ditron_ops.launch(lambda g: check_gemm_reduce(g, 10, 6, 8, torch.float32, shard_sizes=[7, 0, 3]), 3)


@pytest.mark.parametrize("world_size,m,n,shard_sizes", [(2, 40, 20, None), (2, 64, 32, None),
                                                       (3, 48, 20, [5, 40, 3]), (4, 70, 48, [0, 33, 16, 21])])
def test_whole_and_boundary_tiles(world_size, m, n, shard_sizes):
    """Shards spanning whole row tiles (reduced in the GEMM epilogue from registers) and tiles
    shared with a neighbour (own rows through the own slot), tile-aligned or not, with an empty
    rank; N a multiple of 16 or not (the kernels' vector-store variant)."""
    ditron_ops.launch(lambda g: check_gemm_reduce(g, m, n, 12, torch.float32, shard_sizes=shard_sizes),
                      world_size)


def test_baseline_matches_reference():
    def body(group):
        a, b = gemm_rs_inputs(group, 12, 9, 10, torch.float32)
        want = reference.all_reduce(a @ b, group)
        rs = ditron_ops.gemm_rs(a, b, group, impl="baseline")
        ar = ditron_ops.gemm_ar(a, b, group, impl="baseline")
        torch.testing.assert_close(ar, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rs, want[6 * group.rank:6 * group.rank + 6], rtol=1e-5, atol=1e-5)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_run_to_run_bitwise_100_repeats():
    def body(group):
        a, b = gemm_rs_inputs(group, 6, 5, 7, torch.float32, seed=3)
        with ditron_ops.deterministic():
            first_rs, first_ar = ditron_ops.gemm_rs(a, b, group), ditron_ops.gemm_ar(a, b, group)
            for _ in range(100):
                assert torch.equal(ditron_ops.gemm_rs(a, b, group), first_rs)
                assert torch.equal(ditron_ops.gemm_ar(a, b, group), first_ar)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_batch_invariance():
    """Row i of the result depends only on row i of a: op(a[:k]) == op(a)[:k]."""
    def body(group):
        a, b = gemm_rs_inputs(group, 23, 9, 13, torch.float32, seed=5)
        full = ditron_ops.gemm_ar(a, b, group, deterministic=True)
        for k in (1, 2, 3, 5, 8, 13, 17, 23):
            assert torch.equal(ditron_ops.gemm_ar(a[:k], b, group, deterministic=True), full[:k]), k
            rows = ditron_ops.gemm_rs(a[:k], b, group, deterministic=True)
            start = sum(ditron_ops.split_sizes(k, group.world_size)[:group.rank])
            assert torch.equal(rows, full[start:start + rows.shape[0]]), k
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3


def test_arrival_order_independence():
    def body(group, delays):
        a, b = gemm_rs_inputs(group, 11, 7, 9, torch.float32, seed=9)
        time.sleep(delays[group.rank])
        return ditron_ops.gemm_ar(a, b, group, deterministic=True)
    quick = ditron_ops.launch(body, 3, args=([0.0, 0.0, 0.0],))
    skewed = ditron_ops.launch(body, 3, args=([0.3, 0.0, 0.15],))
    reversed_ = ditron_ops.launch(body, 3, args=([0.0, 0.15, 0.3],))
    for got in (skewed, reversed_):
        assert all(torch.equal(x, y) for x, y in zip(got, quick))


@pytest.mark.parametrize("bad,exc,match", [
    (dict(a=torch.zeros(4, 3, dtype=torch.int64)), TypeError, "dtype"),
    (dict(b=torch.zeros(5, 6)), ValueError, "K_r must match"),
    (dict(impl="x"), ValueError, "impl must be"),
    (dict(shard_sizes=[1, 1]), ValueError, "must sum to M"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
])
def test_validation(bad, exc, match):
    def body(group):
        args = dict(a=torch.zeros(4, 3), b=torch.zeros(3, 6), impl="fused", shard_sizes=None,
                    deterministic=None)
        args.update(bad)
        with pytest.raises(exc, match=match):
            ditron_ops.gemm_rs(args.pop("a"), args.pop("b"), group, **args)
        assert group._workspaces == {}
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def _opcheck(group):
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ditron.gemm_rs.default, (a, b, group.group_name, [6], True, "fused"),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.ditron.gemm_ar.default,
                          (a, b, group.group_name, False, "fused", "one_shot"), test_utils=utils)
    return True


def test_opcheck():
    assert ditron_ops.launch(_opcheck, 1) == [True]


def test_compile_fullgraph():
    def body(group):
        a, b = torch.randn(6, 5), torch.randn(5, 4)

        def step(x):
            return ditron_ops.gemm_ar(x.relu(), b, group, deterministic=True, impl="fused") * 2

        torch._dynamo.reset()
        return torch.equal(torch.compile(step, fullgraph=True)(a), step(a))
    assert ditron_ops.launch(body, 1) == [True]


def test_autograd_tensor_parallel_mlp():
    """y = gemm_rs(ag_gemm(x, w1), w2): gradients vs the single-process reference."""
    assert ditron_ops.launch(check_tp_mlp_autograd, 3, args=([3, 5, 4], 6, 4)) == [True] * 3


def test_auto_rule_of_the_reductions():
    """``impl="auto"``: gemm_rs fused on multi-GPU groups from ``AUTO_MIN_FLOPS_RS`` up, gemm_ar
    never; both unfused in virtual worlds and on CPU; deterministic mode and ``impl="fused"``
    always run our kernels where there is symmetric memory."""
    import types

    from ditron_ops.gemm import gemm_rs as api

    bound = api.AUTO_MIN_FLOPS_RS
    gpu = types.SimpleNamespace(has_symmetric_memory=True, backend="nvshmem",
                                device=torch.device("cuda"))
    assert api._fused_wanted(gpu, "auto", False, "gemm_rs", bound)
    assert not api._fused_wanted(gpu, "auto", False, "gemm_rs", bound - 1)
    assert not api._fused_wanted(gpu, "auto", False, "gemm_ar", 100 * bound)
    assert api._fused_wanted(gpu, "auto", True, "gemm_ar", 1)
    assert api._fused_wanted(gpu, "fused", False, "gemm_ar", 1)
    assert not api._fused_wanted(gpu, "baseline", False, "gemm_rs", 100 * bound)
    for other in ({"backend": "virtual"}, {"device": torch.device("cpu")}):
        group = types.SimpleNamespace(**{**vars(gpu), **other})
        assert not api._fused_wanted(group, "auto", False, "gemm_rs", 100 * bound)
    no_heap = types.SimpleNamespace(**{**vars(gpu), "has_symmetric_memory": False})
    assert not api._fused_wanted(no_heap, "fused", True, "gemm_rs", 100 * bound)


def _lowp_vs_exact(group, m, n, k):
    from ditron_ops.testing.gemm_rs_checks import order_exact

    a, b = gemm_rs_inputs(group, m, n, k, torch.float16)
    want = order_exact(a, b, group).float()
    rows = ditron_ops.split_sizes(m, group.world_size)
    start = sum(rows[:group.rank])
    scale = want.abs().max().item()
    rs = ditron_ops.gemm_rs(a, b, group, impl="fused", deterministic=False).float()
    errs = [(rs - want[start:start + rows[group.rank]]).abs().max().item() / scale]
    for algorithm in ("one_shot", "two_shot"):
        ar = ditron_ops.gemm_ar(a, b, group, impl="fused", deterministic=False, algorithm=algorithm)
        errs.append((ar.float() - want).abs().max().item() / scale)
    exact = ditron_ops.gemm_rs(a, b, group, impl="fused", deterministic=True)  # fp32 partials
    return max(errs), torch.equal(exact.float(), want[start:start + rows[group.rank]])


@pytest.mark.parametrize("world_size,m,n,k", [(2, 40, 48, 56), (3, 19, 17, 33)])
def test_lowp_partials(world_size, m, n, k, monkeypatch):
    """``LOWP_PARTIALS``: default-mode partials rounded to the input dtype (fp16 here) stay
    within fp16 tolerance of the order-exact sum; deterministic mode still matches it bitwise."""
    from ditron_ops.gemm import _rs_launch as _launch

    monkeypatch.setattr(_launch, "LOWP_PARTIALS", True)
    for err, exact in ditron_ops.launch(_lowp_vs_exact, world_size, device="cpu", args=(m, n, k)):
        assert 0 < err <= 4e-3 and exact, (err, exact)


def _split_tail(monkeypatch, programs: int) -> list:
    """Interpreter split tail on ``programs`` programs; the ``own_tail`` results."""
    interpreter_split_tail(monkeypatch, programs)
    return spy_own_tail(monkeypatch)


def test_own_tail_rule():
    """The split tail applies when the partial last wave lies within the rank's whole tiles."""
    from ditron_ops.gemm._core import TileConfig
    from ditron_ops.gemm._rs_launch import own_tail

    cfg = TileConfig(128, 256, 64, 8, 8, 3, split_tail=True)
    assert own_tail(8192, 12288, 0, 8192, 132, cfg) == 36  # 3072 tiles: 23 waves + 36
    assert own_tail(8192, 4096, 0, 8192, 132, cfg) == 0  # 1024 tiles: 100 left, over half
    assert own_tail(8192, 16384, 4096, 8192, 66, cfg) == 4  # W=2: 4096 tiles, 2048 of them own
    assert own_tail(8192, 16384, 8100, 8192, 66, cfg) == 0  # no whole own row tile
    assert own_tail(8192, 16384, 0, 8192, 132, TileConfig(128, 256, 64, 8, 8, 3)) == 0


@pytest.mark.parametrize("m,n,k,programs", [(40, 70, 24, 4), (33, 96, 17, 7), (64, 90, 20, 5)])
def test_split_tail_one_rank(monkeypatch, m, n, k, programs):
    """W=1 (every tile its own, no waits, so several programs run in the interpreter): the
    rule's tail as halves (an N whose last half is past N), equal to the order-exact sum."""
    seen = _split_tail(monkeypatch, programs)
    ditron_ops.launch(lambda g: check_gemm_reduce(g, m, n, k, torch.float32, exact=True), 1)
    assert seen and all(t > 0 for t in seen), seen


@pytest.mark.parametrize("world_size,m,n,shard_sizes", [(2, 40, 70, None), (3, 48, 50, [5, 40, 3]),
                                                       (4, 70, 48, [0, 33, 16, 21])])
def test_split_tail_forced(monkeypatch, world_size, m, n, shard_sizes):
    """W > 1 needs one program per rank in the interpreter (a waiting program would block the
    rank's later ones), which leaves no partial wave: the rule is forced to a 2-tile tail, so
    own tiles run as halves next to peers' partials and boundary rows, bitwise order-exact."""
    from ditron_ops.gemm import _rs_launch as _launch

    seen = _split_tail(monkeypatch, 1)
    monkeypatch.setattr(_launch, "tail_tiles", lambda tiles, programs, cfg: min(tiles, 2))
    ditron_ops.launch(lambda g: check_gemm_reduce(g, m, n, 12, torch.float32, exact=True,
                                                  shard_sizes=shard_sizes), world_size)
    assert any(t > 0 for t in seen), seen


def test_ws_producer_setting_off_sm90_keeps_the_portable_kernels(monkeypatch):
    """``PRODUCER_CORE = "ws"`` where the WS core cannot run (the interpreter): the portable
    kernels serve, results unchanged; an unknown setting is a ``ValueError`` at the plan."""
    from ditron_ops.gemm import _rs_launch
    monkeypatch.setattr(_rs_launch, "PRODUCER_CORE", "ws")

    def body(group):
        gen = torch.Generator().manual_seed(group.rank)
        a = torch.randint(-4, 5, (40, 16), generator=gen).to(torch.float16)
        b = torch.randint(-4, 5, (16, 32), generator=gen).to(torch.float16)
        got = ditron_ops.gemm_rs(a, b, group, impl="fused", shard_sizes=[25, 15],
                                 deterministic=False)  # (the default mode: WS-eligible)
        plan = next(reversed(group.plans._plans.values()))
        assert isinstance(plan, _rs_launch.RsPlan) and plan.ws_gemm is None
        total = sum(group.all_gather_object((a.double() @ b.double())))
        lo = 25 * group.rank
        assert torch.equal(got, total[lo:lo + got.shape[0]].to(got.dtype))
        return True
    assert ditron_ops.launch(body, 2) == [True, True]
    monkeypatch.setattr(_rs_launch, "PRODUCER_CORE", "cutlass")
    with pytest.raises(Exception, match="PRODUCER_CORE"):
        ditron_ops.launch(lambda g: check_gemm_reduce(g, 8, 16, 8, torch.float32), 1)
