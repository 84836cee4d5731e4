"""Randomized programs of every op on the CPU virtual world (interpreter), checked against the
references, and the same generator with injected faults (``ditron_ops.testing.fuzz``).

Failures that Hypothesis found are kept below as named regression tests of the shrunk program.
"""
import pytest
import torch

from ditron_ops.testing import fuzz
from ditron_ops.testing.fuzz import Call, Program

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
F32, F16 = torch.float32, torch.float16
MOE = dict(experts_per_rank=1, max_tokens=1, hidden=8, topk=1)


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
    kernel: the peers timed out, or (found by the fuzzer, W=4, after other calls) returned
    NaN before the timeout was raised."""
    assert fuzz.run_program(Program(2, (call,), MOE), timeout_s=2.0) == ["ok", "ok"]
