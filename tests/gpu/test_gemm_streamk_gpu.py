"""GPU tier: the stream-K experiment (``matmul(..., stream_k=True)``) on the device's SMs:
exact on integer inputs where tiles are cut between programs (under one wave with a long K,
1.2 waves, 2.3 waves with one wave data-parallel), both B layouts, bias, TMA and pointer C
stores; the same bits over CUDA-graph replays; the flags and ticket zero after every call."""
import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm._core import matmul, program_budget, streamk_split

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda", 0)


def _ints(*shape, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=gen).to(device=DEV, dtype=dtype)


def _plan():
    return next(reversed(_core._MATMUL_PLANS.cache._plans.values()))


@pytest.mark.parametrize("name", ["128x256x64/s4/tail", "128x128x64/s5/w4", "64x256x64/s4",
                                  "64x128x64/s6"])
def test_streamk_exact_on_integer_inputs(name):
    """|values| <= 2 and K <= 4096: every fp32 sum is exact, so the output is the exact
    product rounded once (bf16; fp32 out through pointer stores)."""
    from ditron_ops.gemm._core_configs import GPU_CANDIDATES

    cfg = next(c.cfg for c in GPU_CANDIDATES if c.name == name)
    budget = program_budget(DEV, None)
    ran = 0
    for m, n, k in ((800, 768, 4096), (928, 4992, 952), (4808, 272, 4000), (2704, 2560, 1000),
                    (257, 712, 1000)):
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        if streamk_split(tiles, -(-k // cfg.block_k), budget) is None:
            continue
        a, w = _ints(m, k, seed=m), _ints(n, k, seed=n)
        bias = _ints(n, seed=3)
        exact = a.double() @ w.double().t()
        for b in (w.t(), w.t().contiguous()):
            got = matmul(a, b, cfg=cfg, stream_k=True, deterministic=False)
            assert isinstance(_plan().core, _core.StreamKGemm)
            assert torch.equal(got, exact.to(torch.bfloat16)), (name, m, n, k)
            core = _plan().core
            assert int(core.flags.abs().sum()) == 0 and int(core.ticket) == 0
        f32 = torch.empty(m, n, device=DEV, dtype=torch.float32)
        matmul(a, w.t(), bias=bias, out=f32, cfg=cfg, stream_k=True, deterministic=False)
        assert torch.equal(f32, (exact + bias.double()).float()), (name, m, n, k)
        ran += 1
    assert ran >= 2


def test_streamk_graph_replays_are_the_same_bits():
    """Normal inputs: stream-K within bf16 rounding of the fp32 product, and 20 replays of a
    captured call give the same bits as the eager call."""
    m, n, k = 800, 768, 10760
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(DEV, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(DEV, torch.bfloat16)
    out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    matmul(a, w.t(), out=out, stream_k=True, deterministic=False)
    ref = a.float() @ w.float().t()
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, w.t(), out=out, stream_k=True, deterministic=False)
    for _ in range(20):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
