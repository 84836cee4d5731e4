"""Standalone collectives as ``torch.ops.ditron.*``: all_gather, reduce_scatter, all_reduce,
all_to_all; and all_reduce_rmsnorm (all-reduce + residual add + RMSNorm [+ fp8], serving)."""
from .all_gather import all_gather
from .all_reduce import all_reduce
from .all_reduce_rmsnorm import all_reduce_rmsnorm
from .all_to_all import all_to_all
from .reduce_scatter import reduce_scatter

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_reduce_rmsnorm"]
