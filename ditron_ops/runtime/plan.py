"""Per-call plans (DESIGN.md §11): what a call builds once and reuses while its key repeats.

A plan holds everything of an op's call that depends only on the plan key — tile
configuration, grid, workspace views, bound kernel launches (``launcher.BoundKernel``) — so
that the eager call does only the per-call work: a lookup, the launches, and the arguments that
change (the tensors' addresses). Keys hold the op, its flags, dtypes, shapes, strides and the
16-byte alignment of the tensors the kernels see (Triton specializes on it), never their
addresses: descriptors over changing tensors are converted per address inside the bound launch.

Each group owns one ``PlanCache`` (bounded LRU), dropped with the group; a miss during CUDA-graph
capture raises, as a new workspace does (build before capturing). A plan that views a workspace
records the buffer it viewed and is rebuilt when the workspace grew (``Plan.stale``): its builder
then gets the stale plan as ``previous`` and takes over its own buffers (padded copies, scratch),
so the rebuild allocates nothing and may run during capture (another op's warm-up can grow a
shared workspace after this op's plan was built).

A build is the first use of a key, and the only place a call compiles: it runs inside
``compiler.batch``, which compiles the plan's kernels in parallel and loads them before the
plan is returned, so every kernel a call launches is ready before the call's first launch (a
repeated call finds its plan and does nothing new). A key's first element names the op in the
progress line.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional, TypeVar

import torch

from ..errors import DitronError
from . import compiler
from .tracing import tracing

PLAN_CAPACITY = 128
"""Plans kept per group (LRU): shapes a model calls an op with are few per layer type."""

P = TypeVar("P")


class PlanCache:
    """Bounded LRU of one group's plans.

    Attributes
    ----------
    builds : int
        Plans built so far (tests count them: a repeated call builds nothing).
    """

    def __init__(self, group, capacity: int = PLAN_CAPACITY):
        self.group, self.capacity = group, capacity  # group None: a process-wide cache
        self._plans: OrderedDict = OrderedDict()
        self.builds = 0
        self._timeout_s = group.timeout_s if group is not None else None  # the plans' wait bound

    def get(self, key: Hashable, build: Callable[..., P]) -> P:
        """The plan of ``key``: built with ``build()`` on a miss (a miss during CUDA-graph
        capture raises ``DitronError``), rebuilt with ``build(previous=stale_plan)`` when the
        cached one is stale. A group whose ``timeout_s`` changed gets new plans (they bind
        the bound into their kernels' arguments)."""
        if self.group is not None and self.group.timeout_s != self._timeout_s:
            self._plans.clear()
            self._timeout_s = self.group.timeout_s
        plan = self._plans.get(key)
        if plan is not None:
            if getattr(plan, "stale", _fresh)():
                with compiler.batch(str(key[0])):
                    plan = self._plans[key] = build(previous=plan)
                self.builds += 1
            self._plans.move_to_end(key)
            return plan
        what = f"builds a plan for {key[0]} with new shapes"
        if self.group is not None:
            self.group.refuse_during_capture(what)
        elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise DitronError(f"ditron: {what} during CUDA-graph capture; run it once with the "
                              "same shapes before capturing")
        with compiler.batch(str(key[0])):
            plan = build()
        self.builds += 1
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def _fresh() -> bool:
    return False


def tensor_key(t) -> tuple:
    """What a plan key holds of a tensor argument: dtype, device index, shape, strides, 16-byte
    alignment (``None`` for an absent optional tensor)."""
    if t is None:
        return None
    return (t.dtype, t.get_device(), t.shape, t.stride(), t.data_ptr() % 16 == 0)


def call_key(*parts) -> Optional[tuple]:
    """A validation key of a public call: ``parts`` with every tensor as its ``tensor_key`` and
    lists as tuples; None when a part is unhashable, and under torch.compile (traced tensors have
    no address; the checks run once, at trace time)."""
    if tracing():
        return None
    key = tuple(tensor_key(p) if isinstance(p, torch.Tensor) else
                tuple(p) if isinstance(p, list) else p for p in parts)
    try:
        hash(key)
    except TypeError:  # an unhashable argument: no memo (the checks raise if it is wrong)
        return None
    return key
