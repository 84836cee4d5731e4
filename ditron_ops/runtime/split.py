"""The row split rule shared by reduce_scatter, gemm_rs and two-shot all_reduce."""
from __future__ import annotations


def split_sizes(rows, world_size: int) -> list:
    """Rows owned by each rank when ``rows`` are split over ``world_size`` ranks.

    The first ``rows % world_size`` ranks get one extra row: ``split_sizes(10, 4) == [3, 3, 2, 2]``.
    Branch-free, so it also works on symbolic sizes (fake tensors under torch.compile).
    """
    return [(rows + world_size - 1 - r) // world_size for r in range(world_size)]


def split_start(rows, world_size: int, rank: int):
    """First row owned by ``rank`` under ``split_sizes``."""
    return sum(split_sizes(rows, world_size)[:rank])
