"""Helpers of the GPU tier's plain-``matmul`` tests (split K, sliced tail, wide tiles)."""
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
