"""GPU tier: ``launch`` is ordered after the caller's stream, and the caller after the ranks.

The caller writes the inputs right before ``launch`` while a long kernel still occupies its
stream (``torch.cuda._sleep``): a rank that did not wait for the caller's stream would read the
inputs before they exist.
"""
import pytest
import torch

import ditron_ops

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = 200_000_000  # about 0.1 s at the H200's clock: far longer than a launch's set-up


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("impl", ["fused", "baseline"])
def test_inputs_written_behind_a_long_kernel(impl):
    world, rows, k, n = 4, 256, 1024, 2048
    # two launches in one process, each with inputs written just before it (in the first the
    # ranks' compiles may outlast the sleep; the second has nothing to compile)
    for _ in range(2):
        torch.cuda._sleep(_SLEEP_CYCLES)
        a = torch.randn(world * rows, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(world, 4096, device="cuda")

        def body(group):
            shard = a[group.rank * rows:(group.rank + 1) * rows]
            return ditron_ops.ag_gemm(shard, b, impl=impl), ditron_ops.all_reduce(x[group.rank])

        outs = ditron_ops.launch(body, world)
        # read on the caller's stream straight away: launch returned after the ranks' work
        ref = a.double() @ b.double()
        for product, total in outs:
            assert _rel(product, ref) < 1e-2
            torch.testing.assert_close(total, x.sum(0), rtol=1e-5, atol=1e-4)
