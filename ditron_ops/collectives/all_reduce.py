"""``all_reduce``: every rank gets the sum of every rank's tensor.

Two schedules over the same push/combine kernel:

* one-shot (small tensors): push all of x to every rank, each rank sums all W slots::

      rank r: push x -> slot r everywhere | wait | out = slot0 + ... + slot{W-1}

* two-shot (large tensors): reduce-scatter of the flattened tensor, then all-gather of the
  reduced shards (W times less data per rank in the reduce, two kernel launches)::

      rank r: reduce_scatter(flat x) -> shard r | all_gather(shards) -> out

Both sum in rank order in fp32 with one rounding, and agree bitwise with each other.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._library import define_op, direct
from .._validation import check_tensor, memo
from ..deterministic import resolve_deterministic
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key
from ..runtime.split import split_sizes

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
_launch = lazy_import("._launch", globals())

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALGORITHMS = ("auto", "one_shot", "two_shot")
ONE_SHOT_MAX_BYTES = 256 * 1024  # default rule; the bench measures the crossover per machine


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """``auto`` rule: one-shot up to ``ONE_SHOT_MAX_BYTES`` (latency-bound), two-shot above."""
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES or world_size == 1 else "two_shot"


def all_reduce(x: torch.Tensor, group: Optional[Group] = None, *, algorithm: str = "auto",
               deterministic: Optional[bool] = None) -> torch.Tensor:
    """Sum over ranks; returns a new tensor (``x`` is not modified).

    Parameters
    ----------
    x : torch.Tensor
        Any shape, fp16/bf16/fp32, the same shape on every rank.
    group : Group, optional
    algorithm : {"auto", "one_shot", "two_shot"}
        ``auto`` picks by size (``choose_algorithm``); all ranks pick the same.
    deterministic : bool, optional
        Both modes sum in rank order in fp32 with one rounding (bitwise run to run, any
        algorithm). Results differ across world sizes.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same shape, dtype and algorithm.
    Runs on the current stream; calls on one group must be stream-ordered.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):
    ...     x = torch.full((5,), group.rank + 1.0, device=group.device)
    ...     return ditron_ops.all_reduce(x, group, deterministic=True).tolist()
    >>> ditron_ops.launch(body, 2)[0]
    [3.0, 3.0, 3.0, 3.0, 3.0]
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate() -> str:  # the algorithm to run
        check_tensor("all_reduce", "x", x, group, DTYPES)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"ditron.all_reduce: algorithm must be one of {ALGORITHMS}, got "
                             f"{algorithm!r}")
        chosen = (choose_algorithm(x.numel() * x.element_size(), group.world_size)
                  if algorithm == "auto" else algorithm)
        agree(group, "all_reduce", (("dtype", x.dtype), ("x.shape", tuple(x.shape)),
                                    ("algorithm", chosen), ("deterministic", flag)))
        return chosen

    chosen = memo(group, call_key("all_reduce", x, algorithm, flag), validate)
    if direct(x):
        return _all_reduce_impl(x, name, chosen, flag)
    return torch.ops.ditron.all_reduce(x, name, chosen, flag)


def _all_reduce_impl(x: torch.Tensor, group_name: str, algorithm: str, deterministic: bool) -> torch.Tensor:
    group = resolve_group(group_name)
    if not group.has_symmetric_memory:
        return reference.all_reduce(x, group)
    flat = x.reshape(-1)
    n = flat.numel()
    if algorithm == "one_shot":
        out = torch.empty_like(flat)
        _launch.push_combine(group, flat, out, op="all_reduce", split_src=False, reduce=True,
                             src_rows=n, row_elems=1, slot_elems=n)
        return out.view(x.shape)
    # Split in rows of 16 bytes when possible, so every shard boundary stays vector aligned.
    row = 16 // x.element_size() if n % (16 // x.element_size()) == 0 else 1
    sizes = [rows * row for rows in split_sizes(n // row, group.world_size)]
    shard = flat.new_empty((sizes[group.rank],))
    out = torch.empty_like(flat)
    flat = _launch.aligned(flat)
    # both plans before the first launch: nothing compiles once a kernel of the call waits
    # (their workspaces need the same bytes, so the second cannot grow the first's stale)
    scatter = _launch.combine_plan(group, flat, shard, op="all_reduce", split_src=True, reduce=True,
                                   src_rows=n // row, row_elems=row, slot_elems=max(sizes))
    gather = _launch.combine_plan(group, shard, out, op="all_reduce", split_src=False, reduce=False,
                                  src_rows=sizes[group.rank] // row, row_elems=row,
                                  slot_elems=max(sizes))
    _launch.run_plan(group, scatter, flat, shard, "all_reduce")
    _launch.run_plan(group, gather, shard, out, "all_reduce")
    return out.view(x.shape)


def _all_reduce_fake(x, group_name, algorithm, deterministic):
    return torch.empty_like(x)


define_op("all_reduce(Tensor x, str group_name, str algorithm, bool deterministic) -> Tensor",
          _all_reduce_impl, _all_reduce_fake)
