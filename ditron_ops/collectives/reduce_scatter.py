"""``reduce_scatter``: sum every rank's ``[M, ...]`` input and keep this rank's row shard.

Schedule (one kernel per call, see ``_kernels``)::

    rank r:  push rows split(M)[d] -> slot r of rank d (all d) | wait | out = sum of slots 0..W-1

The sum is always taken in rank order in fp32 with one rounding, so both modes are bitwise
reproducible for a fixed world size (``deterministic`` is accepted for API uniformity).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._library import define_op, direct
from .._validation import check_tensor, memo
from ..deterministic import resolve_deterministic
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, name_for_rows, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key
from ..runtime.split import split_sizes

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
_launch = lazy_import("._launch", globals())

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reduce_scatter(x: torch.Tensor, group: Optional[Group] = None, *,
                   deterministic: Optional[bool] = None) -> torch.Tensor:
    """Reduce (sum) over ranks and scatter row shards.

    Parameters
    ----------
    x : torch.Tensor
        ``[M, *rest]`` fp16/bf16/fp32, the same shape on every rank.
    group : Group, optional
    deterministic : bool, optional
        Defaults to the ``ditron_ops.deterministic()`` mode. Both modes sum in rank order
        0..W-1 in fp32 and round once: bitwise identical run to run and independent of arrival
        order. Results differ across world sizes (different summation).

    Returns
    -------
    torch.Tensor
        ``[split_sizes(M, W)[rank], *rest]``: rows ``split_start(M, W, rank)`` onward of the sum.
        The first ``M % W`` ranks get one extra row.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same shape and dtype. Runs on the
    current stream; calls on one group must be stream-ordered.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # [W * 2, 3] of rank + 1 on every rank: 2 rows of the sum each
    ...     x = torch.full((4, 3), group.rank + 1.0, device=group.device)
    ...     return ditron_ops.reduce_scatter(x, group).tolist()
    >>> ditron_ops.launch(body, 2)[1]
    [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate() -> bool:
        check_tensor("reduce_scatter", "x", x, group, DTYPES, min_dim=1)
        agree(group, "reduce_scatter", (("dtype", x.dtype), ("x.shape", tuple(x.shape)),
                                        ("deterministic", flag)))
        return True

    memo(group, call_key("reduce_scatter", x, flag), validate)
    name = name_for_rows(name, group, split_sizes(x.shape[0], group.world_size))
    if direct(x):
        return _reduce_scatter_impl(x, name, flag)
    return torch.ops.ditron.reduce_scatter(x, name, flag)


def _reduce_scatter_impl(x: torch.Tensor, group_name: str, deterministic: bool) -> torch.Tensor:
    group = resolve_group(group_name)
    if not group.has_symmetric_memory:
        return reference.reduce_scatter(x, group)
    sizes = split_sizes(x.shape[0], group.world_size)
    row_elems = int(torch.Size(x.shape[1:]).numel())
    out = x.new_empty((sizes[group.rank], *x.shape[1:]))
    return _launch.push_combine(group, x, out, op="reduce_scatter", split_src=True, reduce=True,
                                src_rows=x.shape[0], row_elems=row_elems, slot_elems=max(sizes) * row_elems)


def _reduce_scatter_fake(x, group_name, deterministic):
    group = resolve_group(group_name)
    rows = split_sizes(x.shape[0], group.world_size)[group.rank]
    return x.new_empty((rows, *x.shape[1:]))


define_op("reduce_scatter(Tensor x, str group_name, bool deterministic) -> Tensor",
          _reduce_scatter_impl, _reduce_scatter_fake)
