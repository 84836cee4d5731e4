"""``all_gather``: concatenate every rank's shard along dim 0 (uneven shards allowed).

Schedule (one kernel per call, see ``_kernels``)::

    rank r:  push x_r -> slot r of every rank | wait all slots | copy slots -> out (rank order)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import reference
from .._library import define_op, direct
from .._validation import check_sizes, check_tensor, memo
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
_launch = lazy_import("._launch", globals())

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def all_gather(x: torch.Tensor, group: Optional[Group] = None, *,
               shard_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Gather every rank's rows into one tensor on every rank.

    Parameters
    ----------
    x : torch.Tensor
        ``[M_r, *rest]`` fp16/bf16/fp32 on the group's device: this rank's shard.
    group : Group, optional
        Defaults to the current group (inside ``launch``) or the default group.
    shard_sizes : sequence of int, optional
        ``[M_0, ..., M_{W-1}]``, the same on every rank. ``None`` means every rank's shard has
        ``x.shape[0]`` rows (checked in the kernel: a disagreement raises
        ``DitronSizeMismatchError``).

    Returns
    -------
    torch.Tensor
        ``[sum(shard_sizes), *rest]``, rank 0's rows first.

    Constraints
    -----------
    Collective: every rank of the group calls it, in the same order relative to the group's other
    ops, with the same ``shard_sizes`` and ``rest``. Runs on the current stream; calls on one group
    must be stream-ordered. Returns without synchronizing; a peer that never arrives makes the
    next op on the group (or ``group.synchronize()``) raise ``DitronTimeoutError``.

    Examples
    --------
    Two virtual ranks (threads; on the GPU, or on the CPU in the Triton interpreter):

    >>> import torch, ditron_ops
    >>> def body(group):
    ...     x = torch.full((2, 3), float(group.rank), device=group.device)
    ...     return ditron_ops.all_gather(x, group)[:, 0].tolist()
    >>> ditron_ops.launch(body, 2)
    [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    """
    group, name = call_group(group)

    def validate() -> list[int]:
        check_tensor("all_gather", "x", x, group, DTYPES, min_dim=1)
        sizes = [x.shape[0]] * group.world_size if shard_sizes is None else check_sizes(
            "all_gather", "shard_sizes", shard_sizes, group)
        if sizes[group.rank] != x.shape[0]:
            raise ValueError(f"ditron.all_gather: shard_sizes[{group.rank}] = {sizes[group.rank]} "
                             f"but x has {x.shape[0]} rows on rank {group.rank}")
        agree(group, "all_gather", (("dtype", x.dtype), ("x.shape[1:]", tuple(x.shape[1:])),
                                    ("shard_sizes", tuple(sizes))))
        return sizes

    sizes = memo(group, call_key("all_gather", x, shard_sizes), validate)
    if direct(x):
        return _all_gather_impl(x, name, sizes)
    return torch.ops.ditron.all_gather(x, name, sizes)


def _all_gather_impl(x: torch.Tensor, group_name: str, shard_sizes: list[int]) -> torch.Tensor:
    group = resolve_group(group_name)
    if not group.has_symmetric_memory:
        return reference.all_gather(x, group, shard_sizes)
    row_elems = int(torch.Size(x.shape[1:]).numel())
    out = x.new_empty((sum(shard_sizes), *x.shape[1:]))
    return _launch.push_combine(group, x, out, op="all_gather", split_src=False, reduce=False,
                                src_rows=x.shape[0], row_elems=row_elems,
                                slot_elems=max(shard_sizes) * row_elems)


def _all_gather_fake(x, group_name, shard_sizes):
    return x.new_empty((sum(shard_sizes), *x.shape[1:]))


define_op("all_gather(Tensor x, str group_name, SymInt[] shard_sizes) -> Tensor",
          _all_gather_impl, _all_gather_fake)
