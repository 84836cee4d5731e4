"""Helpers of the GPU tier's plain-``matmul`` tests (split K, sliced tail, wide tiles)."""
import itertools

import torch

from ditron_ops.gemm import _core

DEV = torch.device("cuda")


def ints(*shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Integer values in [-4, 4] on the GPU: every product and partial sum exact in fp32."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype=dtype, device=DEV)


def last_plan():
    """The plan of this thread's last ``matmul`` call (the cache's most recent entry)."""
    return next(reversed(_core._MATMUL_PLANS.cache._plans.values()))


def integer_cases(a: torch.Tensor, bias: torch.Tensor, k: int, n: int):
    """``(layout, with_bias, b, want)`` for B as ``[K, N]`` ("kn") and as a weight's ``w.t()``
    ("nk"), each without and with ``bias``: integer-valued B (seed 2) and the exact product
    (float64) that ``a @ b (+ bias)`` must give."""
    for layout, with_bias in itertools.product(("kn", "nk"), (False, True)):
        b = ints(k, n, seed=2) if layout == "kn" else ints(n, k, seed=2).t()
        yield layout, with_bias, b, a.double() @ b.double() + (bias.double() if with_bias else 0)


def skip_unless_ws():
    """Skip the calling test where the warp-specialized core cannot run (not sm_90, or a
    Triton whose Gluon it refuses)."""
    import pytest

    from ditron_ops.gemm import _ws_launch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the WS core is sm_90 only")
    a = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEV)
    why = _ws_launch.refusal(a, a, a, None)
    if why is not None:
        pytest.skip(f"WS core refused here: {why}")
