"""Plain torch + torch.distributed implementations: oracles for tests, baselines for benchmarks."""
from .attention import attention, flash_decode, ulysses_attention
from .collectives import (all_gather, all_reduce, all_to_all, gather_tensors, rank_ordered_sum,
                          reduce_scatter)

__all__ = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "gather_tensors",
           "rank_ordered_sum", "flash_decode", "attention", "ulysses_attention"]
