"""CPU tier: the sliced tail of the default mode's plain ``matmul`` (``_core.SlicedTailGemm``,
the rule ``_core_configs.sliced_tail``): the whole waves unsplit, the partial last wave's tiles
in K slices. In the interpreter (one program) a plan never has a partial wave, so the kernels
run through ``SlicedTailGemm`` built with more programs; the rule is tested as a pure function
on the GPU's candidates."""
import dataclasses
import itertools

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
CUDA = torch.device("cuda")  # (only the type reaches the rule)
TILES = rules.TileConfig(16, 16, 16, 4, 4, 1)
"""The interpreter's deterministic tiles (16x16, ``BLOCK_K`` 16)."""


def _ints(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


def _sliced(a, b, bias, out, slices, programs):
    """``SlicedTailGemm`` of ``a @ b`` on ``programs`` programs, run once."""
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [TILES.block_m, TILES.block_k])
    cfg = dataclasses.replace(TILES, tail_slices=slices)
    core = _core.SlicedTailGemm(a_desc, b, out, bias, m=a.shape[0], cfg=cfg, a_varies=True,
                                programs=programs)
    return core, core.run(a, b, out, bias)


@pytest.mark.parametrize("shape,programs,slices", [
    ((70, 48, 200), 4, 3),    # 15 tiles: 3 waves of 4 and 3 tiles in 3 slices (5, 5, 3 steps)
    ((33, 40, 328), 4, 8),    # ragged M, N and K: 9 tiles, 1 left, 21 steps in 7 slices of 3
    ((40, 16, 104), 2, 2),    # one tile column: 3 tiles, 1 left
])
def test_sliced_tail_is_exact_for_integer_inputs(shape, programs, slices):
    """Integer-valued inputs (every partial sum exact in fp32): the whole waves unsplit plus the
    last wave's slices give the reference bitwise, with bias, both B layouts, fp16 and fp32
    inputs and an fp32 out of fp16 inputs; the tail really runs the left tiles in slices."""
    m, n, k = shape
    tiles = -(-m // 16) * -(-n // 16)
    for dtype, kn, with_bias in itertools.product((torch.float32, torch.float16), (True, False),
                                                  (False, True)):
        a = _ints(m, k, dtype=dtype)
        b = _ints(k, n, dtype=dtype, seed=1) if kn else _ints(n, k, dtype=dtype, seed=1).t()
        bias = _ints(n, dtype=dtype, seed=2) if with_bias else None
        want = a.float() @ b.float() + (bias.float() if with_bias else 0)
        for out in (torch.full((m, n), float("nan"), dtype=dtype),
                    torch.full((m, n), float("nan"))):
            core, got = _sliced(a, b, bias, out, slices, programs)
            assert core.tail is not None and core.tail.slices == rules.slices(k, 16, slices)[0]
            assert core.cfg.tail_slices == slices and not core.cfg.split_tail
            assert core.tail.parts.shape[0] == core.tail.slices * (tiles % programs) * 16
            assert torch.equal(got.float(), want), (dtype, kn, with_bias, out.dtype)


def test_the_unsplit_launch_leaves_the_tail_to_the_slices():
    """Run alone, the unsplit launch writes the whole waves' tiles and none of the left ones
    (still NaN: only the split launches write them), the left ones being the last in the
    grouped tile order."""
    m, n, k, programs = 70, 48, 200, 4  # 15 tiles: 12 in three waves, 3 left
    a, b = _ints(m, k), _ints(k, n, seed=1)
    out = torch.full((m, n), float("nan"))
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [16, 16])
    core = _core.SlicedTailGemm(a_desc, b, out, None, m=m, cfg=dataclasses.replace(
        TILES, tail_slices=3), a_varies=True, programs=programs)
    core.main.run(a, b, out, None)
    tiles_m, tiles_n = -(-m // 16), -(-n // 16)
    left = set()
    for t in range(tiles_m * tiles_n - 3, tiles_m * tiles_n):  # (_tile_coords, GROUP_M = 4)
        first_m = (t // (4 * tiles_n)) * 4
        size_m = min(tiles_m - first_m, 4)
        left.add((first_m + (t % (4 * tiles_n)) % size_m, (t % (4 * tiles_n)) // size_m))
    want = a @ b
    for pm, pn in itertools.product(range(tiles_m), range(tiles_n)):
        block = out[pm * 16:(pm + 1) * 16, pn * 16:(pn + 1) * 16]
        if (pm, pn) in left:
            assert block.isnan().all(), (pm, pn)
        else:
            assert torch.equal(block, want[pm * 16:(pm + 1) * 16, pn * 16:(pn + 1) * 16])
    core.tail.run(a, b, out, None)
    assert torch.equal(out, want)


def test_deterministic_mode_refuses_a_sliced_tail():
    """A sliced configuration asked for in deterministic mode raises (its last wave's rows
    would take another K order), as a forced ``split_k`` does."""
    a, b = _ints(70, 200), _ints(200, 48, seed=1)
    with pytest.raises(ValueError, match="tail_slices=3 in deterministic mode"):
        matmul(a, b, cfg=dataclasses.replace(TILES, tail_slices=3), deterministic=True)


def test_whole_waves_or_one_step_run_unsplit():
    """Tiles that fill whole waves (or less than one), or a K of one step, leave no tail: the
    unsplit launch alone runs every tile; ``matmul`` with a sliced configuration in the
    interpreter (one program) is such a plan and still exact."""
    a, b = _ints(64, 64), _ints(64, 32, seed=1)  # 8 tiles
    for programs in (2, 4, 8, 16):  # (whole waves, or under one)
        core, got = _sliced(a, b, None, torch.empty(64, 32), 4, programs)
        assert core.tail is None and core.cfg.tail_slices == 0 and torch.equal(got, a @ b)
    one_step = _ints(48, 16)
    core, got = _sliced(one_step, _ints(16, 32, seed=1), None, torch.empty(48, 32), 4, 4)
    assert core.tail is None and torch.equal(got, one_step @ _ints(16, 32, seed=1))
    cfg = dataclasses.replace(TILES, tail_slices=3)
    a, b = _ints(70, 200), _ints(200, 48, seed=1)
    assert torch.equal(matmul(a, b, cfg=cfg, deterministic=False), a @ b)
    plan = next(reversed(_core._MATMUL_PLANS.cache._plans.values()))
    assert isinstance(plan.core, _core.SlicedTailGemm) and plan.core.tail is None


def test_rule_on_the_sweep_shapes_it_should_shorten():
    """On an H200's 132 SMs: 10520x2048x15936 (664 tiles: five waves and 4 tiles, 249 K steps)
    runs its last 4 tiles in 8 slices of 32 steps, one short wave instead of a half-tile one;
    6520x384x11520 and 1480x1792x10432 run 128x128 tiles (153 and 168: one wave and 21 or 36
    left) with those in 6 and 3 slices (measured 0.833x and 0.818x cuBLAS against 0.616x and
    0.672x for the 128x256 tiles, ``bench gemm_sweep --only tail``); shapes that fill whole
    waves, run under one or take a split K are left alone, and so is a tail of the unsplit
    choice's own tiles that only its whole-wave efficiency would pay for (14352x784x12352)."""
    def rule(m, n, k, p=132, det=False, out_bytes=2):
        return rules.select_split(m, n, k, p, CUDA, deterministic=det, out_bytes=out_bytes)

    cand, s = rule(10520, 2048, 15936)
    assert (cand.name, s) == ("128x256x64/s4/kt8", 1)
    assert cand.cfg == dataclasses.replace(rules.SLICED_TAIL_MAIN.cfg, tail_slices=8)
    for det, out_bytes in ((True, 2), (False, 4)):  # batch invariance; the 2-byte C's stages
        assert rule(10520, 2048, 15936, det=det, out_bytes=out_bytes)[0].cfg.tail_slices == 0
    assert rule(8448, 4224, 8192)[0].cfg.tail_slices == 0  # 66 x 17 = 1122 = 8.5 waves: halves
    assert rule(8448, 4096, 8192)[0].cfg.tail_slices == 0  # 1056 tiles: 8 whole waves
    assert rule(800, 768, 10760)[1] > 1  # under one wave of every candidate: split-K's case
    # 128x128 tails only with A's rows on 128-byte lines (K % 64 == 0: measured 1.27x faster
    # than 128x256 at K = 12352, 0.78x at K = 12360)
    assert rule(2384, 1152, 12352)[0].name == "128x128x64/s5/w4/kt3"
    assert rule(2384, 1152, 12360)[0].cfg.block_n == 256
    assert rule(14352, 784, 12352)[0].cfg.tail_slices == 0  # 791 128x128 tiles, 5 waves + 131
    for shape, name in (((6520, 384, 11520), "128x128x64/s5/w4/kt6"),
                        ((1480, 1792, 10432), "128x128x64/s5/w4/kt3")):
        cand, s = rule(*shape)
        assert (cand.name, s) == (name, 1), shape
        assert cand.cfg == dataclasses.replace(rules.GPU_CANDIDATES[1].cfg,
                                               tail_slices=int(name[-1]))


def test_rule_properties():
    """Wherever the rule slices a tail: default mode, one of ``select``'s candidates' tiles
    (128x256 as ``SLICED_TAIL_MAIN``), one whole wave of them or more and a partial one, 2 to
    ``MAX_SPLIT`` slices of at least ``MIN_SLICE_STEPS`` steps, the half-tile tail off; never
    in deterministic mode."""
    sliced, kinds = 0, set()
    for m, n, k, p in itertools.product((1024, 2176, 4232, 8192, 14232), (512, 1280, 2048, 7976),
                                        (1024, 4096, 10392), (66, 114, 132)):
        cand, s = rules.select_split(m, n, k, p, CUDA, deterministic=False)
        assert rules.select_split(m, n, k, p, CUDA, deterministic=True)[0].cfg.tail_slices == 0
        if not cand.cfg.tail_slices:
            continue
        sliced += 1
        cfg = cand.cfg
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        used, steps = rules.slices(k, 64, cfg.tail_slices)
        assert s == 1 and tiles >= p and tiles % p, (m, n, k, p)
        assert 2 <= cfg.tail_slices == used <= rules.MAX_SPLIT and steps >= rules.MIN_SLICE_STEPS
        bases = [c.cfg for c in rules.GPU_CANDIDATES[1:]] + [rules.SLICED_TAIL_MAIN.cfg]
        assert dataclasses.replace(cfg, tail_slices=0) in bases, cfg
        kinds.add(cfg.block_n)
    assert sliced > 10 and kinds == {128, 256}
