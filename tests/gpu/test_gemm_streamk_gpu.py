"""GPU tier (H200): stream-K in the default mode's plain ``matmul`` (``_core.StreamKGemm``) with
the compiled kernels: every candidate forced is exact on integer-valued inputs under one wave
(tiles in up to ``MAX_PIECES`` pieces) and over two (whole waves data-parallel first), with edge
tiles, K off BLOCK_K, bias, both B layouts, fp32 and column-major outputs; the same bits call
after call and from a CUDA-graph replay; deterministic mode never runs it."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, matmul_choice, program_budget

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _ints(*shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype=dtype, device=DEV)


def _plan():
    return next(reversed(_core._MATMUL_PLANS.cache._plans.values()))


@pytest.mark.parametrize("name", [c.name for c in rules.GPU_CANDIDATES])
def test_forced_streamk_is_exact_on_integer_inputs(name):
    """Each candidate forced stream-K on a few-tile, long-K shape (tiles in several pieces) and
    on one of 2.3 waves (data-parallel waves, then the rest shared out): equal to the exact
    product, bf16 (column-major) and fp32 out, with and without bias, both B layouts."""
    cfg = rules.GPU_CANDIDATES[[c.name for c in rules.GPU_CANDIDATES].index(name)].cfg
    budget = program_budget(DEV, None)
    many = int(2.3 * budget) * cfg.block_m * cfg.block_n  # ~2.3 waves of tiles
    shapes = [(333, 200, 5000), (many // 1040 + 40, 1040, 1000)]
    for (m, n, k), layout, with_bias in itertools.product(shapes, ("kn", "nk"), (False, True)):
        a, bias = _ints(m, k, seed=1), _ints(n, seed=3)
        b = _ints(k, n, seed=2) if layout == "kn" else _ints(n, k, seed=2).t()
        want = a.double() @ b.double() + (bias.double() if with_bias else 0)
        f32 = torch.full((m, n), float("nan"), device=DEV)
        got = matmul(a, b, bias=bias if with_bias else None, out=f32, cfg=cfg, stream_k=True,
                     deterministic=False)
        lay = _plan().core.layout
        assert lay.pieces > 0, (m, n, k, lay)
        assert torch.equal(got, want.float()), (name, m, n, layout, with_bias)
        col = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV).t()
        got = matmul(a, b, bias=bias if with_bias else None, out=col, cfg=cfg, stream_k=True,
                     deterministic=False)
        assert torch.equal(got, want.to(torch.bfloat16)), (name, m, n, layout, with_bias)


def test_streamk_same_bits_and_graph_replay():
    """Normal inputs: the rule's stream-K pick (or forced) within bf16 rounding of the fp32
    product, the same bits call after call, a CUDA-graph replay with new values at the same
    addresses gives the eager bits; deterministic mode does not run stream-K."""
    m, n, k = 1480, 1792, 10432
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(DEV)
    b = (torch.randn(k, n, generator=gen) / k ** 0.25).to(torch.bfloat16).to(DEV)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    got = matmul(a, b, out=out, stream_k=True, deterministic=False)
    assert isinstance(_plan().core, _core.StreamKGemm)
    ref = a.float() @ b.float()
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert torch.equal(got.clone(), matmul(a, b, stream_k=True, deterministic=False))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, b, out=out, stream_k=True, deterministic=False)
    a.copy_((torch.randn(m, k, generator=gen) / k ** 0.25).to(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul(a, b, stream_k=True, deterministic=False))
    assert "streamk" not in matmul_choice(a, b, deterministic=True)
