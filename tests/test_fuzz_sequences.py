"""Randomized programs of every op on the CPU virtual world (interpreter), checked against the
references, and the same generator with injected faults (``ditron_ops.testing.fuzz``).

Examples per run: ``--fuzz-examples`` (default 150) and ``--fuzz-fault-examples`` (default
20); derandomized, so CI draws the same programs every run. Failures that Hypothesis found
are kept below as named regression tests of the shrunk program.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ditron_ops.testing import fuzz
from ditron_ops.testing.fuzz import Call, Program

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
F32 = torch.float32
MOE = dict(experts_per_rank=1, max_tokens=1, hidden=8, topk=1)


def _settings(examples: int) -> settings:
    # derandomized: CI is reproducible; no example database (nothing written by CI)
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.timeout(900)
def test_random_programs_match_references(request):
    examples = request.config.getoption("--fuzz-examples")
    ran = []

    @_settings(examples)
    @given(program=fuzz.programs())
    def run(program):
        assert fuzz.run_program(program) == ["ok"] * program.world_size
        ran.append(program)

    run()
    assert len(ran) >= examples


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["raise", "skip"])
def test_injected_faults_give_typed_errors_and_the_next_launch_works(request, kind):
    """A rank raises before a call, or skips it and all later ones: every other rank gets a
    DitronError within the bound (``fuzz.FAULT_BOUND``), then a new launch works. Half the
    ``--fuzz-fault-examples`` each."""
    examples = request.config.getoption("--fuzz-fault-examples") // 2
    ran = []

    @_settings(examples)
    @given(program=fuzz.programs(faults=(kind,), max_calls=4))
    def run(program):
        fuzz.run_faulty_program(program)
        ran.append(program)

    run()
    assert len(ran) >= examples


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
