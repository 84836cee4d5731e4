"""Plain torch + torch.distributed implementations: oracles for tests, baselines for benchmarks."""
from .attention import flash_decode
from .collectives import (all_gather, all_reduce, all_to_all, gather_tensors, rank_ordered_sum,
                          reduce_scatter)

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "gather_tensors",
           "rank_ordered_sum", "flash_decode"]
