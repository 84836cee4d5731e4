"""Host side of ``all_reduce_rmsnorm``: the symmetric layout, block sizes, grid, plan, launch.

The data buffer of the ``all_reduce_rmsnorm`` workspace is two halves at fixed places, one per
epoch parity: half ``p`` is bytes ``[p * half_bytes, (p + 1) * half_bytes)`` with ``half_bytes
= capacity // 2``. The halves depend on the workspace's capacity alone, never on T, H or the
algorithm, and a call of epoch ``e`` reads and writes only inside half ``e % 2``. Inside a half
the regions follow each other from offset 0, each rounded up to 64 bytes (sizes from
rank-uniform T, H, W only, so every rank computes the same layout)::

    x        [T*H]    x's dtype   every rank's input, read by every rank (one-shot) or by the
                                  rows' owners (two-shot)
    normed   [R*H]    x's dtype   two-shot: the owner's normed rows (R = ceil(T / W))
    residual [R*H]    x's dtype   two-shot: the owner's residual_out rows
    codes    [R*H]    e4m3        two-shot with quant
    scales   [R*G]    fp32        two-shot with quant (G = 1 or H / 128)

Why fixed halves: a rank that finished call ``e`` starts call ``e + 1`` while a slower peer may
still read its half ``e % 2``; call ``e + 1`` must then stay out of it, whatever its T or
algorithm (halves sized per call overlapped when T changed). Capacity only grows
(``Workspace.ensure_data``: the stream synchronized and every rank met first, so no kernel uses
the old buffer); a plan built before the growth is stale and is rebuilt over the new halves
(``stale``), so every plan of a workspace uses the same ``half_bytes``. Every rank asks for the
same bytes in the same call (rank-uniform plan keys in the same order), so capacities agree.

The signal pad is the workspace's, with this op's own word layout (the size words sit at
``4W + 2``, not at ``Workspace``'s generic ``[W, 3W)``): ``_norm_kernels``' docstring.
"""
from __future__ import annotations

import itertools

import torch

from .. import _env
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from ._launch import aligned
from ._norm_kernels import ar_rmsnorm_kernel
from .all_reduce_rmsnorm import MAX_ELEMS

PURPOSE = "all_reduce_rmsnorm"
_MAX_PROGRAMS = 32
MAX_BLOCK_H = 8192
"""Largest row chunk held in registers (16 warps: 16 fp32 values per thread and tensor); a wider
row is processed in chunks of ``MULTI_BLOCK_H`` (stored, then reread)."""
MULTI_BLOCK_H = 4096
QUANTS = {None: 0, "fp8_e4m3": 1, "fp8_e4m3_128": 2}
_ALIGN = 64  # bytes: every region starts 64-byte aligned (16-byte vectors, any dtype)


def copy_block() -> int:
    """``copy_tiles``' tile (elements)."""
    return 1024 if _env.use_interpreter() else 2048


# copy_tiles steps its 32-bit offset by programs * COPY_BLOCK past the count: the op's element
# limit leaves that much room below 2**31 (``all_reduce_rmsnorm.MAX_ELEMS``)
assert MAX_ELEMS + _MAX_PROGRAMS * 2048 <= 2**31 - 1


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


def half_layout(rows: int, cols: int, elem: int, world_size: int, two_shot: bool,
                quant) -> tuple[list[int], list[int], int]:
    """``(offsets, sizes, need)``: byte offsets and sizes inside one half of the regions x,
    normed, residual, codes, scales (module docstring) and the bytes a half needs. Every
    region is at least 64 bytes (a form's unused region too: no kernel argument is an empty
    tensor, whose address may be null)."""
    owned = -(-rows // world_size) if two_shot else 0
    quant_rows = owned if quant is not None else 0
    groups = cols // 128 if quant == "fp8_e4m3_128" else 1
    sizes = [max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN) for nbytes in (
        rows * cols * elem, owned * cols * elem, owned * cols * elem, quant_rows * cols,
        quant_rows * groups * 4)]
    offsets, start = [], 0
    for nbytes in sizes:
        offsets.append(start)
        start += nbytes
    return offsets, sizes, start


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
        offsets, sizes, need = half_layout(rows, cols, elem, w, two_shot, quant)
        self.data = data = ws.ensure_data(2 * need)
        # the halves from the capacity alone (module docstring); half 1 = half 0 + half_bytes
        half_bytes = data.nbytes // 2 // 128 * 128
        assert half_bytes >= need
        local = data.local
        views = [local[start:start + nbytes].view(view) for start, nbytes, view in
                 zip(offsets, sizes, (dtype, dtype, dtype, torch.uint8, torch.float32))]
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
             group.rank, w, rows, cols, eps, half_bytes, group.timeout_us(),
             op_id("all_reduce_rmsnorm")),
            dict(TWO_SHOT=two_shot, QUANT=QUANTS[quant], BLOCK_H=block, ONE_CHUNK=one_chunk,
                 VEC=vec, COPY_BLOCK=copy_block(), num_warps=warps,
                 enable_fp_fusion=False),  # no FMA contraction: one arithmetic in every variant
            vary=("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "codes_ptr",
                  "scales_ptr"),
            device=device)

    def stale(self) -> bool:
        """The workspace grew since: the regions and halves are of a freed buffer."""
        return self.ws.data is not self.data


PRECOMPILE_COLS = (2048, 4096, 8192, 12288)
"""H whose block configurations ``precompile`` builds: BLOCK_H 2048, 4096 and 8192 in one chunk
(8192 serves every H in 4097..8192: 5120, 7168, 8192) and the chunked rows above 8192; each
with 16-byte vectors (H a multiple of 8), the weight in x's dtype, both algorithms and the three
quant modes (24 variants per dtype). Other H compile on their first call."""


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """The ``PRECOMPILE_COLS`` variants of every dtype as one-rank launches
    (``runtime.precompile``)."""
    sig, sig_table, claim, record = one_rank_pad(device)
    for dtype in (d for d in (torch.float16, torch.bfloat16, torch.float32) if d in dtypes):
        elem = torch.empty((), dtype=dtype).element_size()
        buf = torch.zeros(4096, dtype=dtype, device=device)
        buf_table = pointer_table(buf)
        codes = torch.zeros(64, dtype=torch.uint8, device=device)
        scales = torch.zeros(16, dtype=torch.float32, device=device)
        for cols, two_shot, quant in itertools.product(PRECOMPILE_COLS, (False, True), QUANTS):
            block, one_chunk, warps = block_config(cols)
            BoundKernel(ar_rmsnorm_kernel, (_MAX_PROGRAMS,),
                        (buf, buf, buf, buf, buf, codes, scales, buf, buf, buf, codes, scales,
                         buf_table, sig, sig_table, claim, record, 0, 1, 1, cols, 1e-6, 4096,
                         10**7, 0),
                        dict(TWO_SHOT=two_shot, QUANT=QUANTS[quant], BLOCK_H=block,
                             ONE_CHUNK=one_chunk, VEC=16 // elem, COPY_BLOCK=copy_block(),
                             num_warps=warps, enable_fp_fusion=False),
                        device=device)


register_precompile(PURPOSE, _precompile, ("all_reduce_rmsnorm",))
