"""Host side of the push/combine collective kernel: workspace, sizes, grid, error checks."""
from __future__ import annotations

import itertools

import torch

from .. import _env
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from ._kernels import push_combine_kernel

PURPOSE = "collectives"
_MAX_PROGRAMS = 32


def programs_per_rank(group: Group) -> int:
    """Programs per rank, fixed per workspace; all ranks of a virtual world share one GPU's SMs,
    so their persistent grids together must stay co-resident."""
    if group.device.type != "cuda":
        return 1  # the interpreter runs programs one after another: one program per rank
    return max(4, min(_MAX_PROGRAMS, 2 * group.sm_share()))


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (so the kernel has one specialization per dtype)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def push_combine(group: Group, src: torch.Tensor, out: torch.Tensor, *, op: str, split_src: bool,
                 reduce: bool, src_rows: int, row_elems: int, slot_elems: int) -> torch.Tensor:
    """Run one push/combine collective call on this rank's current stream.

    ``slot_elems`` is the largest element count any rank sends to one destination (rank-uniform).
    Copies vectorize (``VEC`` = 16 bytes of elements) when every row length is a multiple of it;
    the choice depends only on rank-uniform sizes, so all ranks agree. Everything but the launch
    comes from the call's plan.
    """
    src = aligned(src)
    plan = combine_plan(group, src, out, op=op, split_src=split_src, reduce=reduce,
                        src_rows=src_rows, row_elems=row_elems, slot_elems=slot_elems)
    return run_plan(group, plan, src, out, op)


def combine_plan(group: Group, src: torch.Tensor, out: torch.Tensor, *, op: str, split_src: bool,
                 reduce: bool, src_rows: int, row_elems: int, slot_elems: int):
    """The plan of a ``push_combine`` call (``src`` already ``aligned``): a call of several
    launches gets all its plans first, so it compiles nothing once its first kernel waits."""
    if out.data_ptr() % 16:
        raise ValueError(f"ditron.{op}: the output must be 16-byte aligned")
    key = (op, "push_combine", split_src, reduce, src.dtype, src_rows, row_elems, out.numel(),
           slot_elems)
    return group.plans.get(key, lambda previous=None: _PushCombinePlan(  # (allocates nothing)
        group, src, out, op, split_src, reduce, src_rows, row_elems, slot_elems))


def run_plan(group: Group, plan, src: torch.Tensor, out: torch.Tensor, op: str) -> torch.Tensor:
    """Launch ``plan`` (from ``combine_plan``) over ``src`` into ``out``."""
    group.check()
    ws = plan.ws
    ws.calls += 1
    with group.waiting_launch(op, ws.calls):
        plan.kernel.launch(src, out)
    if group.sync_check:
        group.synchronize()
    return out


class _PushCombinePlan:
    """The bound ``push_combine_kernel`` launch of one key (sizes, dtype, variant)."""

    def __init__(self, group: Group, src, out, op, split_src, reduce, src_rows, row_elems,
                 slot_elems):
        self.ws = ws = group.workspace(PURPOSE)
        if not hasattr(ws, "programs"):
            ws.programs = programs_per_rank(group)
        elem = src.element_size()
        # VEC and the slot layout depend only on rank-uniform sizes: every rank must agree on them.
        vec = 16 // elem if row_elems % (16 // elem) == 0 else 1
        slot_elems = -(-max(slot_elems, 1) // 16) * 16
        self.data = data = ws.ensure_data(2 * group.world_size * slot_elems * elem)
        half_elems = data.nbytes // 2 // elem
        slot_elems = half_elems // group.world_size // 16 * 16
        record, claim = group._error_tensors()
        self.kernel = BoundKernel(
            push_combine_kernel, (ws.programs,),
            (src, out, data.local.view(src.dtype), data.ptr_table, ws.signal_pad(),
             ws.signal.ptr_table, claim, record, group.rank, group.world_size, src_rows, row_elems,
             out.numel(), half_elems, slot_elems, group.timeout_us(), op_id(op)),
            dict(SPLIT_SRC=split_src, REDUCE=reduce, BLOCK=_block(), VEC=vec, num_warps=4),
            vary=("src_ptr", "out_ptr"), device=src.device)

    def stale(self) -> bool:
        """The workspace grew since: the slot layout (``half_elems``) is of a freed buffer."""
        return self.ws.data is not self.data


def _block() -> int:
    return 1024 if _env.use_interpreter() else 2048


VARIANTS = ((False, False), (True, True), (False, True))  # gather, reduce-scatter, one-shot reduce
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """Every (dtype, variant, VEC) as a one-rank launch (``runtime.precompile``)."""
    sig, sig_table, claim, record = one_rank_pad(device)
    for dtype in (d for d in DTYPES if d in dtypes):
        buf = torch.zeros(4096, dtype=dtype, device=device)
        buf_table = pointer_table(buf)
        src = torch.ones(64, dtype=dtype, device=device)
        out = torch.empty_like(src)
        for (split_src, reduce), vec in itertools.product(VARIANTS, (1, 16 // src.element_size())):
            BoundKernel(push_combine_kernel, (_MAX_PROGRAMS,),
                        (src, out, buf, buf_table, sig, sig_table, claim, record,
                         0, 1, 64 // vec, vec, 64, 2048, 1024, 10**7, 0),
                        dict(SPLIT_SRC=split_src, REDUCE=reduce, BLOCK=_block(), VEC=vec,
                             num_warps=4), device=device)


register_precompile(PURPOSE, _precompile, ("all_gather", "reduce_scatter", "all_reduce"))
