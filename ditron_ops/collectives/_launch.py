"""Host side of the push/combine collective kernel: workspace, sizes, grid, error checks."""
from __future__ import annotations

import functools

import torch

from .. import _env
from ..runtime.group import Group, op_id
from ._kernels import push_combine_kernel

PURPOSE = "collectives"
_MAX_PROGRAMS = 32


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_per_rank(group: Group) -> int:
    """Programs per rank, fixed per workspace; all ranks of a virtual world share one GPU's SMs,
    so their persistent grids together must stay co-resident."""
    if group.device.type != "cuda":
        return 1  # the interpreter runs programs one after another: one program per rank
    ranks_here = group.world_size if group.backend == "virtual" else 1
    return max(1, min(_MAX_PROGRAMS, _sm_count(group.device.index) // (2 * ranks_here)))


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (so the kernel has one specialization per dtype)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def push_combine(group: Group, src: torch.Tensor, out: torch.Tensor, *, op: str, split_src: bool,
                 reduce: bool, src_rows: int, row_elems: int, slot_elems: int) -> torch.Tensor:
    """Run one push/combine collective call on this rank's current stream.

    ``slot_elems`` is the largest element count any rank sends to one destination (rank-uniform).
    """
    group.check()
    ws = group.workspace(PURPOSE)
    if not hasattr(ws, "programs"):
        ws.programs = programs_per_rank(group)
    elem = src.element_size()
    data = ws.ensure_data(2 * group.world_size * max(slot_elems, 1) * elem)
    half_elems = data.nbytes // 2 // elem
    record, claim = group._error_tensors()
    block = 1024 if _env.use_interpreter() else 2048
    push_combine_kernel[(ws.programs,)](
        aligned(src), out, data.local.view(src.dtype), data.ptr_table, ws.signal_pad(),
        ws.signal.ptr_table, claim, record,
        group.rank, group.world_size, src_rows, row_elems, out.numel(), half_elems,
        group.timeout_ns(), op_id(op),
        SPLIT_SRC=split_src, REDUCE=reduce, BLOCK=block, num_warps=4)
    if _env.sync_check():
        group.synchronize()
    return out
