"""Plain torch / torch.distributed collectives: the oracles of the tests and the baselines.

``gather_tensors`` is the control-path exchange every reference builds on: torch.distributed for
groups that carry a process group (torch and nvshmem backends), a host exchange of tensor handles
for virtual worlds. Reductions here sum in rank order in fp32 and round once, exactly what the
deterministic kernels promise, so tests can compare with ``torch.equal``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..runtime.group import Group
from ..runtime.split import split_sizes, split_start


def _sync(group: Group) -> None:
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()


def gather_tensors(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's ``x`` (shapes may differ in dim 0), in rank order. Collective, host-synchronous."""
    pg = getattr(group, "pg", None)
    if pg is not None:
        shapes = group.all_gather_object(tuple(x.shape))
        rows = max(s[0] for s in shapes) if x.dim() else 1
        padded = x.new_zeros((rows, *x.shape[1:])) if x.dim() else x.reshape(1).clone()
        if x.dim():
            padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(group.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=pg)
        return [p[: s[0]] if x.dim() else p.reshape(()) for p, s in zip(parts, shapes)]
    _sync(group)
    handles = group.all_gather_object(x)
    copies = [t.clone() for t in handles]
    _sync(group)
    group.barrier()  # peers keep their tensors unchanged until everyone has copied
    return copies


def rank_ordered_sum(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``(((0 + p0) + p1) + ...)`` in fp32, rounded once to ``dtype``."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc += p.float()
    return acc.to(dtype)


def all_gather(x: torch.Tensor, group: Group, shard_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0."""
    return torch.cat(gather_tensors(x, group), dim=0)


def all_to_all(x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Part ``rank`` (along ``scatter_dim``) of every rank's ``x``, concatenated along
    ``gather_dim`` in rank order (``torch.distributed.all_to_all_single`` on process groups)."""
    w = group.world_size
    if getattr(group, "pg", None) is not None:
        send = torch.stack(x.chunk(w, scatter_dim)).contiguous()  # [W, *part]: part d first
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group.pg)
        return torch.cat(recv.unbind(0), dim=gather_dim).contiguous()
    parts = gather_tensors(x, group)
    return torch.cat([p.chunk(w, scatter_dim)[group.rank] for p in parts], dim=gather_dim).contiguous()


def reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's rows (``split_sizes``) of the rank-ordered fp32 sum of every rank's ``x``."""
    total = rank_ordered_sum(gather_tensors(x, group), x.dtype)
    start = split_start(x.shape[0], group.world_size, group.rank)
    return total[start: start + split_sizes(x.shape[0], group.world_size)[group.rank]].clone()


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rank-ordered fp32 sum of every rank's ``x``."""
    return rank_ordered_sum(gather_tensors(x, group), x.dtype)


# -- fast baselines (torch.distributed's own algorithms; reduction order is NCCL's/gloo's) ----------

def dist_all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((group.world_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group.pg)
    return out


def dist_reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // group.world_size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group.pg)
    return out


def dist_all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=group.pg)
    return out

