"""all_reduce_rmsnorm on a CPU virtual world (Triton interpreter): fp16/fp32 against the
plain-torch reference, the e4m3 encoder, batch invariance, torch integration, typed errors.

(bf16 is left to the GPU tier: the interpreter rounds fp32 -> bf16 differently from the GPU.)
"""
import os
import subprocess
import sys
import time

import pytest
import torch
import triton.language as tl

import ditron_ops
from ditron_ops import language as dl
from ditron_ops.collectives import _norm_kernels, _norm_launch
from ditron_ops.collectives._norm_launch import PURPOSE, block_config
from ditron_ops.reference import norm as norm_reference
from ditron_ops.testing.norm_checks import (back_to_back_schedule, check_against_reference,
                                            check_back_to_back, check_batch_invariance,
                                            check_forms_agree, norm_inputs)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


def _no_failures(results):
    fails = [f for per_rank in results for f in per_rank]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("rows,cols", [(5, 48), (2, 37)])  # (37: no 16-byte vectors; 2 < W)
def test_matches_reference(world_size, dtype, algorithm, rows, cols):
    _no_failures(ditron_ops.launch(check_against_reference, world_size,
                                   args=(rows, cols, dtype, algorithm)))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_five_ranks_sum_in_rank_order(algorithm):
    """W = 5: the peers' rows are loaded four at a time (``_norm_kernels._reduce_chunk``), so
    ranks 0-3 and then rank 4 (with three loads past W) still add in rank order."""
    _no_failures(ditron_ops.launch(check_against_reference, 5,
                                   args=(6, 48, torch.float32, algorithm)))


@pytest.mark.parametrize("quant", ["fp8_e4m3", "fp8_e4m3_128"])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_quant_matches_torch_quantization(quant, algorithm):
    _no_failures(ditron_ops.launch(check_against_reference, 3,
                                   args=(4, 384, torch.float16, algorithm, quant)))


@pytest.mark.parametrize("quant", [None, "fp8_e4m3", "fp8_e4m3_128"])
def test_rows_wider_than_one_block(quant):
    """H above ``MAX_BLOCK_H``: the chunked path (stored, then reread) with fp32 weights."""
    cols = 8320  # 65 groups of 128
    assert not block_config(cols)[1]
    _no_failures(ditron_ops.launch(check_against_reference, 2,
                                   args=(3, cols, torch.float32, "two_shot", quant, 1,
                                         torch.float32)))


@pytest.mark.parametrize("quant", [None, "fp8_e4m3_128"])
def test_one_shot_and_two_shot_agree_bitwise(quant):
    _no_failures(ditron_ops.launch(check_forms_agree, 3, args=(7, 256, torch.float16, quant)))


def test_batch_invariance_deterministic():
    """Row t of T=5 equals the row computed alone and in every prefix call, bitwise: two-shot
    (rows owned by different ranks) and one-shot."""
    _no_failures(ditron_ops.launch(check_batch_invariance, 2,
                                   args=(5, 160, torch.float16, "two_shot", "fp8_e4m3")))
    _no_failures(ditron_ops.launch(check_batch_invariance, 3,
                                   args=(5, 256, torch.float32, "one_shot", "fp8_e4m3_128",
                                         "two_shot")))


@dl.jit
def _encode_kernel(src, dst, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst + offs, _norm_kernels._e4m3_bits(tl.load(src + offs)))


def test_e4m3_encoder_matches_torch():
    """Every e4m3 value, every midpoint between neighbours (ties to even), just off the
    midpoints, subnormals, signed zeros: the bytes torch's conversion gives."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]),
                        torch.nextafter(mids, grid[:-1]), torch.tensor([0.0, -0.0]),
                        torch.randn(2000) * 50, torch.randn(1000) * 1e-3]).clamp(-448, 448)
    n = 1 << (values.numel() - 1).bit_length()
    values = torch.cat([values, torch.zeros(n - values.numel())])
    out = torch.empty(n, dtype=torch.uint8)
    _encode_kernel[(1,)](values, out, N=n)
    want = values.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out, want), values[out != want][:8]


def _repeated(group):
    """Back-to-back calls of changing shapes, forms and quant (epochs, double buffering, the
    workspace growing between plans): each equals the reference."""
    fails = []
    for i, (rows, algorithm, quant) in enumerate(
            [(3, "one_shot", None), (9, "two_shot", "fp8_e4m3"), (1, "two_shot", None),
             (9, "one_shot", "fp8_e4m3_128"), (40, "two_shot", None), (3, "one_shot", None)] * 2):
        fails += check_against_reference(group, rows, 128, torch.float32, algorithm, quant, seed=i)
    builds = group.plans.builds
    check_against_reference(group, 3, 128, torch.float32, "one_shot", None, seed=99)
    if group.plans.builds != builds:
        fails.append("a repeated call built a plan")
    return fails


def test_back_to_back_calls_of_varying_shapes():
    _no_failures(ditron_ops.launch(_repeated, 2))


def _empty_and_one_rank(group):
    x, res, w = norm_inputs(group, 0, 16, torch.float32)
    normed, res_out, codes, scales = ditron_ops.all_reduce_rmsnorm(x, res, w, quant="fp8_e4m3")
    return (tuple(normed.shape), tuple(res_out.shape), tuple(codes.shape), tuple(scales.shape))


def test_zero_tokens_and_one_rank():
    assert ditron_ops.launch(_empty_and_one_rank, 2) == [((0, 16), (0, 16), (0, 16), (0, 1))] * 2
    _no_failures(ditron_ops.launch(check_against_reference, 1, args=(3, 64, torch.float16)))


def _opcheck(group):
    x, res, w = norm_inputs(group, 3, 128, torch.float32)
    op = torch.ops.ditron.all_reduce_rmsnorm.default
    utils = (("test_schema", "test_autograd_registration", "test_faketensor",
              "test_aot_dispatch_dynamic") if group.world_size == 1
             else ("test_schema", "test_faketensor"))
    for algorithm, quant in (("one_shot", ""), ("two_shot", "fp8_e4m3"), ("one_shot", "fp8_e4m3_128")):
        torch.library.opcheck(op, (x, res, w, 1e-6, group.group_name, algorithm, quant, False),
                              test_utils=utils)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck(world_size):
    assert all(ditron_ops.launch(_opcheck, world_size))


def _step(x, res, w):
    normed, res_out, codes, scales = ditron_ops.all_reduce_rmsnorm(x * 2, res, w, quant="fp8_e4m3")
    return normed + 1, res_out, codes.float() * scales


def test_compile_fullgraph_with_context_group():
    """group=None inside a compiled function: one graph serves every rank (CONTEXT group)."""
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")

    def body(group):
        x, res, w = norm_inputs(group, 3, 128, torch.float32)
        got, want = compiled(x, res, w), _step(x, res, w)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert ditron_ops.launch(body, 2) == [True, True]


def _expect(group, fn, exc, words):
    with pytest.raises(exc) as info:
        fn()
    for word in words:
        assert word in str(info.value), str(info.value)
    assert PURPOSE not in group._workspaces  # nothing allocated or launched
    return True


def _bad_inputs(group):
    x, res, w = norm_inputs(group, 4, 256, torch.float32)
    op = ditron_ops.all_reduce_rmsnorm
    cases = [
        (lambda: op(x.double(), res, w), TypeError, ["all_reduce_rmsnorm", "x", "float64"]),
        (lambda: op(x.bfloat16(), res.bfloat16(), w), TypeError, ["x", "bfloat16"]),
        (lambda: op(x, res.half(), w), TypeError, ["residual", "float16"]),
        (lambda: op(x, res, w.to(torch.int32)), TypeError, ["weight", "int32"]),
        (lambda: op(x[0], res[0], w), ValueError, ["x", "dimension"]),
        (lambda: op(x[None], res[None], w), ValueError, ["2-D"]),
        (lambda: op(x, res[:3], w), ValueError, ["residual", "(3, 256)"]),
        (lambda: op(x, res, w[:8]), ValueError, ["weight", "(256,)"]),
        (lambda: op(x, res, w, eps=-1.0), ValueError, ["eps"]),
        (lambda: op(x, res, w, eps="1e-6"), TypeError, ["eps"]),
        (lambda: op(x, res, w, quant="int8"), ValueError, ["quant"]),
        (lambda: op(x[:, :200], res[:, :200], w[:200], quant="fp8_e4m3_128"), ValueError,
         ["divisible by 128", "200"]),
        (lambda: op(x, res, w, algorithm="ring"), ValueError, ["algorithm"]),
        (lambda: op(x, res, w, deterministic=1), TypeError, ["deterministic"]),
        (lambda: op(x, res, w, group="g"), TypeError, ["group"]),
    ]
    return all(_expect(group, fn, exc, words) for fn, exc, words in cases)


def test_bad_inputs_raise_typed_errors_before_launch():
    assert ditron_ops.launch(_bad_inputs, 2) == [True, True]


def _disagree(group):
    x, res, w = norm_inputs(group, 2, 64, torch.float32)
    try:
        ditron_ops.all_reduce_rmsnorm(x, res, w, eps=1e-6 * (group.rank + 1))
    except ditron_ops.DitronMismatchError as err:
        return "eps" in str(err)
    return False


def test_ranks_disagreeing_on_eps_raise_mismatch():
    assert ditron_ops.launch(_disagree, 2) == [True, True]


def _on_torch_group(group, rows, cols):
    ditron_ops.set_default_group(group)
    fails = (check_against_reference(group, rows, cols, torch.float32, "auto", "fp8_e4m3")
             + check_against_reference(group, rows, cols, torch.float16, "two_shot", None)
             + check_batch_invariance(group, rows, cols, torch.float32, "auto", "fp8_e4m3"))
    # the default mode sums with the group's all-reduce: no gather (W-fold traffic)
    x, res, w = norm_inputs(group, rows, cols, torch.float32, seed=2)
    want = norm_reference.all_reduce_rmsnorm(x, res, w, 1e-6, group)
    gather, norm_reference.gather_tensors = norm_reference.gather_tensors, None
    try:
        got = ditron_ops.all_reduce_rmsnorm(x, res, w, deterministic=False)
    finally:
        norm_reference.gather_tensors = gather
    if not (torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])):  # W = 2: exact
        fails.append(f"rank {group.rank}: the all-reduce path differs from the reference")
    return fails


def test_groups_without_symmetric_memory_use_the_reference():
    """A torch.distributed (gloo) group: the reference path, same contract; deterministic
    mode row invariant (gather, fixed sum order), the default mode the group's all-reduce."""
    from ditron_ops.testing import run_gloo

    _no_failures(run_gloo(_on_torch_group, 2, args=(3, 64)))


_COMPILE = r"""
import torch
torch.cuda.is_available = lambda: True   # ditron then builds triton.jit kernels; nothing runs
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ditron_ops.collectives import _norm_kernels as K, _norm_launch as L
T = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
     torch.uint8: "*u8"}
def build(dt, wdt, cols, two_shot, quant):
    block, one_chunk, warps = L.block_config(cols)
    vec = 16 // dt.itemsize if cols % (16 // dt.itemsize) == 0 else 1
    cx = dict(TWO_SHOT=two_shot, QUANT=quant, BLOCK_H=block, ONE_CHUNK=one_chunk, VEC=vec, COPY_BLOCK=2048)
    ptrs = dict(x_ptr=dt, res_ptr=dt, w_ptr=wdt, out_ptr=dt, res_out_ptr=dt, codes_ptr=torch.uint8,
                scales_ptr=torch.float32, xbuf_ptr=dt, stn_ptr=dt, str_ptr=dt, stc_ptr=torch.uint8,
                sts_ptr=torch.float32, buf_table=torch.int64, sig_ptr=torch.int64, sig_table=torch.int64,
                err_claim=torch.int64, err_record=torch.int64)
    fn = K.ar_rmsnorm_kernel
    sig = {n: "constexpr" if n in cx else T[ptrs[n]] if n in ptrs else "fp32" if n == "eps" else "i32"
           for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    k = triton.compile(ASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, enable_fp_fusion=False))
    ptx = k.asm["ptx"]
    assert "fma" not in ptx, "no FMA contraction: every variant rounds alike"
    assert "div.full" not in ptx and "div.approx" not in ptx, "IEEE divisions (torch's bits)"
    assert "rsqrt" not in ptx and "sqrt.approx" not in ptx, "IEEE square root"
    assert vec == 1 or "ld.global.cg.v4" in ptx, "the peers' rows load 16 bytes wide"
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
for cols, two_shot, quant in ((4096, False, 0), (4096, True, 1), (8192, False, 2), (8192, True, 1),
                              (12288, True, 2), (12288, False, 1), (1001, True, 0)):
    build(bf16, bf16, cols, two_shot, quant)
build(f16, f16, 2048, True, 2)
build(f32, f32, 2048, False, 1)
build(bf16, f32, 5120, True, 0)
print("COMPILED")
"""


def test_gpu_kernel_compiles_for_sm90():
    """The GPU code path (types, layouts and divisions the interpreter does not check) compiles
    for sm_90 in a fresh process: one-shot, two-shot, chunked rows, both quantizations, every
    dtype; no FMA, IEEE divisions and roots, 16-byte loads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr[-4000:]


def _back_to_back(group, schedule):
    return check_back_to_back(group, schedule, torch.float32, seed=1,
                              delay=lambda _: time.sleep(0.02))


def test_back_to_back_calls_without_synchronization():
    """20 calls at W=2, T varying in 1..60 (4 values), one-shot and two-shot alternating, every quant
    mode, a rank late now and then, nothing synchronized between calls (outputs kept): every
    result equals the reference. Halves sized per call (T) overlapped here."""
    schedule = back_to_back_schedule(20, 60, (128,), 2, seed=1, distinct_rows=4)
    assert len({call[0] for call in schedule}) > 2
    _no_failures(ditron_ops.launch(_back_to_back, 2, args=(schedule,)))


def _layouts(group):
    """Calls of changing T, algorithm and quant (the workspace grows between them, a second
    round rebuilds the stale plans): every plan's regions lie in half 0 of the capacity, and
    every plan uses the same halves (``half_bytes``), so calls of parity 0 and 1 never touch
    the same bytes whatever their T or algorithm."""
    calls = ((40, 128, "two_shot", "fp8_e4m3"), (3, 128, "one_shot", None),
             (17, 128, "two_shot", None), (1, 128, "one_shot", "fp8_e4m3_128"),
             (2, 516 * 128, "one_shot", None),  # 528 KB of x: the 1 MB buffer grows
             (5, 256, "two_shot", "fp8_e4m3_128"))
    for rows, cols, algorithm, quant in calls * 2:
        x, res, w = norm_inputs(group, rows, cols, torch.float32)
        ditron_ops.all_reduce_rmsnorm(x, res, w, algorithm=algorithm, quant=quant)
    ws = group.workspace(PURPOSE)
    if ws.data.nbytes <= 1 << 20:
        return [f"the workspace did not grow ({ws.data.nbytes} bytes)"]
    base, half = ws.data.local.data_ptr(), ws.data.nbytes // 2
    names = list(_norm_kernels.ar_rmsnorm_kernel.arg_names)
    plans = [p for p in group.plans._plans.values() if isinstance(p, _norm_launch._NormPlan)]
    fails = [] if len(plans) == len(calls) else [f"{len(plans)} plans"]
    for plan in plans:
        args = plan.kernel.args
        if plan.stale() or args[names.index("half_bytes")] != half:
            fails.append(f"a plan with half_bytes {args[names.index('half_bytes')]} != {half}")
        for name in ("xbuf_ptr", "stn_ptr", "str_ptr", "stc_ptr", "sts_ptr"):
            view = args[names.index(name)]
            start, nbytes = view.data_ptr() - base, view.numel() * view.element_size()
            if not (0 <= start and 64 <= nbytes and start + nbytes <= half and start % 64 == 0):
                fails.append(f"{name} [{start}, +{nbytes}) outside half 0 [0, {half})")
    return fails


def test_every_call_stays_in_its_parity_half():
    _no_failures(ditron_ops.launch(_layouts, 2))


def test_precompile_knows_the_op(monkeypatch):
    """``precompile(["all_reduce_rmsnorm"])`` runs the family (nothing to compile on the CPU),
    and its variants bind to the kernel's signature: 24 per dtype (``PRECOMPILE_COLS``)."""
    import inspect

    from ditron_ops.runtime import compiler
    from ditron_ops.runtime import precompile as precompile_module

    assert precompile_module.families()["all_reduce_rmsnorm"] == ("all_reduce_rmsnorm",)
    got = ditron_ops.precompile(["all_reduce_rmsnorm"], dtypes=["fp16"])
    assert got["families"] == ["all_reduce_rmsnorm"] and got["kernels"] == 0
    made = []
    options = {"num_warps", "enable_fp_fusion"}

    def bind(kernel):
        kwargs = {k: v for k, v in kernel.kwargs.items() if k not in options}
        inspect.signature(kernel.fn.fn).bind(*kernel.args, **kwargs)  # every argument, once
        made.append((kwargs["BLOCK_H"], kwargs["ONE_CHUNK"], kwargs["TWO_SHOT"], kwargs["QUANT"],
                     kernel.args[0].dtype))

    monkeypatch.setattr(compiler, "prepare", bind)
    _norm_launch._precompile(torch.device("cpu"), (torch.float16, torch.float32))
    assert len(made) == len(set(made)) == 2 * 24
    assert {(block, one) for block, one, *_ in made} == {
        block_config(cols)[:2] for cols in _norm_launch.PRECOMPILE_COLS}
