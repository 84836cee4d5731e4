"""ag_gemm: all-gather fused with a persistent Triton GEMM (gather-mode swizzle)."""
from ._launch import matmul
from .api import AUTO_MIN_FLOPS_PER_RANK, AUTO_MIN_FLOPS_VIRTUAL, ag_gemm

__all__ = ["ag_gemm", "matmul", "AUTO_MIN_FLOPS_PER_RANK", "AUTO_MIN_FLOPS_VIRTUAL"]
