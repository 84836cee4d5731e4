"""Host cost of one eager call of every op against ``torch.matmul``, with pytest-benchmark's
statistics (the same calls as ``python -m ditron_ops.bench overhead``, one rank)::

    python -m pytest benchmarks/ --benchmark-only
    python -m pytest benchmarks/ --benchmark-only --benchmark-columns=min,median,max,rounds

Not part of the default test run (``testpaths = ["tests"]``). Each round is one call timed on
the host without a device synchronization: the host cost the caller pays, as long as the GPU
keeps up (the problem is tiny). On a CPU-only machine the kernels run in the Triton
interpreter, so only the ranking of the ops' host paths there means anything.
"""
import pytest
import torch

import ditron_ops
from ditron_ops.bench.overhead import _ops

DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
NAMES = ["torch.matmul", "ag_gemm/fused", "ag_gemm/auto", "gemm_rs/fused", "gemm_ar/fused",
         "gemm_ar/auto", "all_reduce", "all_gather", "reduce_scatter", "flash_decode"]


@pytest.mark.parametrize("name", NAMES)
def test_eager_call(benchmark, name):
    benchmark.group = "eager host time per call (one rank, tiny problem)"
    rounds = 2000 if torch.cuda.is_available() else 5

    def body(group):
        op = _ops(group, DTYPE)[name]
        for _ in range(3):  # plans, workspaces, compiled kernels
            op()
        group.synchronize()
        benchmark.pedantic(op, rounds=rounds, iterations=1, warmup_rounds=10 if rounds > 5 else 0)
        group.synchronize()
        return True

    assert ditron_ops.launch(body, 1) == [True]
