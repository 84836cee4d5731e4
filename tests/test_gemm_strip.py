"""CPU tier: tiles wider than a power of two (``strip_gemm_kernel``, ``_core.StripGemm``:
``block_n + strip`` columns, two accumulators) in the default mode's plain ``matmul``, forced
with a ``cfg`` in the interpreter; the rule that weighs them (``_core_configs.wide``) as a pure
function on the GPU's candidates."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # only the type reaches the rule
STRIP = rules.TileConfig(16, 16, 16, 4, 4, 1, strip=16)  # tiles 16 x 32


def _ints(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(torch.float32)


@pytest.mark.parametrize("m,n,k", [(40, 24, 100), (33, 72, 52), (17, 40, 64), (16, 32, 16)])
def test_strip_tiles_are_exact_for_integer_inputs(m, n, k):
    """Integer-valued inputs: the wide tiles equal the reference bitwise with and without bias,
    both B layouts, row- and column-major out; N off the tile width (a last tile whose strip
    lies past N, or whose main part is cut), K off BLOCK_K."""
    for kind, with_bias in itertools.product(("kn", "nk"), (False, True)):
        a = _ints(m, k)
        b = _ints(k, n, seed=1) if kind == "kn" else _ints(n, k, seed=1).t()
        bias = _ints(n, seed=2) if with_bias else None
        want = a @ b + (bias if bias is not None else 0)
        got = matmul(a, b, bias=bias, cfg=STRIP, deterministic=False)
        plan = next(reversed(_core._MATMUL_PLANS.cache._plans.values()))
        assert isinstance(plan.core, _core.StripGemm)
        assert torch.equal(got, want), (kind, with_bias)
        col = torch.full((n, m), float("nan")).t()
        assert torch.equal(matmul(a, b, bias=bias, out=col, cfg=STRIP, deterministic=False), want)


def test_tile_width_enters_the_wave_model():
    """``predicted_time`` counts a wide tile's columns: 544 columns are two 272-wide tiles (one
    wave of 130 on 132 SMs) but three 256-wide ones (195: two waves)."""
    wide = next(c for c in rules.WIDE_CANDIDATES if c.cfg.strip == 16)
    assert rules.tile_width(wide.cfg) == 272
    big = rules.GPU_CANDIDATES[0]
    assert rules.predicted_time(wide, 8248, 544, 132) < rules.predicted_time(big, 8248, 544, 132)


def test_wide_tiles_only_in_the_default_mode_on_the_gpu_with_a_two_byte_c():
    """``wide``: none in deterministic mode, off the GPU or for an fp32 C; ``select_split``
    never takes them in those cases nor at M <= 128 (64-row tiles only), nor where ``short_k``
    takes the two-per-SM pairs."""
    assert rules.wide(4096, CUDA, False, 2) == rules.WIDE_CANDIDATES
    assert rules.wide(4096, CUDA, True, 2) == () and rules.wide(4096, CPU, False, 2) == ()
    assert rules.wide(4096, CUDA, False, 4) == ()
    for det, out_bytes in ((True, 2), (False, 4)):
        cand, _ = rules.select_split(8248, 544, 1424, 132, CUDA, deterministic=det,
                                     out_bytes=out_bytes)
        assert cand.cfg.strip == 0
    for m in (64, 128):
        assert rules.select_split(m, 544, 8192, 132, CUDA, deterministic=False)[0].cfg.strip == 0
    for shape in ((5408, 3936, 768), (15912, 8904, 1152)):  # the pairs' measured shapes
        assert rules.select_split(*shape, 132, CUDA, deterministic=False) == (
            rules.SHORT_K_CANDIDATE, 1)


def test_the_rule_takes_wide_tiles_on_the_sweep_shapes_where_they_measured_faster():
    """With ``WIDE_CANDIDATES``' efficiency, the 48 sweep shapes and the model shapes on an
    H200's 132 SMs take the wide tiles exactly where ``bench gemm_sweep --only wide`` measured
    them ahead of the rule's other tiles (the CSV in benchmarks/results), nowhere else, but
    3408x1248x7440, where the 128x256 tiles with their last 3 tiles in 8 K slices measured
    faster still (``sliced_tail``: 0.826x cuBLAS against 0.661x wide, ``bench gemm_sweep``)."""
    from ditron_ops.bench.gemm_sweep import _model_shapes, sweep_shapes
    picks = {s: rules.select_split(*s, 132, CUDA, deterministic=False)[0].name
             for s in list(sweep_shapes()) + list(_model_shapes())}
    assert {s: c for s, c in picks.items() if "x272" in c or "x288" in c or "x320" in c} == {
        (8248, 544, 1424): "128x272x64/s4", (928, 4992, 952): "128x320x64/s4"}
    assert picks[(3408, 1248, 7440)] == "128x256x64/s4/kt8"
