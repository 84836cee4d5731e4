"""The row split rule shared by reduce_scatter, gemm_rs and two-shot all_reduce."""
from __future__ import annotations


def split_sizes(rows: int, world_size: int) -> list[int]:
    """Rows owned by each rank when ``rows`` are split over ``world_size`` ranks.

    The first ``rows % world_size`` ranks get one extra row: ``split_sizes(10, 4) == [3, 3, 2, 2]``.
    """
    base, extra = divmod(rows, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def split_start(rows: int, world_size: int, rank: int) -> int:
    """First row owned by ``rank`` under ``split_sizes``."""
    base, extra = divmod(rows, world_size)
    return rank * base + min(rank, extra)
