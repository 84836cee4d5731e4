"""gemm_rs / gemm_ar: row-parallel GEMM with a fused, rank-ordered reduction."""
from .api import ONE_SHOT_MAX_BYTES, gemm_ar, gemm_rs
from . import autograd as _autograd  # noqa: E402,F401  (ag_gemm <-> gemm_rs backward; needs the ops)

__all__ = ["gemm_rs", "gemm_ar", "ONE_SHOT_MAX_BYTES"]
