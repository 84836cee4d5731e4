"""ag_gemm on the CPU virtual world (Triton interpreter): fused path vs all_gather + matmul."""
import pytest
import torch

import ditron_ops
from ditron_ops.gemm._core import matmul
from ditron_ops.testing.ag_gemm_checks import check_ag_gemm, interpreter_split_tail

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")

CASES = [  # (world size, shard sizes, N, K)
    (1, [23], 19, 13),
    (2, [5, 7], 33, 24),
    (3, [17, 0, 9], 21, 40),
    (4, [3, 18, 1, 5], 37, 21),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world_size,sizes,n,k", CASES)
def test_ag_gemm_odd_sizes(world_size, sizes, n, k, dtype):
    ditron_ops.launch(check_ag_gemm, world_size, args=(sizes, n, k, dtype))


@pytest.mark.parametrize("weight_layout,with_bias,use_out", [(False, False, True), (True, True, True),
                                                             (False, True, False)])
def test_ag_gemm_layouts_bias_out(weight_layout, with_bias, use_out):
    def body(group):
        return check_ag_gemm(group, [9, 4], 18, 17, torch.float32, weight_layout=weight_layout,
                             with_bias=with_bias, use_out=use_out)
    ditron_ops.launch(body, 2)


def test_ag_gemm_baseline_and_auto_match_reference():
    for impl in ("baseline", "auto"):
        ditron_ops.launch(lambda g: check_ag_gemm(g, [6, 3], 10, 12, torch.float32, impl=impl), 2)


def test_ag_gemm_back_to_back_varying_shapes():
    """Buffer reuse: consecutive calls with different M, N, K never see stale chunks."""
    def body(group):
        for i in range(8):
            sizes = [(i * 7 + q * 3) % 11 for q in range(group.world_size)]
            check_ag_gemm(group, sizes, 5 + 3 * i, 8 + 5 * i, torch.float32, seed=i,
                          return_gathered=i % 2 == 0)
        return True
    assert ditron_ops.launch(body, 4) == [True] * 4


@pytest.mark.parametrize("producer", ["copy", "pull", "push"])
@pytest.mark.parametrize("world_size,sizes,n,k", CASES)
def test_ag_gemm_each_producer(monkeypatch, producer, world_size, sizes, n, k):
    """Every producer (copy engines, the SM pull kernel, the one-launch push call) gives the
    same results, including back-to-back calls whose chunks change size (the count words of the
    pad are reused)."""
    from ditron_ops.gemm import _ag_launch as _launch

    monkeypatch.setattr(_launch, "PRODUCER", producer)

    def body(group):
        check_ag_gemm(group, sizes, n, k, torch.float16)
        for i in range(3):
            check_ag_gemm(group, [(s + i) % 7 for s in sizes], n + i, k + 2 * i, torch.float32,
                          seed=i, return_gathered=i == 1)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("producer", ["copy", "pull", "push", "mixed"])
def test_ag_gemm_back_to_back_without_host_sync(monkeypatch, producer):
    """Calls whose shard sizes change, issued back to back with nothing between them (a fast
    rank starts its next call while peers still gather the last one); checked afterwards."""
    from ditron_ops import reference
    from ditron_ops.gemm import _ag_launch as _launch
    from ditron_ops.testing.ag_gemm_checks import ag_gemm_inputs

    layouts = [[(i * 5 + q * 3) % 9 + (q == 0) for q in range(4)] for i in range(16)]
    # "mixed": the producers in turn on one workspace (they share the pad's epoch and counts)
    producers = [("copy", "push", "pull")[i % 3] if producer == "mixed" else producer
                 for i in range(len(layouts))]

    def call(a, b, sizes, chosen):
        monkeypatch.setattr(_launch, "PRODUCER", chosen)
        return ditron_ops.ag_gemm(a, b, group=None, impl="fused", shard_sizes=sizes)

    def body(group):
        inputs = [ag_gemm_inputs(group, sizes, 7, 12, torch.float32, True, seed=i)
                  for i, sizes in enumerate(layouts)]
        outs = [call(a, b, sizes, chosen)
                for (a, b, _), sizes, chosen in zip(inputs, layouts, producers)]
        for (a, b, _), sizes, out in zip(inputs, layouts, outs):
            want = reference.all_gather(a, group, sizes) @ b
            assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), sizes
        return True
    assert ditron_ops.launch(body, 4) == [True] * 4


def test_matmul_core_matches_torch():
    a = torch.randn(37, 29)
    w = torch.randn(21, 29)
    torch.testing.assert_close(matmul(a, w.t()), a @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(matmul(a, w.t().contiguous()), a @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,exc,match", [
    (dict(a=torch.zeros(4, 3, dtype=torch.int32)), TypeError, "dtype"),
    (dict(b=torch.zeros(5, 6)), ValueError, "K must match"),
    (dict(bias=torch.zeros(7)), ValueError, "bias must be"),
    (dict(impl="fast"), ValueError, "impl must be"),
    (dict(shard_sizes=[4]), ValueError, "entries"),
    (dict(out=torch.zeros(3, 6)), ValueError, "out must be"),
    (dict(b=torch.zeros(3, 6, dtype=torch.float16)), TypeError, "dtype"),
])
def test_ag_gemm_validation(bad, exc, match):
    def body(group):
        args = dict(a=torch.zeros(4, 3), b=torch.zeros(3, 6), bias=None, impl="fused",
                    shard_sizes=None, out=None)
        args.update(bad)
        with pytest.raises(exc, match=match):
            ditron_ops.ag_gemm(args.pop("a"), args.pop("b"), group, **args)
        assert group._workspaces == {}  # raised before anything was allocated or launched
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def _opcheck(group):
    a = torch.randn(5, 8)
    b = torch.randn(8, 6)
    bias = torch.randn(6)
    out = torch.empty(5, 6)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ditron.ag_gemm.default,
                          (a, b, bias, group.group_name, [5], True, "fused"), test_utils=utils)
    torch.library.opcheck(torch.ops.ditron.ag_gemm_out.default,
                          (a, b, None, out, group.group_name, [5], False, "fused"), test_utils=utils)
    return True


def test_ag_gemm_opcheck():
    assert ditron_ops.launch(_opcheck, 1) == [True]


def _compiled(group):
    a = torch.randn(6, 8)
    w = torch.randn(5, 8)

    def step(x):
        return ditron_ops.ag_gemm(x * 2, w.t(), group, impl="fused").relu()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    return torch.allclose(compiled(a), step(a), rtol=1e-5, atol=1e-5)


def test_ag_gemm_compile_fullgraph():
    assert ditron_ops.launch(_compiled, 1) == [True]


@pytest.mark.parametrize("backend,bound_name", [("virtual", "AUTO_MIN_FLOPS_VIRTUAL"),
                                                ("nvshmem", "AUTO_MIN_FLOPS_PER_RANK")])
def test_auto_rule_switches_at_the_measured_bound(backend, bound_name):
    """``impl="auto"``: fused from the backend's FLOP bound up, the baseline below it, always
    the baseline on CPU or without symmetric memory; explicit impls win."""
    import types

    from ditron_ops.gemm import ag_gemm as api

    bound = getattr(api, bound_name)
    gpu = types.SimpleNamespace(has_symmetric_memory=True, backend=backend, device=torch.device("cuda"))
    m, n = 1024, 2048
    k_at = -(-bound // (2 * m * n))  # smallest K reaching the bound
    assert api.use_fused(gpu, "auto", m, n, k_at)
    assert not api.use_fused(gpu, "auto", m, n, k_at - 1)
    assert not api.use_fused(gpu, "baseline", m, n, k_at)
    assert api.use_fused(gpu, "fused", m, n, 1)
    cpu = types.SimpleNamespace(**{**vars(gpu), "device": torch.device("cpu")})
    assert not api.use_fused(cpu, "auto", m, n, 10 * k_at)
    torch_group = types.SimpleNamespace(**{**vars(gpu), "has_symmetric_memory": False})
    assert not api.use_fused(torch_group, "fused", m, n, k_at)


def _lying_shard(group):
    b = torch.ones(8, 16)
    ditron_ops.ag_gemm(torch.ones(64, 8), b, group, impl="fused")  # the workspace, grown once
    group.synchronize()
    a = torch.ones(3 + group.rank, 8)  # shard_sizes=None promises equal shards; rank 1 lies
    try:
        ditron_ops.ag_gemm(a, b, group, impl="fused")
        group.synchronize()
    except ditron_ops.DitronSizeMismatchError as exc:
        return exc.op
    return "no error"


def test_shard_size_disagreement_is_reported():
    """Every chunk's size is checked: a disagreement is reported instead of computing garbage."""
    assert ditron_ops.launch(_lying_shard, 2, device="cpu", timeout_s=5.0) == ["ag_gemm"] * 2


def test_tail_tiles_rule():
    """A partial last wave of at most half the grid runs as halves; anything else does not."""
    from ditron_ops.gemm._core import TileConfig, tail_tiles

    on = TileConfig(128, 256, 64, 8, 8, 3, split_tail=True)
    assert tail_tiles(448, 132, on) == 52  # 8192 x 1792: 3 waves + 52 -> 104 halves
    assert tail_tiles(960, 132, on) == 36  # 8192 x 3696
    assert tail_tiles(384, 132, on) == 0  # 120 left: 240 halves would need two waves
    assert tail_tiles(396, 132, on) == 0  # whole waves
    assert tail_tiles(7, 14, on) == 7  # small M: every tile as halves
    assert tail_tiles(448, 132, TileConfig(128, 256, 64, 8, 8, 3)) == 0


def test_fit_stages_rule(monkeypatch):
    """Pipeline stages are cut only where A/B stages + the C store block pass the shared-memory
    limit: on the H200 fp32 C at 4 stages (262,176 bytes compiled), not bf16 C (229,408)."""
    from ditron_ops.gemm import _core as _launch

    monkeypatch.setattr(_launch, "_shared_memory_limit", lambda index: 232448)
    s4 = _launch.GPU_CONFIGS["128x256x64/s4/tail"]
    gpu = torch.device("cuda", 0)
    assert _launch.fit_stages(s4, gpu, 2, 2) is s4
    assert _launch.fit_stages(s4, gpu, 2, 4) == _launch.TileConfig(128, 256, 64, 8, 8, 3,
                                                                   split_tail=True)
    assert _launch.fit_stages(s4, gpu, 4, 4).num_stages == 2  # never below 2
    assert _launch.fit_stages(s4, torch.device("cpu"), 2, 4) is s4


@pytest.mark.parametrize("m,n,k,programs", [(40, 70, 24, 4), (33, 96, 17, 7), (48, 50, 16, 12),
                                            (16, 20, 9, 3)])
def test_split_tail_matmul_matches_reference(monkeypatch, m, n, k, programs):
    """The plain GEMM with its last partial wave as half tiles (an odd N whose last half is past
    N, a bias, strided output), against an fp32 reference."""
    from ditron_ops.gemm import _core as _launch

    cfg = interpreter_split_tail(monkeypatch, programs)
    tiles = -(-m // 16) * -(-n // 32)
    grid = _launch.consumer_grid(torch.device("cpu"), None, tiles, cfg)
    assert _launch.tail_tiles(tiles, grid, cfg) > 0  # the tail loop runs
    gen = torch.Generator().manual_seed(m * n)
    a, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = torch.empty(m, 2 * n)[:, ::2]
    got = matmul(a, w.t(), bias=bias, out=out)
    torch.testing.assert_close(got, a @ w.t() + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size,sizes", [(2, [21, 19]), (3, [17, 0, 30]), (4, [3, 18, 1, 25])])
def test_split_tail_ag_gemm_matches_reference(monkeypatch, world_size, sizes):
    """The fused consumer with split tails (each half waits for its rows' chunks)."""
    from ditron_ops.gemm import _core as _launch

    cfg = interpreter_split_tail(monkeypatch, 4)
    assert _launch.tail_tiles(6, _launch.consumer_grid(torch.device("cpu"), None, 6, cfg), cfg) == 2
    ditron_ops.launch(check_ag_gemm, world_size, args=(sizes, 45, 20, torch.float32))


def test_auto_producer_pushes_small_gathers(monkeypatch):
    """``PRODUCER = "auto"``: the one-launch push call up to ``PUSH_MAX_BYTES`` of gathered
    rows (a rank-uniform rule), copy engines above."""
    from ditron_ops.gemm import _ag_launch as _launch

    chosen = []
    plan = _launch.AgGemmPlan

    def spy(group, a, b, bias, out, sizes, producer, *rest):
        chosen.append(producer)
        return plan(group, a, b, bias, out, sizes, producer, *rest)

    monkeypatch.setattr(_launch, "AgGemmPlan", spy)
    monkeypatch.setattr(_launch, "PUSH_MAX_BYTES", 16 * 8 * 4)  # 16 rows of K=8 fp32

    def body(group):
        for rows in (8, 9):  # 16 and 18 gathered rows
            a, b = torch.randn(rows, 8), torch.randn(8, 5)
            ditron_ops.ag_gemm(a, b, group, impl="fused")
        return True
    assert ditron_ops.launch(body, 2) == [True, True]
    assert chosen == ["push", "push", "copy", "copy"], chosen
