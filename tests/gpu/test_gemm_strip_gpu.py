"""GPU tier (H200): the plain ``matmul``'s wide tiles (``strip_gemm_kernel``: 272, 288, 320
columns) compiled: every wide candidate forced is exact on integer-valued inputs (N off the
tile width, M off BLOCK_M, K off BLOCK_K, bias, both B layouts, TMA and pointer-stored C); the
rule's pick is what the plan runs; a CUDA-graph replay gives the eager bits."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, program_budget
from gemm_helpers import ints as _ints, last_plan as _plan  # (tests/gpu/)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("name", [c.name for c in rules.WIDE_CANDIDATES])
def test_forced_wide_tiles_are_exact_on_integer_inputs(name):
    cfg = next(c.cfg for c in rules.WIDE_CANDIDATES if c.name == name)
    for (m, n), layout, with_bias in itertools.product(((333, 600), (700, 280)), ("kn", "nk"),
                                                       (False, True)):
        k = 1000
        a, bias = _ints(m, k, seed=1), _ints(n, seed=3)
        b = _ints(k, n, seed=2) if layout == "kn" else _ints(n, k, seed=2).t()
        want = (a.double() @ b.double() + (bias.double() if with_bias else 0)).to(torch.bfloat16)
        got = matmul(a, b, bias=bias if with_bias else None, cfg=cfg, deterministic=False)
        assert isinstance(_plan().core, _core.StripGemm)
        assert torch.equal(got, want), (name, m, n, layout, with_bias)
        col = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV).t()
        got = matmul(a, b, bias=bias if with_bias else None, out=col, cfg=cfg,
                     deterministic=False)
        assert torch.equal(got, want), (name, m, n, layout, with_bias, "column-major")


def test_the_rule_runs_wide_tiles_and_replays():
    """8248x544x1424 (three 256-wide columns, the last 32 wide): the rule's pick on this GPU is
    what the plan runs, within bf16 rounding; a graph replay with new values gives the eager
    bits; deterministic mode keeps power-of-two tiles."""
    m, n, k = 8248, 544, 1424
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(DEV)
    b = (torch.randn(n, k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(DEV).t()
    cand, _ = rules.select_split(m, n, k, program_budget(DEV, None), DEV, deterministic=False)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    got = matmul(a, b, out=out, deterministic=False, core="tl")
    assert _plan().core.cfg.strip == cand.cfg.strip
    ref = a.float() @ b.float()
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, b, out=out, deterministic=False, core="tl")
    a.copy_((torch.randn(m, k, generator=gen) / k ** 0.25).to(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul(a, b, deterministic=False, core="tl"))
    matmul(a, b, deterministic=True)
    assert _plan().core.cfg.strip == 0
