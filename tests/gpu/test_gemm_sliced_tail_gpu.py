"""GPU tier (H200): the sliced tail of the default mode's plain ``matmul``
(``_core.SlicedTailGemm``) with the compiled kernels: the rule's pick on a shape a few tiles past
a whole wave runs the unsplit launch on the whole waves and the last wave in K slices; forced
slices are exact on integer-valued inputs (edge tiles, K off BLOCK_K, bias, both B layouts,
strided and fp32 outputs); the same bits call after call and from a CUDA-graph replay;
deterministic mode never slices."""
import dataclasses

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, program_budget
from gemm_helpers import integer_cases, ints as _ints, last_plan as _plan  # (tests/gpu/)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def _past_a_wave():
    """``(m, n, k)``: 8 columns of 128x256 tiles, one row of them more than a whole wave of this
    GPU's SMs needs (1-8 tiles left), M and N off the tiles, K = 4000 (63 steps, the last
    partial)."""
    rows = program_budget(DEV, None) // 8 + 1
    return 128 * rows - 40, 256 * 8 - 24, 4000


def test_the_rule_slices_the_last_wave_and_is_exact():
    """The rule's pick for ``_past_a_wave`` is a sliced tail, and the plan runs it: the unsplit
    launch on the whole waves (its grid the budget, the left tiles not in it), the split
    launches on the left tiles only; integer inputs give the exact product rounded once, with
    and without bias, both B layouts; deterministic mode runs the unsplit tiles, to the same
    bits on these inputs."""
    budget = program_budget(DEV, None)
    m, n, k = _past_a_wave()
    cand, s = rules.select_split(m, n, k, budget, DEV, deterministic=False)
    assert s == 1 and cand.cfg.tail_slices >= 2, cand
    tiles = -(-m // 128) * 8
    a, bias = _ints(m, k, seed=1), _ints(n, seed=3)
    for layout, with_bias, b, want in integer_cases(a, bias, k, n):
        got = matmul(a, b, bias=bias if with_bias else None, deterministic=False, core="tl")
        core = _plan().core
        assert isinstance(core, _core.SlicedTailGemm) and core.tail is not None
        assert core.main.kernel.grid[0] == budget
        assert core.tail.parts.shape[0] == core.tail.slices * (tiles % budget) * 128
        assert torch.equal(got, want.to(torch.bfloat16)), (layout, with_bias)
        assert torch.equal(got, matmul(a, b, bias=bias if with_bias else None,
                                       deterministic=False, core="tl"))
    det = matmul(a, b, bias=bias, deterministic=True)
    assert not isinstance(_plan().core, _core.SlicedTailGemm) and torch.equal(det, got)


@pytest.mark.parametrize("main", [rules.SLICED_TAIL_MAIN, rules.GPU_CANDIDATES[1]],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("slices", [2, 3, 8])
def test_forced_slices_are_exact_on_integer_inputs(slices, main):
    """The sliced 128x256 and 128x128 tiles forced with 2, 3 and 8 slices on ``_past_a_wave``
    and on a shape whose left tiles hold the M edge (the last rows): fp32 and column-major bf16
    outputs, with and without bias, both B layouts, equal to the exact product."""
    cfg = dataclasses.replace(main.cfg, tail_slices=slices)
    budget = program_budget(DEV, None)
    for m, n, k in (_past_a_wave(), (128 * (budget // 4) + 72, 1000, 1000)):
        a, bias = _ints(m, k, seed=1), _ints(n, seed=3)
        for layout, with_bias, b, want in integer_cases(a, bias, k, n):
            f32 = torch.full((m, n), float("nan"), device=DEV)  # (a skipped tile stays NaN)
            got = matmul(a, b, bias=bias if with_bias else None, out=f32, cfg=cfg,
                         deterministic=False, core="tl")
            assert _plan().core.tail is not None
            assert torch.equal(got, want.float()), (m, n, slices, layout, with_bias)
            col = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device=DEV).t()
            got = matmul(a, b, bias=bias if with_bias else None, out=col, cfg=cfg,
                         deterministic=False, core="tl")
            assert torch.equal(got, want.to(torch.bfloat16)), (m, n, slices, layout, with_bias)


def test_sliced_tail_replays_from_a_cuda_graph():
    """Captured after one eager call, the three launches replay to the eager call's bits with
    new input values at the same addresses; normal inputs are within bf16 rounding of the fp32
    product."""
    m, n, k = _past_a_wave()
    gen = torch.Generator(device="cpu").manual_seed(4)
    a = torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, k, generator=gen).to(dtype=torch.bfloat16, device=DEV).t()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    matmul(a, b, out=out, deterministic=False, core="tl")
    assert isinstance(_plan().core, _core.SlicedTailGemm)
    ref = a.float() @ b.float()
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, b, out=out, deterministic=False, core="tl")
    a.copy_(torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device=DEV))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul(a, b, deterministic=False, core="tl"))
