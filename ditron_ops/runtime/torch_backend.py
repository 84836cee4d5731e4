"""The torch-reference backend: a ``Group`` over a ``torch.distributed`` process group.

Ops called with a ``TorchGroup`` run their reference implementation (torch.distributed
collectives — gloo on CPU, NCCL on GPU — plus torch matmul). It is the oracle of the multi-process
tests and the baseline of the benchmarks; it has no symmetric memory.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .group import Group, register_group


class TorchGroup(Group):
    """Wrap a ``torch.distributed`` process group (default: the WORLD group).

    Parameters
    ----------
    pg : ProcessGroup, optional
        An initialised process group; ``None`` means the default group.
    device : torch.device, optional
        Device of this rank's tensors (default: the current CUDA device under NCCL, else CPU).
    """

    backend = "torch"

    def __init__(self, pg: Optional[dist.ProcessGroup] = None, device=None,
                 timeout_s: Optional[float] = None):
        if not dist.is_initialized():
            raise ValueError("ditron.TorchGroup: torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first")
        self.pg = pg if pg is not None else dist.group.WORLD
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend(self.pg) == "nccl" else torch.device("cpu"))
        rank, world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        name = f"torch:{getattr(self.pg, 'group_name', 'world') or 'world'}"
        super().__init__(rank, world, device, name, timeout_s=timeout_s)
        register_group(self)

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def release(self) -> None:
        """Drop this group's reference to its process group (call after
        ``destroy_process_group``). The process group's worker threads then stop now: kept
        alive into interpreter shutdown, a gloo worker releasing the tensors of a finished
        collective needs the GIL there and aborts the process (seen as a flaky SIGABRT at exit,
        ``terminate called without an active exception``)."""
        self.pg = None

    def all_gather_object(self, obj: Any) -> list:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out
