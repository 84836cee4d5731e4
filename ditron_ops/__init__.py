"""ditron_ops: communication hidden behind computation with distributed Triton kernels.

Importing registers the ``torch.ops.ditron.*`` ops; nothing else happens at import.
"""
from . import reference  # noqa: F401  (ditron_ops.reference: the plain-torch oracles)
from .gemm.ag_gemm import ag_gemm
from .gemm.gemm_rs import gemm_ar, gemm_rs
from .gemm.scaled import ag_gemm_scaled, gemm_ar_scaled, gemm_rs_scaled
from .attention.flash_decode import flash_decode
from .attention.paged_kv import csr_to_block_table
from .attention.ulysses import ulysses_attention
from .collectives import all_gather, all_reduce, all_reduce_rmsnorm, all_to_all, reduce_scatter
from . import moe
from .deterministic import deterministic, is_deterministic
from .errors import (DitronError, DitronInputError, DitronMismatchError, DitronSizeMismatchError,
                     DitronTimeoutError)
from .runtime import (Group, TorchGroup, VirtualGroup, current_group, launch, set_default_group,
                      split_sizes)
from .runtime.nvshmem_backend import finalize_nvshmem, init_nvshmem, nvshmem_available
from .runtime.precompile import precompile

__version__ = "0.1.0"

__all__ = ["ag_gemm", "ag_gemm_scaled", "gemm_rs_scaled", "gemm_ar_scaled", "gemm_rs", "gemm_ar", "flash_decode", "csr_to_block_table",
           "ulysses_attention", "all_gather",
           "reduce_scatter", "all_reduce", "all_to_all", "all_reduce_rmsnorm", "moe", "launch",
           "Group", "VirtualGroup",
           "TorchGroup", "init_nvshmem", "finalize_nvshmem", "nvshmem_available", "current_group",
           "set_default_group", "split_sizes", "precompile", "deterministic", "is_deterministic",
           "DitronError", "DitronTimeoutError", "DitronSizeMismatchError", "DitronMismatchError",
           "DitronInputError"]


def __getattr__(name: str):
    """``ditron_ops.compile`` (the torch.compile pass) is imported on first access: importing it
    early would cost nothing heavy, but keeps ``import ditron_ops`` to the ops alone."""
    if name == "compile":
        import importlib

        return importlib.import_module(".compile", __name__)
    raise AttributeError(f"module 'ditron_ops' has no attribute {name!r}")
