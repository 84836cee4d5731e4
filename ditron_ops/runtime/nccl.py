"""torch.distributed's device collectives (NCCL) for groups that carry a GPU process group.

The unfused paths of the GEMM ops (``impl="baseline"``, and ``impl="auto"`` where the fused
kernels would not win) run these on multi-GPU groups, through ``collectives.unfused``: they are
the fastest unfused collectives there and exactly the sequential baseline the fused ops are
measured against. Each helper returns ``None`` / ``False`` when it does not apply (virtual
world, CPU, gloo, uneven rows), and ``collectives.unfused`` falls back to ditron's own
collectives or the reference.

Only exact operations go through NCCL when a caller promises determinism: an all-gather is a
copy, but NCCL's sums are neither rank ordered nor fp32, so deterministic reductions stay on
ditron's kernels.

NCCL does not notice ranks that disagree on sizes (it hangs or returns garbage), where ditron's
kernels raise ``DitronSizeMismatchError``. So the first call with a new layout (shapes and
dtype) agrees on it with the peers over the process group (``agreement.agree``: a host
exchange, once per layout; refused during CUDA-graph capture like every other first-time
set-up) and raises ``DitronMismatchError`` on every rank when they differ. A layout one rank
has already agreed on is not checked again, so a program whose ranks first agree on a layout
and later disagree about it can still reach NCCL with mismatched sizes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .agreement import agree
from .group import Group


def nccl_pg(group: Group) -> Optional[dist.ProcessGroup]:
    """The group's process group when it runs NCCL on the group's GPU, else ``None`` (the
    backend check is cached; the process group is read live, so a released group has none)."""
    pg = getattr(group, "pg", None)
    if pg is None or group.device.type != "cuda":
        return None
    nccl = group.__dict__.get("_pg_is_nccl")
    if nccl is None:
        nccl = group._pg_is_nccl = "nccl" in str(dist.get_backend(pg)).lower()
    return pg if nccl else None


def _agree(group: Group, op: str, layout: tuple) -> None:
    """Raise ``DitronMismatchError`` on every rank unless all ranks call ``op`` with the same
    ``layout`` (checked once per layout: a host exchange over the process group)."""
    agree(group, f"{op} (NCCL)", (("layout", layout),))


def all_gather_rows(x: torch.Tensor, group: Group, sizes: Sequence[int],
                    out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``[ΣM_r, ...]`` gathered by NCCL into ``out`` (new if None), or None (no NCCL group or
    uneven ``sizes``)."""
    pg = nccl_pg(group)
    if pg is None or len(set(sizes)) != 1:
        return None
    _agree(group, "all_gather", (tuple(x.shape), tuple(sizes), x.dtype))
    if out is None:
        out = x.new_empty((sum(sizes), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=pg)
    return out


def reduce_scatter_rows(x: torch.Tensor, group: Group, rows: Sequence[int],
                        out: torch.Tensor) -> bool:
    """NCCL's reduce-scatter of ``x [ΣM_r, N]`` into ``out [M_rank, N]``; False (nothing done)
    without an NCCL group or with uneven ``rows``."""
    pg = nccl_pg(group)
    if pg is None or len(set(rows)) != 1:
        return False
    _agree(group, "reduce_scatter", (tuple(x.shape), tuple(rows), x.dtype))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=pg)
    return True


def all_reduce_(x: torch.Tensor, group: Group) -> bool:
    """NCCL's in-place all-reduce of the contiguous ``x``; False without an NCCL group."""
    pg = nccl_pg(group)
    if pg is None or not x.is_contiguous():
        return False
    _agree(group, "all_reduce", (tuple(x.shape), x.dtype))
    dist.all_reduce(x, group=pg)
    return True
