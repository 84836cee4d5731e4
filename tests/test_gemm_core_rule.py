"""CPU tier: the GEMM core's tile rule (``gemm._core_configs.select_config``) as a pure function
of inputs every rank agrees on; its use by every op's plan (selected once, while the plan is
built); and deterministic mode's batch invariance while the interpreter's tiling changes with M."""
import dataclasses
import inspect
import itertools
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.bench.gemm_rs import _shapes as rs_shapes
from ditron_ops.bench.gemm_sweep import _model_shapes
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul
from ditron_ops.runtime.launcher import BoundKernel
from ditron_ops.runtime.split import split_sizes
from ditron_ops.testing.gemm_rs_checks import gemm_rs_inputs, order_exact

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # only the type reaches the rule
MS = (1, 3, 17, 64, 255, 1000, 8192)
"""The M of the batch-invariance tests (the CPU ones stop at 1000: the interpreter's cost is
per block)."""
SIZES = (1, 2, 3, 16, 17, 63, 64, 65, 127, 128, 129, 168, 255, 256, 384, 1000, 1024, 4095, 8192,
         16384)
BUDGETS = (1, 16, 33, 44, 66, 132)  # an H200's SMs, and its share for W = 2, 3, 4, 8 virtual ranks


def test_rule_is_a_pure_function_of_agreed_inputs():
    """No K, rank or dtype among its inputs (gemm_rs ranks may hold different K_r); always one
    of the configurations ``precompile`` compiles; the same answer every time."""
    assert list(inspect.signature(rules.select_config).parameters) == [
        "m", "n", "programs", "device", "deterministic"]
    for device, det in itertools.product((CUDA, CPU), (False, True)):
        allowed = rules.rule_configs(device)
        for m, n, p in itertools.product(SIZES, SIZES, BUDGETS):
            cfg = rules.select_config(m, n, p, device, deterministic=det)
            assert cfg in allowed, (device, det, m, n, p, cfg)
            assert cfg == rules.select_config(m, n, p, device, deterministic=det)


def test_deterministic_choices_keep_the_k_order():
    """Deterministic mode's candidates share one BLOCK_K (64 on the GPU) and were measured
    batch invariant; its choices come from them only."""
    for device in (CUDA, CPU):
        det = rules.candidates(device, True)
        assert det and all(c.deterministic for c in det)
        assert len({c.cfg.block_k for c in det}) == 1
        for m, n, p in itertools.product(SIZES, SIZES, BUDGETS):
            assert rules.select_config(m, n, p, device, deterministic=True) in {c.cfg for c in det}
    assert {c.cfg.block_k for c in rules.GPU_CANDIDATES} == {64}  # any choice keeps the K order
    assert "128x128x64/s5/w4" not in {c.name for c in rules.candidates(CUDA, True)}


def test_gpu_choices_follow_the_model():
    """On an H200's 132 SMs: the tuned large tiles for every registered model shape at M = 8192
    (the P1 shapes stay on the configuration measured there), 64-row tiles at M <= 128, and the
    measured wins of the sweep data (benchmarks/NOTES.md, GEMM core)."""
    def pick(m, n, det=False):
        return rules.select(m, n, 132, CUDA, deterministic=det).name

    for m, n, _ in _model_shapes():
        assert pick(m, n) == pick(m, n, True) == rules.GPU_CONFIG, (m, n)
    for (_, n), m in itertools.product(rs_shapes(False), (8192, 1024)):
        assert pick(m, n, True) == rules.GPU_CONFIG, (m, n)
    for m, n in itertools.product((1, 16, 64, 128), (4096, 8192, 12288, 16384)):
        assert rules.select_config(m, n, 132, CUDA, deterministic=True).block_m == 64
    assert pick(14040, 384) == "128x128x64/s5/w4" and pick(14040, 384, True) == rules.GPU_CONFIG
    assert pick(168, 8960) == "64x256x64/s4"
    assert rules.waves(448, 132, rules.GPU_CONFIGS[rules.GPU_CONFIG]) == (3, True)  # 3.5 waves


def test_plain_matmul_takes_the_skinny_tiles_at_small_m():
    """``select_split`` (the plain ``matmul``): on the GPU, either mode, the 16-row skinny
    tiles up to M = 16, the 32-row ones up to 32, unsplit (a forced split keeps the 64-row
    candidates); above 32 rows, and in the interpreter, ``select``'s tiles. ``select_config``
    (the fused ops) never returns them: their kernels are not swapped."""
    skinny = {c.cfg for c in rules.SKINNY_CANDIDATES}
    assert all(c.deterministic and c.cfg.swap_ab and c.cfg.block_k == 64
               for c in rules.SKINNY_CANDIDATES)
    for m, n, k, p, det in itertools.product(SIZES, (64, 4096, 16384), (64, 1376, 65536),
                                             BUDGETS, (False, True)):
        cand, split = rules.select_split(m, n, k, p, CUDA, deterministic=det)
        if m <= 16:
            assert (cand.name, split) == ("sw16x64x64/s8", 1), (m, n, k, p, det)
        elif m <= 32:
            assert (cand.name, split) == ("sw32x64x64/s10", 1), (m, n, k, p, det)
        else:
            assert cand.cfg not in skinny, (m, n, k, p, det)
        assert rules.select_config(m, n, p, CUDA, deterministic=det) not in skinny
        assert rules.select_split(m, n, k, p, CPU, deterministic=det)[0].cfg not in skinny
    forced = rules.select_split(1, 4096, 65536, 132, CUDA, deterministic=False, split=4)
    assert forced[0].cfg.block_m == 64 and forced[1] == 4


FORCED_BEST = {(64, 4096): "64x64x64/s6", (64, 8192): "64x64x64/s6",
               (64, 12288): "64x128x64/s6", (64, 16384): "64x128x64/s6",
               (128, 4096): "64x64x64/s6", (128, 8192): "64x128x64/s6",
               (128, 12288): "64x256x64/s4", (128, 16384): "64x256x64/s4"}
"""The fastest of 64x64/s6, 64x128/s6 and 64x256/s4 per (M, N) in the forced runs of the
batch-invariant GEMM (H200, 132 SMs, ``benchmarks/probes/invariant_configs-bf16-cuda.csv``)."""


def test_plain_deterministic_matmul_weighs_the_narrow_tiles():
    """``select_split`` in deterministic mode on the GPU weighs ``narrow``'s 64x64 tiles at
    32 < M <= 128 and picks, on the forced runs' shapes, the tiles those runs measured fastest;
    never in default mode, above ``NARROW_MAX_M``, in the interpreter or for the fused ops
    (``select_config``)."""
    assert all(c.deterministic and not c.cfg.swap_ab and c.cfg.block_k == 64
               for c in rules.NARROW_CANDIDATES)
    for (m, n), want in FORCED_BEST.items():
        for k in (1376, 3584, 6656):
            assert rules.select_split(m, n, k, 132, CUDA, deterministic=True) == (
                next(c for c in rules.candidates(CUDA, True) + rules.NARROW_CANDIDATES
                     if c.name == want), 1), (m, n, k)
    narrow = {c.cfg for c in rules.NARROW_CANDIDATES}
    picked = set()
    for m, n, p, det in itertools.product(SIZES, (256, 1000, 4096, 8192, 16384), BUDGETS,
                                          (False, True)):
        cfg = rules.select_split(m, n, 4096, p, CUDA, deterministic=det)[0].cfg
        if cfg in narrow:
            picked.add(m)
            assert det and 32 < m <= rules.NARROW_MAX_M, (m, n, p, det)
        assert rules.select_config(m, n, p, CUDA, deterministic=det) not in narrow
        assert rules.select_split(m, n, 4096, p, CPU, deterministic=det)[0].cfg not in narrow
    assert picked == {m for m in SIZES if 32 < m <= rules.NARROW_MAX_M}, picked


SHORT_K_MEASURED = {(2840, 5376, 576): True, (5408, 3936, 768): True, (15912, 8904, 1152): True,
                    (5176, 7032, 1472): True, (5128, 1792, 1408): True, (2912, 3072, 1536): True,
                    (6640, 896, 704): False, (352, 15232, 832): False, (928, 4992, 952): False,
                    (536, 8584, 1056): False, (10568, 15488, 1880): False,
                    (3200, 6728, 2952): False}
"""Sweep shapes with K <= 3000 and whether two-program 128x128 tiles ran faster than the rule's
tiles there (H200, ``bench gemm_sweep --only occupancy``; the last two lost by 23-25%)."""


def test_plain_matmul_takes_two_programs_per_sm_at_short_k():
    """``select_split`` on 132 SMs takes ``SHORT_K_CANDIDATE`` exactly on the measured sweep
    shapes where it ran faster, in both modes (its rows are the 128x256 tiles'); never with a
    4-byte C or a forced ``split``, in the interpreter or for the fused ops
    (``select_config``); the tiles are the bench's."""
    from ditron_ops.bench.gemm_sweep import OCCUPANCY

    cand = rules.SHORT_K_CANDIDATE
    assert OCCUPANCY[cand.name] == cand.cfg and cand.cfg.ctas_per_sm == 2 and cand.deterministic
    for (m, n, k), faster in SHORT_K_MEASURED.items():
        for det in (False, True):
            assert (rules.select_split(m, n, k, 132, CUDA, deterministic=det)[0] is cand) == faster
            assert rules.select_split(m, n, k, 132, CUDA, deterministic=det, out_bytes=4)[0] is not cand
        assert rules.select_split(m, n, k, 132, CUDA, deterministic=False, split=1)[0] is not cand
    for m, n, p, det in itertools.product(SIZES, (256, 1000, 4096, 16384), BUDGETS, (False, True)):
        for k in (64, 1536, 1600, 8192):
            picked = rules.select_split(m, n, k, p, CUDA, deterministic=det)[0] is cand
            large = (rules.skinny(m, CUDA) is None and rules.select(
                m, n, p, CUDA, deterministic=det, extra=rules.narrow(m, CUDA, det)).cfg
                == rules.GPU_CONFIGS[rules.GPU_CONFIG])
            assert picked == (large and k <= 1536 and
                              -(-m // 128) * -(-n // 256) >= 2 * p), (m, n, k, p, det)
            assert rules.select_split(m, n, k, p, CPU, deterministic=det)[0] is not cand
        assert rules.select_config(m, n, p, CUDA, deterministic=det) != cand.cfg


def test_interpreter_tiling_changes_with_m():
    """The interpreter's rule varies the M side (16 or 32 rows) over the batch-invariance tests'
    M; deterministic mode keeps 16-row blocks there (numpy's matmul, the interpreter's
    ``tl.dot``, rounds differently per block height)."""
    rows = {m: rules.select_config(m, 16, 1, CPU, deterministic=False).block_m for m in MS}
    assert rows[1] == rows[3] == rows[17] == 16 and rows[64] == rows[8192] == 32, rows
    assert {rules.select_config(m, 16, 1, CPU, deterministic=True).block_m for m in MS} == {16}


class _Spy:
    """Counts ``select`` calls (the rule's one entry) and ``BoundKernel`` constructions."""

    def __init__(self, monkeypatch):
        self.selects, self.bindings, self.args = 0, 0, []
        select, init = rules.select, BoundKernel.__init__
        lock = threading.Lock()

        def counting_select(*args, **kwargs):
            chosen = select(*args, **kwargs)
            with lock:
                self.selects += 1
                self.args.append((threading.current_thread().name, args, kwargs, chosen))
            return chosen

        def counting_init(obj, *args, **kwargs):
            with lock:
                self.bindings += 1
            init(obj, *args, **kwargs)

        monkeypatch.setattr(rules, "select", counting_select)
        monkeypatch.setattr(BoundKernel, "__init__", counting_init)


def test_a_repeated_call_selects_and_binds_nothing(monkeypatch):
    """Every user of the rule (``matmul`` in both modes, ag_gemm's consumer, gemm_rs and
    gemm_ar fused in both modes, one- and two-shot): the first calls select while their plans
    are built; identical calls after that select nothing and bind (compile) nothing."""
    spy = _Spy(monkeypatch)

    def body(group):
        a, b = gemm_rs_inputs(group, 40, 24, 16, torch.float32)
        f32 = torch.empty(40, 24)
        ops = [lambda: matmul(a, b), lambda: matmul(a, b, out=f32, deterministic=True),
               lambda: ditron_ops.ag_gemm(a, b, group, impl="fused")]
        for det in (False, True):
            ops += [lambda det=det: ditron_ops.gemm_rs(a, b, group, impl="fused", deterministic=det),
                    lambda det=det: ditron_ops.gemm_ar(a, b, group, impl="fused", deterministic=det,
                                                       algorithm="one_shot"),
                    lambda det=det: ditron_ops.gemm_ar(a, b, group, impl="fused", deterministic=det,
                                                       algorithm="two_shot")]
        for op in ops * 2:
            op()
        before = (spy.selects, spy.bindings)
        for op in ops * 3:
            op()
        return before, (spy.selects, spy.bindings)

    (before, after), = ditron_ops.launch(body, 1)
    assert before[0] >= 6 and before[1] > 0, before  # the builds selected and bound
    assert after == before, (before, after)


def test_gemm_rs_ranks_with_different_k_select_alike(monkeypatch):
    """gemm_rs / gemm_ar ranks exchange partial tiles: with a different K_r on every rank they
    still ask the rule the same question and get the same tiles, and the sums are exact."""
    spy = _Spy(monkeypatch)

    def body(group):
        k = (5, 16, 9)[group.rank]
        gen = torch.Generator().manual_seed(group.rank)
        a, b = torch.randn(70, k, generator=gen), torch.randn(k, 24, generator=gen)
        with ditron_ops.deterministic():
            rs, ar = ditron_ops.gemm_rs(a, b, group), ditron_ops.gemm_ar(a, b, group)
        want = order_exact(a, b, group)
        rows = split_sizes(70, group.world_size)
        start = sum(rows[:group.rank])
        assert torch.equal(rs, want[start:start + rows[group.rank]]) and torch.equal(ar, want)
        return sorted({plan.cfg for plan in group.plans._plans.values() if hasattr(plan, "cfg")},
                      key=repr)

    cfgs = ditron_ops.launch(body, 3)
    assert cfgs[0] and cfgs[0] == cfgs[1] == cfgs[2], cfgs
    questions = {}
    for thread, args, kwargs, _ in spy.args:
        questions.setdefault(thread, set()).add((args, tuple(sorted(kwargs.items()))))
    assert len(questions) == 3 and len({frozenset(q) for q in questions.values()}) == 1, questions


def _rows_across_m(group, exact: bool) -> bool:
    """The rows of every M of ``MS`` up to 1000 against the same rows of the M = 1000 calls,
    bitwise, in deterministic mode: ``matmul`` into fp32, gemm_ar one- and two-shot, gemm_rs."""
    ms = MS[:-1]
    a_full, b = gemm_rs_inputs(group, ms[-1], 16, 16, torch.float16, seed=11, exact=exact)
    with ditron_ops.deterministic():
        mm = matmul(a_full, b, out=torch.empty(ms[-1], 16))
        ar = ditron_ops.gemm_ar(a_full, b, group)
        for m in ms[:-1]:
            a = a_full[:m].clone()  # its own call, its own plan
            assert torch.equal(matmul(a, b, out=torch.empty(m, 16)), mm[:m]), m
            for algorithm in ("one_shot", "two_shot"):
                got = ditron_ops.gemm_ar(a, b, group, algorithm=algorithm)
                assert torch.equal(got, ar[:m]), (m, algorithm)
            rows = split_sizes(m, group.world_size)
            start = sum(rows[:group.rank])
            got = ditron_ops.gemm_rs(a, b, group)
            assert torch.equal(got, ar[start:start + rows[group.rank]]), m
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_bitwise_equal_across_m(world_size):
    """Deterministic mode, batch invariance: the same rows computed inside calls with M in
    {1, 3, 17, 64, 255, 1000} are bitwise equal (``matmul`` into fp32, gemm_rs, gemm_ar one- and
    two-shot), with normal inputs (the GPU tier adds 8192)."""
    assert ditron_ops.launch(_rows_across_m, world_size, args=(False,)) == [True] * world_size


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_bitwise_equal_while_the_tiling_changes(world_size, monkeypatch):
    """The same with both interpreter tilings allowed in deterministic mode, so the rule
    changes the M side between those M (16 and 32 rows) as the GPU's does: slots, boundary rows
    and split sizes at every tiling. Integer inputs (every product and sum exact in fp32), since
    numpy's rounding, unlike the GPU MMA's, depends on the block height."""
    monkeypatch.setattr(rules, "INTERPRETER_CANDIDATES", tuple(
        rules.dataclasses.replace(c, deterministic=True) for c in rules.INTERPRETER_CANDIDATES))
    spy = _Spy(monkeypatch)
    assert ditron_ops.launch(_rows_across_m, world_size, args=(True,)) == [True] * world_size
    chosen = {(args[0], cand.cfg.block_m) for _, args, _, cand in spy.args if args[0] in MS}
    assert {rows for _, rows in chosen} == {16, 32}, chosen


def test_the_sweep_bench_measures_every_candidate():
    """``bench gemm_sweep --only configs`` measures each GPU candidate under its own name, the
    data ``tools/gemm_rule_fit.py`` scores the rule on."""
    from ditron_ops.bench.gemm_sweep import CANDIDATES

    for c in rules.GPU_CANDIDATES:
        assert CANDIDATES.get(c.name) == c.cfg, c.name


def test_the_sweep_bench_can_measure_the_candidates_alone():
    """``--only configs,candidates`` times exactly the rule's candidates (the calibration run)."""
    from ditron_ops.bench.gemm_sweep import CANDIDATES, configs_measured

    assert configs_measured(("configs",)) == CANDIDATES
    assert configs_measured(("configs", "candidates")) == {c.name: c.cfg
                                                           for c in rules.GPU_CANDIDATES}


def test_fp8_tiles_narrow_where_measured_faster():
    """``scaled_config``: one K step per scale block and no split tail always; the narrow tile
    (128x128, 8 warps) for block scales, over the rule's 128x128 tile of 4 warps, and where
    wide tiles fill at most 3/4 of the programs (tensor/row scales, not in the deterministic
    mode); else wide."""
    from ditron_ops.gemm._core_configs import (SCALED_BLOCK_K, SCALED_NARROW, TileConfig,
                                               scaled_config)

    wide = TileConfig(128, 256, 64, 8, 8, 4, split_tail=True)
    narrow = dataclasses.replace(wide, block_k=SCALED_BLOCK_K, split_tail=False, **SCALED_NARROW)
    row, block = 1, 2
    # (no fp8 form keeps the split tail: it serializes their wgmma)
    assert scaled_config(wide, row, 10752, 5120, 132) == dataclasses.replace(
        wide, block_k=128, split_tail=False)
    assert scaled_config(wide, block, 10752, 5120, 132) == narrow
    assert scaled_config(wide, row, 753, 4096, 132) == narrow  # 96 tiles on 132 programs
    assert scaled_config(wide, row, 512, 8192, 132).block_n == 256  # 128 tiles: a full wave
    assert scaled_config(wide, row, 753, 4096, 132, deterministic=True).block_n == 256
    assert scaled_config(wide, block, 753, 4096, 132, deterministic=True) == narrow
    sq = TileConfig(128, 128, 64, 8, 4, 5)
    assert scaled_config(sq, row, 1 << 14, 1 << 14, 132) == dataclasses.replace(
        sq, block_k=128, num_warps=8)
    small = TileConfig(64, 128, 64, 8, 4, 6)  # (other rows: unmeasured, kept)
    assert scaled_config(small, block, 64, 128, 132) == dataclasses.replace(small, block_k=128)
