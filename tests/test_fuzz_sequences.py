"""Randomized programs of every op on the CPU virtual world (interpreter), checked against the
references, and the same generator with injected faults and with a rank that disagrees
(``ditron_ops.testing.fuzz``).

Examples per run: the default run (``python -m pytest -q``) draws 30 random programs, 20 with a
fault and 20 with a rank that disagrees, plus one covering program per W = 1..4 (twice: the
smallest shapes, then drawn ones) that together call every op in every dtype and mode; the long
run (marker ``slow``: ``python -m pytest -q -m slow``) draws 300, 60 and 100.
``--fuzz-examples``, ``--fuzz-fault-examples`` and ``--fuzz-mismatch-examples`` set the count
of whichever of the two runs. Derandomized, so CI draws the same programs every run. Failures
that Hypothesis found are kept below as named regression tests of the shrunk program. The GPU
tier runs the same generator at larger shapes (tests/gpu/test_fuzz_gpu.py).
"""
import dataclasses
import itertools
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ditron_ops.moe import buffer as moe_buffer
from ditron_ops.runtime.group import _registry as group_registry
from ditron_ops.testing import fuzz
from ditron_ops.testing.fuzz import Call, Fault, Program

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
F32 = torch.float32
MOE = dict(experts_per_rank=1, max_tokens=1, hidden=8, topk=1)


def _settings(examples: int) -> settings:
    # derandomized: CI is reproducible; no example database (nothing written by CI)
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _counts(short: int, long: int, timeouts: tuple) -> list:
    """The default run's count and the long run's (marker ``slow``), each with its time limit
    (a parameter's ``timeout`` mark, not the function's: the function's would win)."""
    return [pytest.param(short, id="short", marks=pytest.mark.timeout(timeouts[0])),
            pytest.param(long, id="long", marks=[pytest.mark.slow, pytest.mark.timeout(timeouts[1])])]


@pytest.mark.parametrize("default", _counts(30, 300, (600, 1800)))
def test_random_programs_match_references(fuzz_count, default):
    examples = fuzz_count("--fuzz-examples", default)
    ran = []

    @_settings(examples)
    @given(program=fuzz.programs())
    def run(program):
        assert fuzz.run_program(program) == ["ok"] * program.world_size
        ran.append(program)

    run()
    assert len(ran) >= examples


@st.composite
def _covering_programs(draw, world_size: int) -> Program:
    """A program of W = ``world_size`` that calls every op in both CPU dtypes, in a drawn
    order, with drawn shapes; the mode of (op, dtype) turns with W, so the programs of
    W = 1..4 together make every (op, dtype, mode)."""
    w, sizes = world_size, fuzz.CPU_SIZES
    moe = dict(experts_per_rank=draw(st.integers(1, sizes.moe_experts)),
               max_tokens=draw(st.integers(1, sizes.moe_tokens)),
               hidden=draw(st.sampled_from(sizes.moe_hidden)), fp8_hidden=sizes.fp8_hidden)
    moe["topk"] = draw(st.integers(1, min(sizes.moe_topk, moe["experts_per_rank"] * w)))
    body = [dataclasses.replace(draw(fuzz.calls(w, moe, (dtype,), (op,), sizes)),
                                mode=fuzz.MODES[(i + j + w) % len(fuzz.MODES)])
            for i, op in enumerate(fuzz.OPS) for j, dtype in enumerate(fuzz.CPU_DTYPES)]
    return Program(w, tuple(draw(st.permutations(body))), moe)


def test_the_covering_programs_make_every_op_dtype_and_mode():
    modes = {(op, dtype, fuzz.MODES[(i + j + w) % len(fuzz.MODES)]) for w in range(1, 5)
             for i, op in enumerate(fuzz.OPS) for j, dtype in enumerate(fuzz.CPU_DTYPES)}
    assert modes == set(itertools.product(fuzz.OPS, fuzz.CPU_DTYPES, fuzz.MODES))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_covering_programs_match_references(world_size):
    """The default run's random programs are few, so these make sure it reaches every op in
    every dtype and mode on every W: each W's covering program (``_covering_programs``) twice,
    the first with the smallest shapes Hypothesis draws (zero rows or keys where the op allows
    them), the second with drawn ones."""
    ran = []

    @_settings(2)
    @given(program=_covering_programs(world_size))
    def run(program):
        assert fuzz.run_program(program) == ["ok"] * program.world_size
        ran.append(program)

    run()
    assert len(ran) >= 2


@pytest.mark.parametrize("default", _counts(20, 60, (600, 1200)))
@pytest.mark.parametrize("kind", ["raise", "skip"])
def test_injected_faults_give_typed_errors_and_the_next_launch_works(fuzz_count, kind, default):
    """A rank raises before a call, or skips it and all later ones: every other rank gets a
    DitronError within the bound (``fuzz.FAULT_BOUND``), then a new launch works. Half the
    ``--fuzz-fault-examples`` each."""
    examples = fuzz_count("--fuzz-fault-examples", default) // 2
    ran = []

    @_settings(examples)
    @given(program=fuzz.programs(faults=(kind,), max_calls=4))
    def run(program):
        fuzz.run_faulty_program(program)
        # nothing of the faulty launch is left registered (the GPU tier checks its memory)
        assert not [name for name in moe_buffer._buffers if name.startswith("virtual")]
        assert not [name for name in group_registry if name.startswith("virtual")]
        ran.append(program)

    run()
    assert len(ran) >= examples


@pytest.mark.parametrize("default", _counts(20, 100, (600, 900)))
def test_disagreeing_rank_gets_mismatch_error_on_every_rank_and_the_program_goes_on(fuzz_count, default):
    """One rank changes the dtype, an agreed dim or a flag of one call: every rank gets
    DitronMismatchError naming the op, the field and both values (checked per rank in
    ``fuzz._disagree``), before anything is launched; the program's later calls then pass
    their checks in the same launch."""
    examples = fuzz_count("--fuzz-mismatch-examples", default)
    ran = []

    @_settings(examples)
    @given(program=fuzz.programs(mismatch=True, min_calls=1, max_calls=3))
    def run(program):
        assert fuzz.run_program(program) == ["ok"] * program.world_size
        ran.append(program.mismatch)

    run()
    assert len(ran) >= examples


def test_late_rank_gives_correct_results():
    """A rank that is late to a call (its thread sleeps 20 ms in the interpreter, its stream
    on a GPU) changes no result: the delay path of the runner (the GPU tier draws it)."""
    calls = (Call("all_reduce", F32, "default", 4, dict(shape=(3,), layout="contiguous",
                                                         algorithm="one_shot")),
             _gemm("gemm_rs", "deterministic", [3, 2], shard_sizes=None))
    program = Program(2, calls, MOE, Fault(1, 1, "delay", 2 * 10**7))
    assert fuzz.run_program(program, timeout_s=2.0) == ["ok", "ok"]


def test_a_peer_slow_before_the_faulty_call_is_no_fault(monkeypatch):
    """The fault's short bound starts at the faulty call: a peer slower than it at an earlier
    call (CI's loaded interpreter once made rank 0 time out there, and the launch raised that
    instead of the injected fault) is waited for with ``run_program``'s bound."""
    run_all_reduce = fuzz._RUN["all_reduce"]

    def slow_rank1_first(group, call, ctx):
        if group.rank == 1 and call.seed == 4:
            time.sleep(1.5)  # 3x the fault's bound
        return run_all_reduce(group, call, ctx)

    monkeypatch.setitem(fuzz._RUN, "all_reduce", slow_rank1_first)
    args = dict(shape=(3,), layout="contiguous", algorithm="one_shot")
    calls = (Call("all_reduce", F32, "default", 4, args), Call("all_reduce", F32, "default", 5, args))
    survivors = fuzz.run_faulty_program(Program(2, calls, MOE, Fault(0, 1, "raise")),
                                        timeout_s=0.5, relaunch=False)
    assert list(survivors) == [1]


def _gemm(op: str, mode: str, k: list, **extra) -> Call:
    args = dict(n=5, a_layout="contiguous", b_layout="contiguous", impl="fused", m=6, k=k)
    args.update(extra)
    return Call(op, F32, mode, 1, args)


@pytest.mark.parametrize("call", [
    _gemm("gemm_rs", "deterministic", [3, 0], shard_sizes=None),
    _gemm("gemm_rs", "default", [0, 3], shard_sizes=None),
    _gemm("gemm_ar", "deterministic", [0, 3], algorithm="one_shot"),
    _gemm("gemm_ar", "default", [3, 0], algorithm="two_shot"),
], ids=["rs-det", "rs-default", "ar-det-one-shot", "ar-default-two-shot"])
def test_regression_gemm_rank_without_k_columns(call):
    """A rank whose slice of K is empty took the unfused path while its peers ran the fused
    kernel: the peers timed out (found by the fuzzer at W=4, K_r = [19, 3, 0, 9], as NaN in
    their outputs)."""
    assert fuzz.run_program(Program(2, (call,), MOE), timeout_s=2.0) == ["ok", "ok"]
