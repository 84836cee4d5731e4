"""GPU tier (H200): the experimental warp-specialized GEMM (``gemm._ws``, compiled): every variant
exact on integer-valued inputs over ragged shapes (K off 64, N off 128, M off the tiles, several
tiles per program, unaligned rows through padded copies), both B layouts, bf16 / fp16, fp32 and
column-major outputs; within rounding on normal inputs; the same bits from a CUDA-graph replay;
the compiled variants warp specialized (12 warps, ``ttg.warp_specialize``) or not (``nows/``)."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _ws
from ditron_ops.gemm._ws import WS_VARIANTS, ws_matmul

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES = [(257, 712, 1000), (1031, 392, 584), (128, 264, 72), (4096, 1160, 520), (100, 200, 37)]
"""Ragged shapes: N % 128 and K % 64 nonzero; 4096x1160 has more tiles than 132 SMs under every
variant; K = 37 leaves A and B rows unaligned (padded copies)."""


def _ints(*shape, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype=dtype, device=DEV)


@pytest.mark.parametrize("name", list(WS_VARIANTS))
def test_exact_on_integer_inputs(name):
    """|values| <= 4 and K <= 1000: every fp32 sum is exact, so the output is the exact product
    rounded once, bitwise (bf16 / fp16 out, fp32 out, column-major out; B as ``w.t()`` and as
    ``[K, N]``)."""
    for (m, n, k), dtype in itertools.product(SHAPES, (torch.bfloat16, torch.float16)):
        a = _ints(m, k, dtype=dtype, seed=m + k)
        w = _ints(n, k, dtype=dtype, seed=n)
        exact = a.double() @ w.double().t()
        for b in (w.t(), w.t().contiguous()):
            assert torch.equal(ws_matmul(a, b, name), exact.to(dtype)), (name, m, n, k, dtype)
        out = torch.empty(m, n, dtype=torch.float32, device=DEV)
        assert torch.equal(ws_matmul(a, w.t(), name, out=out), exact.float()), (name, m, n, k)
        col = torch.empty(n, m, dtype=dtype, device=DEV).t()
        assert torch.equal(ws_matmul(a, w.t(), name, out=col), exact.to(dtype)), (name, m, n, k)


@pytest.mark.parametrize("name", list(WS_VARIANTS))
def test_normal_inputs_and_graph_replay(name):
    """Within bf16 rounding of the fp32 product; a CUDA-graph replay with new values in ``a``
    gives the eager call's bits (the plan's scratch is made before capture)."""
    m, n, k = 1031, 1160, 1000
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(DEV)
    got = ws_matmul(a, w.t(), name)
    ref = a.float() @ w.float().t()
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    out = torch.empty_like(got)
    ws_matmul(a, w.t(), name, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ws_matmul(a, w.t(), name, out=out)
    a.neg_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ws_matmul(a, w.t(), name))


@pytest.mark.parametrize("name", list(WS_VARIANTS))
def test_compiled_warp_specialized(name):
    """What the device's Triton compiled: ``ws/`` variants as a producer and two consumer warp
    groups (12 warps, ``ttg.warp_specialize`` in the TTGIR, ``setmaxnreg`` in the PTX); ``nows/``
    as one 8-warp program."""
    v = WS_VARIANTS[name]
    a = torch.zeros(256, 256, dtype=torch.bfloat16, device=DEV)
    args, kwargs = _ws.kernel_args(a, a, a, 256, False, v)
    kernel = _ws.ws_gemm_kernel.warmup(*args, grid=(1,), **kwargs)
    ws = v.warp_specialize
    assert ("ttg.warp_specialize" in kernel.asm["ttgir"]) == ws
    assert ("setmaxnreg" in kernel.asm["ptx"]) == ws
    assert kernel.metadata.num_warps == (12 if ws else v.cfg.num_warps)
