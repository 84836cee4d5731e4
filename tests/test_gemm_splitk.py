"""CPU tier: split-K in the default mode's plain ``matmul`` (``_core.SplitKGemm``, the rule
``_core_configs.select_split``). In the interpreter (one program) the rule never splits, so the
kernels run with ``split_k`` forced; the rule is tested as a pure function on the GPU's
candidates. Deterministic mode and the fused ops never split."""
import importlib.util
import itertools
import os
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.bench.gemm_sweep import _model_shapes, sweep_shapes
from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, matmul_split
from ditron_ops.runtime.launcher import BoundKernel

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # only the type reaches the rule
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan():
    """The plan of this thread's last ``matmul`` call (the cache's most recent entry)."""
    return next(reversed(_core._MATMUL_PLANS.cache._plans.values()))


def _ints(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


def _operand(kind: str, k: int, n: int, dtype) -> torch.Tensor:
    """``b [k, n]``: ``kn`` row-major, ``nk`` a Linear weight's ``w.t()``, ``padded`` neither
    (row pitch of n + 1 elements: no descriptor reads it; the plan copies it)."""
    if kind == "kn":
        return _ints(k, n, dtype=dtype, seed=1)
    if kind == "nk":
        return _ints(n, k, dtype=dtype, seed=1).t()
    return _ints(k, n + 1, dtype=dtype, seed=1)[:, :n]


SHAPES = [(40, 24, 100), (33, 50, 327), (17, 16, 64), (70, 48, 96)]
"""M and N off the interpreter's tiles (16 or 32 rows, 16 columns), K off its BLOCK_K (16)."""


SPLITS = [(SHAPES[0], 3), (SHAPES[0], 8), (SHAPES[1], 2), (SHAPES[1], 8), (SHAPES[2], 3),
          (SHAPES[3], 2), (SHAPES[3], 8)]
"""(shape, split_k): a short last slice (K = 100 by 3: 3 + 3 + 1 steps; K = 327 by 2, a partial
last BLOCK_K too), even slices (96 by 2), fewer slices than asked (327 by 8: 7 of 3 steps; 64 by
3: 2) and one-step slices (100 and 96 by 8), every shape and every split at least once (each of
their 12 pairs takes one of these paths; the interpreter is slow)."""


@pytest.mark.parametrize("shape,split", SPLITS, ids=[f"{'x'.join(map(str, s))}-{k}" for s, k in SPLITS])
def test_split_is_exact_for_integer_inputs(shape, split):
    """Integer-valued inputs (every product and partial sum exact in fp32): the split result
    equals the unsplit one and the reference bitwise, with bias, both B layouts, fp16 and fp32
    inputs; the plan really splits (into fewer slices when K has fewer steps)."""
    m, n, k = shape
    for dtype, kind, with_bias in itertools.product((torch.float32, torch.float16),
                                                    ("kn", "nk"), (False, True)):
        a, b = _ints(m, k, dtype=dtype), _operand(kind, k, n, dtype)
        bias = _ints(n, dtype=dtype, seed=2) if with_bias else None
        got = matmul(a, b, bias=bias, split_k=split, deterministic=False)
        used, steps = rules.slices(k, _plan().core.cfg.block_k, split)
        assert _plan().split == used > 1 and isinstance(_plan().core, _core.SplitKGemm)
        assert used == split or (used - 1) * steps < -(-k // 16) <= used * steps
        want = a.float() @ b.float() + (bias.float() if with_bias else 0)
        assert got.dtype == dtype and torch.equal(got.float(), want), (dtype, kind, with_bias)
        assert torch.equal(got, matmul(a, b, bias=bias, split_k=1, deterministic=False))


def test_split_with_unaligned_operands_and_strided_out():
    """``a`` and ``b`` that no descriptor reads (padded copies the plan owns, refreshed per call),
    a column-major ``out`` and an fp32 ``out`` of fp16 inputs: still exact; a second call with
    new values at the same addresses gives the new product."""
    m, n, k = 37, 24, 150
    a_buf, b = _ints(m, k + 1, seed=3), _operand("padded", k, n, torch.float32)
    a = a_buf[:, :k]
    out = torch.empty(n, m).t()
    got = matmul(a, b, out=out, split_k=4, deterministic=False)
    assert got is out and _plan().split == 4 and _plan().a_pad is not None
    assert torch.equal(out, a @ b)
    a_buf.mul_(-1)
    b.add_(1)
    assert torch.equal(matmul(a, b, out=out, split_k=4, deterministic=False), a @ b)
    a16, b16 = _ints(m, k, dtype=torch.float16), _operand("nk", k, n, torch.float16)
    f32 = torch.empty(m, n)
    assert torch.equal(matmul(a16, b16, out=f32, split_k=3, deterministic=False),
                       a16.float() @ b16.float())


@pytest.mark.parametrize("split", [2, 5])
def test_split_close_to_the_reference_for_normal_inputs(split):
    """fp32 normals: the split result is the fp32 product up to rounding (only the order of
    the sum changed), and the same bits call after call."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(45, 300, generator=gen), torch.randn(300, 40, generator=gen)
    bias = torch.randn(40, generator=gen)
    want = (a.double() @ b.double() + bias.double()).float()
    got = matmul(a, b, bias=bias, split_k=split, deterministic=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, matmul(a, b, bias=bias, deterministic=False),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(got.clone(), matmul(a, b, bias=bias, split_k=split, deterministic=False))


def test_one_slice_is_the_unsplit_path():
    """``split_k=1``, and the rule in the interpreter (one program: never under a wave), build
    the unsplit ``CoreGemm`` exactly as before split-K existed; a K of one step cannot split."""
    a, b = _ints(40, 100), _operand("nk", 100, 24, torch.float32)
    plain = matmul(a, b, deterministic=False)
    assert _plan().split == 1 and isinstance(_plan().core, _core.CoreGemm)
    assert torch.equal(matmul(a, b, split_k=1, deterministic=False), plain)
    assert _plan().split == 1 and isinstance(_plan().core, _core.CoreGemm)
    assert matmul_split(a, b, deterministic=False) == 1
    one_step = _ints(16, 16)
    matmul(one_step, one_step, split_k=4, deterministic=False)
    assert _plan().split == 1
    for m, n, k in itertools.product((1, 17, 64, 1000), (16, 100, 4096), (16, 1000, 16384)):
        assert rules.select_split(m, n, k, 1, CPU, deterministic=False)[1] == 1


SIZES = (1, 17, 64, 128, 200, 800, 1392, 4808, 8192)
NS = (256, 272, 768, 2304, 4096, 8960)
KS = (64, 512, 1000, 7872, 10760, 16384)
BUDGETS = (1, 33, 66, 132)


def test_deterministic_mode_never_splits():
    """The rule: deterministic mode gets ``select``'s tiles (the skinny ones at small M on the
    GPU, ``narrow``'s weighed too; the two-program tiles where ``short_k`` says) unsplit on
    every shape and budget, forced or not; ``matmul`` refuses a forced split there (argument
    or context)."""
    for device, (m, n, k, p) in itertools.product(
            (CUDA, CPU), itertools.product(SIZES, NS, KS, BUDGETS)):
        want = rules.skinny(m, device) or rules.select(m, n, p, device, deterministic=True,
                                                        extra=rules.narrow(m, device, True))
        short = (rules.SHORT_K_CANDIDATE if rules.short_k(want, m, n, k, p, device, 2, k % 64 == 0)
                 else want)
        assert rules.select_split(m, n, k, p, device, deterministic=True) == (short, 1)
        assert rules.select_split(m, n, k, p, device, deterministic=True, split=8) == (want, 1)
        assert rules.split_options(m, n, k, p, device, deterministic=True) == []
    a, b = _ints(40, 100), _ints(100, 24)
    with pytest.raises(ValueError, match="deterministic"):
        matmul(a, b, split_k=2, deterministic=True)
    with ditron_ops.deterministic(), pytest.raises(ValueError, match="deterministic"):
        matmul(a, b, split_k=2)
    with ditron_ops.deterministic():
        matmul(a, b, out=torch.empty(40, 24))
        assert _plan().split == 1
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="split_k"):
            matmul(a, b, split_k=bad)


def test_rule_properties_on_the_gpu_candidates():
    """Default mode on the GPU's candidates: an unsplit choice is ``select``'s with ``wide``'s
    tiles (the two-program tiles where ``short_k`` says, its last wave in K slices where
    ``sliced_tail`` says), the skinny tiles' at M <= 32; a
    split only for tiles under one wave, 2 to ``MAX_SPLIT`` slices of at least
    ``MIN_SLICE_STEPS`` steps, when the model predicts it faster; the same answer every time."""
    splits = 0
    for m, n, k, p in itertools.product(SIZES, NS, KS, BUDGETS):
        first = rules.skinny(m, CUDA) or rules.select(m, n, p, CUDA, deterministic=False)
        cand, s = rules.select_split(m, n, k, p, CUDA, deterministic=False)
        assert (cand, s) == rules.select_split(m, n, k, p, CUDA, deterministic=False)
        short = rules.short_k(first, m, n, k, p, CUDA, 2, k % 64 == 0)
        first = rules.skinny(m, CUDA) or rules.select(  # (the wide tiles weighed too)
            m, n, p, CUDA, deterministic=False, extra=rules.wide(m, CUDA, False, 2))
        if s == 1:  # (a sliced tail's tiles and slices: test_gemm_sliced_tail.py)
            if cand.cfg.tail_slices:
                assert not short and cand.cfg.tail_slices >= 2, (m, n, k, p)
                continue
            assert cand == (rules.SHORT_K_CANDIDATE if short else first), (m, n, k, p)
            continue
        splits += 1
        tiles = -(-m // cand.cfg.block_m) * -(-n // cand.cfg.block_n)
        used, steps = rules.slices(k, cand.cfg.block_k, s)
        assert tiles < p and 2 <= s <= rules.MAX_SPLIT and used == s, (m, n, k, p, s)
        assert steps >= rules.MIN_SLICE_STEPS
        assert (rules.split_time_us(cand, m, n, k, p, s)
                < rules.SPLIT_MARGIN * rules.split_time_us(first, m, n, k, p, 1))
        assert cand in rules.candidates(CUDA, False)
    assert splits > 20


def test_rule_choices_with_the_probe_fitted_constants():
    """On an H200's 132 SMs, with the split-K constants fitted to ``benchmarks/probes/splitk_probe.py``'s
    forced splits (the reduce with every slice's load at once) and ``SPLIT_MARGIN``: the sweep
    splits exactly its five few-tile shapes whose measured splits beat their unsplit tiles in
    that run (1392x704x15808 0.90x cuBLAS against 0.78x, 712x896x9288 0.86 against 0.84, ...);
    not the shapes whose splits lost there (200x4736x4504, 1480x1792x10432, 1496x768x7320,
    3616x256x7872), the registered model shapes at M = 8192 or short K; a few tiles over a long K
    still split."""
    def rule(m, n, k, p=132):
        cand, s = rules.select_split(m, n, k, p, CUDA, deterministic=False)
        return cand.name, s

    for shape in ((200, 4736, 4504), (1480, 1792, 10432), (1496, 768, 7320), (3616, 256, 7872)):
        assert rule(*shape)[1] == 1, shape
    for m, n, k in _model_shapes():
        assert rule(m, n, k)[1] == 1, (m, n, k)
    assert rule(800, 768, 512)[1] == 1  # 8 K steps: the reduce costs more than it saves
    assert {s: rule(*s)[1] for s in sweep_shapes() if rule(*s)[1] > 1} == {
        (1392, 704, 15808): 4, (800, 768, 10760): 3, (1960, 368, 11264): 4, (712, 896, 9288): 3,
        (1112, 960, 8640): 3}
    assert rule(256, 512, 65536)[1] >= 4  # 16 tiles of 64x128 under 132 programs, 1024 K steps
    assert rule(512, 512, 32768)[1] > 1 and rule(1024, 1024, 32768)[1] > 1
    assert rule(4096, 4096, 32768)[1] == 1  # 512 tiles of 128x256: 3.9 waves


def test_a_repeated_split_call_builds_and_binds_nothing(monkeypatch):
    """A split plan binds its two kernels once (at its build); identical calls after that
    select, build and bind nothing, with the outputs' addresses alternating or not."""
    counts = {"bind": 0, "select": 0}
    init, select = BoundKernel.__init__, rules.select
    lock = threading.Lock()

    def counting_init(obj, *args, **kwargs):
        with lock:
            counts["bind"] += 1
        init(obj, *args, **kwargs)

    def counting_select(*args, **kwargs):
        counts["select"] += 1
        return select(*args, **kwargs)

    monkeypatch.setattr(BoundKernel, "__init__", counting_init)
    monkeypatch.setattr(rules, "select", counting_select)
    a, b, bias = _ints(43, 100), _operand("nk", 100, 24, torch.float32), _ints(24, seed=5)
    calls = [lambda: matmul(a, b, bias=bias, split_k=3, deterministic=False),
             lambda: matmul(a, b, split_k=3, deterministic=False),
             lambda: matmul(a, b, out=torch.empty(43, 24), split_k=2, deterministic=False)]
    for call in calls * 2:
        call()
    cache = _core._MATMUL_PLANS.cache
    before = (cache.builds, counts["bind"], counts["select"])
    assert before[1:] == (6, 3), before  # three new plans (43 rows: shapes no other test uses)
    for call in calls * 3:
        call()
    assert (cache.builds, counts["bind"], counts["select"]) == before


def test_fused_ops_never_split(monkeypatch):
    """ag_gemm's consumer and gemm_rs / gemm_ar fused (both modes) and the deterministic
    partial GEMM do not reach the split rule or kernels (their K order and waits unchanged)."""
    def refuse(*args, **kwargs):
        raise AssertionError("split-K reached from a fused or deterministic path")

    monkeypatch.setattr(rules, "select_split", refuse)
    monkeypatch.setattr(_core, "select_split", refuse)
    monkeypatch.setattr(_core, "SplitKGemm", refuse)

    def body(group):
        gen = torch.Generator().manual_seed(group.rank)
        a, b = torch.randn(40, 160, generator=gen), torch.randn(160, 24, generator=gen)
        ditron_ops.ag_gemm(a, b, group, impl="fused")
        for det in (False, True):
            ditron_ops.gemm_rs(a, b, group, impl="fused", deterministic=det)
            for algorithm in ("one_shot", "two_shot"):
                ditron_ops.gemm_ar(a, b, group, impl="fused", deterministic=det,
                                   algorithm=algorithm)
        matmul(a, b, out=torch.empty(40, 24), cfg=rules.INTERPRETER_CANDIDATES[1].cfg,
               deterministic=True)
        return True

    assert ditron_ops.launch(body, 2) == [True, True]


def test_bench_splitk_quick_writes_rows(tmp_path):
    """``bench gemm_sweep --only splitk`` (interpreter plumbing): every forced S row with its
    slices, the model's time, the rule's mark and a small error."""
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["gemm_sweep", "--quick", "--only", "splitk", "--rounds", "1",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("gemm_sweep-*.csv")))))
    assert {r["case"] for r in rows} == {"splitk fp16"}
    assert {int(r["split_k"]) for r in rows} == {1, 2, 3, 4}
    assert all(float(r["rel_err"]) < 1e-2 and float(r["pred_us"]) > 0 for r in rows)
    assert sum(int(r["rule"]) for r in rows) == 2  # one choice per shape


def _fit_tool():
    spec = importlib.util.spec_from_file_location(
        "gemm_rule_fit", os.path.join(ROOT, "tools", "gemm_rule_fit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fit_tool_recovers_the_split_constants(monkeypatch):
    """``tools/gemm_rule_fit.py --splitk``'s fit on rows made by the model itself with other
    constants gives those constants back (what one calibration run feeds it)."""
    tool = _fit_tool()
    truth = {"step": 0.6, "split_step": 0.81, "bw": 2.4, "launch": 5.5}
    for key, attr in tool.SPLIT_CONSTANTS.items():
        monkeypatch.setattr(rules, attr, truth[key] * (1e12 if key == "bw" else 1))
    rows = []
    for m, n, k in sweep_shapes():
        for c, s in [(rules.select(m, n, 132, CUDA, deterministic=False), 1)] + [
                (c, rules.slices(k, 64, s)[0]) for c in rules.GPU_CANDIDATES
                for s in (2, 4, 8) if -(-m // c.cfg.block_m) * -(-n // c.cfg.block_n) < 132]:
            rows.append(dict(m=m, n=n, k=k, config=c.name, split_k=s,
                             time_us=rules.split_time_us(c, m, n, k, 132, s)))
    got = tool.fit_splitk(rows)
    for key, want in truth.items():
        assert abs(got[key] - want) < 1e-3 * want, (key, got[key], want)


def test_fit_tool_fits_the_split_constants_to_sweep_rows(monkeypatch, tmp_path):
    """``tools/gemm_rule_fit.py --split-sweep``: from a sweep CSV whose split rows the model made
    with other partial-traffic and fixed costs, the fit gives those back, and each split run is
    paired with the same tiles unsplit from the configs data (scaled to its run's cuBLAS)."""
    import csv

    tool = _fit_tool()
    truth = {"bw": 1.7, "launch": 7.0}
    monkeypatch.setattr(rules, "PARTIAL_BYTES_PER_S", truth["bw"] * 1e12)
    monkeypatch.setattr(rules, "SPLIT_LAUNCH_US", truth["launch"])
    path = tmp_path / "gemm_sweep-bf16-cuda.csv"
    fields = ["case", "m", "n", "k", "time_us", "baseline_us", "ratio", "config", "split_k"]
    configs = {}
    with open(path, "w", newline="") as fh:
        out = csv.DictWriter(fh, fields)
        out.writeheader()
        for m, n, k in sweep_shapes():
            for c in rules.GPU_CANDIDATES[:2]:
                if -(-m // c.cfg.block_m) * -(-n // c.cfg.block_n) >= 132:
                    continue
                s = rules.slices(k, 64, 3)[0]
                t = rules.split_time_us(c, m, n, k, 132, s)
                out.writerow(dict(case="sweep bf16", m=m, n=n, k=k, time_us=t, baseline_us=20.0,
                                  ratio=20.0 / t, config=c.name, split_k=s))
                configs.setdefault((m, n, k), (10.0, {}))[1][c.name] = 30.0
    points = tool.sweep_split_points(str(path), configs)
    assert len(points) > 10 and all(p["same_us"] == 60.0 for p in points)
    got = tool.fit_split_sweep(points)
    for key, want in truth.items():
        assert abs(got[key] - want) < 1e-3 * want, (key, got[key], want)
