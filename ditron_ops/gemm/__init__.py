"""GEMM ops with communication: ``ag_gemm`` (all-gather + GEMM), ``gemm_rs`` / ``gemm_ar``
(GEMM + reduce-scatter / all-reduce), their autograd, and the persistent GEMM core they share.

One module per op (``ag_gemm.py``, ``gemm_rs.py``: public function, op schema, auto rule), its
launcher (``_ag_launch.py``, ``_rs_launch.py``) and kernels (``_ag_kernels.py``,
``_rs_kernels.py``); the core's tile configuration and launch in ``_core.py`` (the rule in
``_core_configs.py``), its kernels in ``_core_kernels.py`` (split-K and wide tiles: default-mode
``matmul`` only); the warp-specialized sm_90 core in ``_ws_*.py`` (plain ``matmul`` only,
where ``_tune.py`` times it faster). The functions are re-exported by ``ditron_ops``
(``ditron_ops.ag_gemm``); here the names stay the modules (``ditron_ops.gemm.ag_gemm.use_fused``).
"""
from . import ag_gemm, gemm_rs, scaled
from . import autograd as _autograd  # noqa: E402,F401  (ag_gemm <-> gemm_rs backward; needs the ops)

__all__ = ["ag_gemm", "gemm_rs", "matmul", "scaled"]


def __getattr__(name: str):
    """``matmul`` (the persistent GEMM core, ``_core.matmul``): imported with Triton on first use."""
    if name == "matmul":
        from ._core import matmul

        globals()["matmul"] = matmul
        return matmul
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
