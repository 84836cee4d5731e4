"""Host side of ``all_reduce_rmsnorm``: the symmetric layout, block sizes, grid, plan, launch.

Symmetric data of the ``all_reduce_rmsnorm`` workspace (every region has two halves, one per
epoch parity; sizes from rank-uniform T, H, W only, so every rank computes the same layout)::

    x        [2][T*H]        x's dtype   every rank's input, read by every rank (one-shot) or
                                          by the rows' owners (two-shot)
    normed   [2][R*H]        x's dtype   two-shot: the owner's normed rows (R = ceil(T / W))
    residual [2][R*H]        x's dtype   two-shot: the owner's residual_out rows
    codes    [2][R*H]        e4m3        two-shot with quant
    scales   [2][R*G]        fp32        two-shot with quant (G = 1 or H / 128)
"""
from __future__ import annotations

import torch

from .. import _env
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel
from ._launch import aligned
from ._norm_kernels import ar_rmsnorm_kernel

PURPOSE = "all_reduce_rmsnorm"
_MAX_PROGRAMS = 32
MAX_BLOCK_H = 8192
"""Largest row chunk held in registers (16 warps: 16 fp32 values per thread and tensor); a wider
row is processed in chunks of ``MULTI_BLOCK_H`` (stored, then reread)."""
MULTI_BLOCK_H = 4096
QUANTS = {None: 0, "fp8_e4m3": 1, "fp8_e4m3_128": 2}


def block_config(cols: int) -> tuple[int, bool, int]:
    """``(BLOCK_H, ONE_CHUNK, num_warps)`` from H alone: every T (and both algorithms) runs the
    same reduction tree over H, which is what makes rows batch invariant."""
    block = max(128, 1 << (cols - 1).bit_length())  # >= 128: whole groups of 128 columns
    if block <= MAX_BLOCK_H:
        return block, True, max(4, min(16, block // 512))
    return MULTI_BLOCK_H, False, 8


def programs_per_rank(group: Group) -> int:
    """Programs per rank, fixed per workspace (the arrival counts are in programs): one per SM
    of this rank's share, so every rank's waiting programs are resident together."""
    if group.device.type != "cuda":
        return 1  # the interpreter runs a rank's programs one after another
    return max(1, min(_MAX_PROGRAMS, group.sm_share()))


def _half(count: int, elem: int) -> int:
    """Elements of one half of a region: ``count`` rounded up to 64 bytes (aligned halves)."""
    per = 64 // elem
    return max(per, -(-count // per) * per)


def run(group: Group, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float, two_shot: bool, quant, outs: tuple) -> tuple:
    """One call on this rank's current stream into ``outs`` (normed, residual_out, codes,
    scales); ``x``, ``residual`` and ``weight`` are made contiguous and 16-byte aligned."""
    group.check()
    x, residual, weight = aligned(x), aligned(residual), aligned(weight)
    rows, cols = x.shape
    key = ("all_reduce_rmsnorm", rows, cols, x.dtype, weight.dtype, float(eps), two_shot, quant)
    plan = group.plans.get(key, lambda previous=None: _NormPlan(
        group, rows, cols, x.dtype, weight.dtype, float(eps), two_shot, quant, previous))
    ws = plan.ws
    ws.calls += 1
    normed, res_out, codes, scales = outs
    if quant is None:
        codes, scales = plan.no_codes, plan.no_scales
    else:
        codes = codes.view(torch.uint8)  # the kernel writes e4m3 bytes (``_e4m3_bits``)
    with group.waiting_launch("all_reduce_rmsnorm", ws.calls):
        plan.kernel.launch(x, residual, weight, normed, res_out, codes, scales)
    if group.sync_check:
        group.synchronize()
    return outs


class _NormPlan:
    """The bound ``ar_rmsnorm_kernel`` launch of one key (T, H, dtypes, eps, algorithm, quant)."""

    def __init__(self, group: Group, rows: int, cols: int, dtype: torch.dtype,
                 wdtype: torch.dtype, eps: float, two_shot: bool, quant, previous=None):
        self.ws = ws = group.workspace(PURPOSE)
        if not hasattr(ws, "programs"):
            ws.programs = programs_per_rank(group)
        device, w = group.device, group.world_size
        elem = torch.empty((), dtype=dtype).element_size()
        groups = 1 if quant != "fp8_e4m3_128" else cols // 128
        owned = -(-rows // w) if two_shot else 0
        x_half = _half(rows * cols, elem)
        st_half = _half(owned * cols, 1)  # 64 elements: 64-byte halves for every region's dtype
        sc_half = _half(owned * groups, 4)
        sizes = [2 * x_half * elem, 2 * st_half * elem, 2 * st_half * elem, 2 * st_half,
                 2 * sc_half * 4]
        self.data = data = ws.ensure_data(sum(sizes))
        local, start, views = data.local, 0, []
        for nbytes, view in zip(sizes, (dtype, dtype, dtype, torch.uint8, torch.float32)):
            views.append(local[start:start + nbytes].view(view))
            start += nbytes
        if previous is not None:
            self.no_codes, self.no_scales = previous.no_codes, previous.no_scales
        else:  # stand-ins for the pointers a call without quant never touches
            self.no_codes = torch.empty(16, dtype=torch.uint8, device=device)
            self.no_scales = torch.empty(4, dtype=torch.float32, device=device)
        block, one_chunk, warps = block_config(cols)
        vec = 16 // elem if cols % (16 // elem) == 0 else 1
        record, claim = group._error_tensors()
        # the per-call tensors' stand-ins at build time (Triton specializes only on alignment)
        example = torch.empty(16, dtype=dtype, device=device)
        self.kernel = BoundKernel(
            ar_rmsnorm_kernel, (ws.programs,),
            (example, example, torch.empty(16, dtype=wdtype, device=device), example, example,
             self.no_codes, self.no_scales, *views, data.ptr_table,
             ws.signal_pad(), ws.signal.ptr_table, claim, record,
             group.rank, w, rows, cols, eps, x_half, st_half, sc_half, group.timeout_us(),
             op_id("all_reduce_rmsnorm")),
            dict(TWO_SHOT=two_shot, QUANT=QUANTS[quant], BLOCK_H=block, ONE_CHUNK=one_chunk,
                 VEC=vec, COPY_BLOCK=1024 if _env.use_interpreter() else 2048, num_warps=warps,
                 enable_fp_fusion=False),  # no FMA contraction: one arithmetic in every variant
            vary=("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "codes_ptr",
                  "scales_ptr"),
            device=device)

    def stale(self) -> bool:
        """The workspace grew since: the regions are views of a freed buffer."""
        return self.ws.data is not self.data
