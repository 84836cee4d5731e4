"""GPU tier (H200): split-K in the default mode's plain ``matmul`` (``_core.SplitKGemm``) with the
compiled kernels: the plan runs the rule's choice on few-tile, long-K shapes; forced splits of every
candidate are exact on integer-valued inputs (edge tiles, K off BLOCK_K, bias, both B layouts,
strided and fp32 outputs); the same bits call after call and from a CUDA-graph replay;
deterministic mode never splits."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, matmul_split, program_budget
from gemm_helpers import integer_cases, ints as _ints, last_plan as _plan  # (tests/gpu/)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
RULE_SHAPES = {(800, 768, 10760): True, (712, 896, 9288): True, (1392, 704, 15808): True,
               (200, 4736, 4504): False, (512, 512, 32768): True, (256, 512, 65536): True}
"""Few-tile, long-K shapes and whether the rule splits them on 132 SMs (``SPLIT_MARGIN``; the
constants fitted to ``benchmarks/probes/splitk_probe.py``'s runs): three of the sweep's, not a fourth, a few
tiles over a very long K."""


def _normal(m, n, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=DEV)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=DEV)
    return a, w.t()


def test_the_rule_splits_few_tile_long_k_shapes():
    """On this GPU's SMs the rule's choice for few-tile, long-K shapes (four of the sweep's, two
    with a very long K) is what the plan runs (``RULE_SHAPES`` on an H200's 132 SMs), within
    bf16 rounding of the fp32 product, the same bits call after call, and deterministic mode
    does not split them."""
    budget = program_budget(DEV, None)
    for (m, n, k), splits in RULE_SHAPES.items():
        a, b = _normal(m, n, k)
        want = rules.select_split(m, n, k, budget, DEV, deterministic=False)[1]
        assert matmul_split(a, b, deterministic=False, core="tl") == want, (m, n, k)
        if budget == 132:
            assert (want > 1) == splits, (m, n, k, want)
        got = matmul(a, b, deterministic=False, core="tl")
        ref = a.float() @ b.float()
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (m, n, k, err)
        assert torch.equal(got, matmul(a, b, deterministic=False, core="tl"))
        assert matmul_split(a, b, deterministic=True) == 1
        torch.testing.assert_close(matmul(a, b, deterministic=True).float(), ref,
                                   rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("name", [c.name for c in rules.GPU_CANDIDATES])
def test_forced_splits_are_exact_on_integer_inputs(name):
    """Every candidate with K forced into 2, 3 and 8 slices: integer-valued bf16 inputs (every
    partial exact in fp32), M and N off the tiles, K off BLOCK_K, with and without bias, B as
    ``[K, N]`` and as a weight's ``w.t()``, fp32 and bf16 (column-major) outputs: equal to the
    exact product."""
    cfg = rules.GPU_CANDIDATES[[c.name for c in rules.GPU_CANDIDATES].index(name)].cfg
    m, n, k = 333, 200, 1000
    a = _ints(m, k, seed=1)
    bias = _ints(n, seed=3)
    for split, layout, with_bias in itertools.product((2, 3, 8), ("kn", "nk"), (False, True)):
        b = _ints(k, n, seed=2) if layout == "kn" else _ints(n, k, seed=2).t()
        want = a.double() @ b.double() + (bias.double() if with_bias else 0)
        f32 = torch.empty(m, n, device=DEV)
        got = matmul(a, b, bias=bias if with_bias else None, out=f32, cfg=cfg, split_k=split,
                     deterministic=False, core="tl")
        assert _plan().split == rules.slices(k, 64, split)[0] > 1
        assert torch.equal(got, want.float()), (name, split, layout, with_bias)
        col = torch.empty(n, m, dtype=torch.bfloat16, device=DEV).t()
        got = matmul(a, b, bias=bias if with_bias else None, out=col, cfg=cfg, split_k=split,
                     deterministic=False, core="tl")
        assert torch.equal(got, want.to(torch.bfloat16)), (name, split, layout, with_bias)


def test_split_replays_from_a_cuda_graph():
    """A split call captured after one eager call (the plan and its partials built) replays to
    the eager call's bits with new input values at the same addresses."""
    m, n, k = 800, 768, 10760
    a, b = _normal(m, n, k, seed=4)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    matmul(a, b, out=out, split_k=4, deterministic=False, core="tl")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, b, out=out, split_k=4, deterministic=False, core="tl")
    a.copy_(_normal(m, n, k, seed=5)[0])
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul(a, b, split_k=4, deterministic=False, core="tl"))


def test_short_k_pairs_run_two_programs_per_sm_and_are_exact():
    """A short-K, many-wave shape (M and N off the tiles, K = 1024: A's and ``w.t()``'s rows on
    128-byte lines): the default mode's plain ``matmul`` runs ``SHORT_K_CANDIDATE`` (the
    rule's pick) on a grid of two programs per SM, with and without bias, B as ``[K, N]`` and
    as ``w.t()``, equal to the exact product rounded once, in deterministic mode too; an fp32
    C keeps ``select``'s tiles; a CUDA-graph replay gives the same bits. With K = 1000 (rows
    off lines: the rule leaves the pairs out) the pairs forced are exact too."""
    budget = program_budget(DEV, None)
    m, n, k = 128 * 12 + 40, 256 * (-(-2 * budget // 13)) + 72, 1024
    cand = rules.SHORT_K_CANDIDATE
    assert rules.select_split(m, n, k, budget, DEV, deterministic=False) == (cand, 1)
    assert rules.select_split(m, n, 1000, budget, DEV, deterministic=False)[0] != cand
    a_off, b_off = _ints(m, 1000, seed=1), _ints(n, 1000, seed=2).t()
    assert torch.equal(matmul(a_off, b_off, cfg=cand.cfg, deterministic=False, core="tl"),
                       (a_off.double() @ b_off.double()).to(torch.bfloat16))
    a, bias = _ints(m, k, seed=1), _ints(n, seed=3)
    for layout, with_bias, b, want in integer_cases(a, bias, k, n):
        got = matmul(a, b, bias=bias if with_bias else None, deterministic=False, core="tl")
        core = _plan().core
        tiles = -(-m // 128) * -(-n // 128)
        assert core.cfg.ctas_per_sm == 2 and core.kernel.grid[0] == min(tiles, 2 * budget)
        assert torch.equal(got, want.to(torch.bfloat16)), (layout, with_bias)
    det = matmul(a, b, bias=bias, deterministic=True)  # (the last layout, with bias: got's)
    assert _plan().core.cfg.ctas_per_sm == 2 and torch.equal(det, got)
    for mode in (False, True):
        f32 = matmul(a, b, out=torch.empty(m, n, device=DEV), deterministic=mode)
        assert _plan().core.cfg.ctas_per_sm == 1 and torch.equal(f32, (a.double() @ b.double()).float())
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    matmul(a, b, out=out, deterministic=False, core="tl")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, b, out=out, deterministic=False, core="tl")
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (a.double() @ b.double()).to(torch.bfloat16))
