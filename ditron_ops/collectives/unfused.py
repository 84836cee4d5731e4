"""Collectives of the GEMM ops' unfused paths (``impl="baseline"``, and ``"auto"`` where fusing
would not win): NCCL on multi-GPU process groups (``runtime.nccl``: the fastest there, and the
sequential baseline the fused ops are measured against), else ditron's kernels on groups with
symmetric memory, else the torch.distributed reference. NCCL's sums are neither rank ordered
nor fp32, so reductions skip it when ``deterministic``; a gather is a copy and always may use it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import reference
from ..runtime import nccl
from ..runtime.group import Group
from ..runtime.split import split_sizes
from .all_gather import all_gather
from .all_reduce import all_reduce
from .reduce_scatter import reduce_scatter


def gather_rows(x: torch.Tensor, group: Group, sizes: Sequence[int],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank's rows ``[ΣM_r, ...]`` (rank r's ``x [sizes[r], ...]``), into ``out`` if given."""
    if group.world_size == 1:  # the gather of one rank is its rows
        return x if out is None else out.copy_(x)
    got = nccl.all_gather_rows(x, group, sizes, out=out)
    if got is not None:
        return got
    full = (all_gather(x, group, shard_sizes=list(sizes)) if group.has_symmetric_memory
            else reference.all_gather(x, group, list(sizes)))
    return full if out is None else out.copy_(full)


def reduce_rows(x: torch.Tensor, group: Group, rows: Sequence[int], out: torch.Tensor,
                deterministic: bool) -> torch.Tensor:
    """``out [rows[rank], N]`` = this rank's rows of the sum over ranks of ``x [ΣM, N]``."""
    if group.world_size == 1:  # the sum over one rank: its rows (one rounding, as the kernels)
        return out.copy_(x)
    if not deterministic and nccl.reduce_scatter_rows(x, group, rows, out):
        return out
    if list(rows) == split_sizes(x.shape[0], group.world_size):
        red = reduce_scatter(x, group) if group.has_symmetric_memory else \
            reference.reduce_scatter(x, group)
    else:
        full = all_reduce(x, group) if group.has_symmetric_memory else reference.all_reduce(x, group)
        start = sum(rows[:group.rank])
        red = full[start:start + rows[group.rank]]
    return out.copy_(red)


def sum_all(x: torch.Tensor, group: Group, out: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """``out`` = the sum over ranks of ``x`` (``x`` may be ``out``)."""
    if group.world_size == 1:  # the sum over one rank
        return x if x is out else out.copy_(x)
    if not deterministic and nccl.all_reduce_(x, group):
        return x if x is out else out.copy_(x)
    red = all_reduce(x, group) if group.has_symmetric_memory else reference.all_reduce(x, group)
    return out.copy_(red)
