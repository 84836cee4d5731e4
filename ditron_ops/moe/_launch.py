"""Host side of the MoE exchange: the symmetric memory layout of a ``Buffer``, its private
scratch, the per-call plans (bound kernel launches) and the precompile list.

Symmetric allocation of one Buffer (offsets 256-byte aligned; W ranks, E experts, T = max tokens
per rank, k = top-k, H = hidden, CAP = receive capacity in rows)::

    signal   int64 [8 + 3W]        epochs, done counters, ready_d[W], ready_c[W], finish_c[W]
    counts   int32 [2][W][E + 4]   per parity: every source's counts and meta (pushed by it)
    sorted   int32 [2][T k]        per parity: this rank's entries in expert-major order
    weights  fp32  [2][T k]        per parity: this rank's routing weights
    tokens   bytes [2][T][H elem]  per parity: this rank's token rows (fp8 codes with fp8)
    scales   fp32  [2][T][H/128]   per parity (fp8 buffers only)
    y stage  bytes [CAP][row]      expert outputs in compact order, row = max(H elem, 4 k8) bytes
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from .. import _env
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from ._kernels import (META, SIG_HEAD, combine_kernel, dispatch_kernel, layout_atomic_kernel,
                       layout_chunk_kernel, layout_scan_kernel)

PURPOSE = "moe"
MAX_PROGRAMS = 32
"""Programs per rank of the waiting kernels on a GPU (DeepEP's kernels take 20-24 SMs); fewer
where W virtual ranks share the GPU: all ranks' programs must be resident together, and one SM
is left per rank for the layout kernels and small torch kernels queued in a graph before them."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# launch configurations (interpreter: small tiles, one program per rank)
GPU_DISPATCH = dict(BLOCK_R=16, BLOCK_H=1024, BLOCK_I=512, BLOCK_W=8, BLOCK_E=256, num_warps=8)
CPU_DISPATCH = dict(BLOCK_R=16, BLOCK_H=128, BLOCK_I=64, BLOCK_W=8, BLOCK_E=16, num_warps=4)
GPU_COMBINE = dict(BLOCK_R=16, BLOCK_T=8, BLOCK_H=512, BLOCK_E=256, KC=8, num_warps=8)
CPU_COMBINE = dict(BLOCK_R=16, BLOCK_T=16, BLOCK_H=128, BLOCK_E=16, KC=4, num_warps=4)
"""Tiles: a copy moves BLOCK_R rows x BLOCK_H elements per step (16 bf16 rows x 1024 = 32 KB in
flight per program, one program per SM); the combine reads KC slots of BLOCK_T tokens x BLOCK_H
at once (8 x 8 x 512 bf16 = 64 KB). Not tuned on hardware yet: ``python -m ditron_ops.bench moe``
reports GB/s against the copy bandwidth."""
GPU_CHUNK, CPU_CHUNK = 128, 32
"""Entries per program of the layout kernels (the deterministic pass compares every pair of a
chunk: CH^2 work per chunk)."""
GPU_HIST_E, CPU_HIST_E = 64, 16
GPU_SCAN, CPU_SCAN = (64, 32), (16, 16)
"""Layout scan tile: (chunks, experts) per step."""


def _gpu(device: torch.device) -> bool:
    return device.type == "cuda" and not _env.use_interpreter()


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def vec(dtype: torch.dtype, fp8: bool) -> int:
    """Elements per 16 bytes of the rows a kernel copies (fp8: bytes)."""
    return 16 if fp8 else 16 // torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class Regions:
    """Byte layout of one Buffer's symmetric allocation (see the module docstring)."""

    world_size: int
    num_experts: int
    max_tokens: int
    topk: int
    hidden: int
    dtype: torch.dtype
    fp8: bool
    capacity: int

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def sig_words(self) -> int:
        return SIG_HEAD + 3 * self.world_size

    @property
    def cnt_half(self) -> int:
        """int32 words of one parity's count table."""
        return self.world_size * (self.num_experts + META)

    @property
    def idx_half(self) -> int:
        return _align(self.max_tokens * self.topk, 4)

    @property
    def x_half_bytes(self) -> int:
        return _align(self.max_tokens * self.hidden * self.elem, 256)

    @property
    def s_half(self) -> int:
        """fp32 words of one parity's scales (fp8 buffers; 4 otherwise)."""
        return _align(self.max_tokens * (self.hidden // 128), 4) if self.fp8 else 4

    @property
    def y_row_bytes(self) -> int:
        """Bytes per row of the y staging: a row of the buffer's dtype, or the fp32 rows of the
        routing-weight gradient (``k`` rounded up to 8 columns)."""
        return _align(max(self.hidden * self.elem, 4 * _align(self.topk, 8)), 16)

    def offsets(self) -> dict[str, int]:
        sizes = [("sig", self.sig_words * 8), ("counts", 2 * self.cnt_half * 4),
                 ("sorted", 2 * self.idx_half * 4), ("weights", 2 * self.idx_half * 4),
                 ("tokens", 2 * self.x_half_bytes), ("scales", 2 * self.s_half * 4),
                 ("ystage", self.capacity * self.y_row_bytes)]
        out, at = {}, 0
        for name, nbytes in sizes:
            out[name] = at
            at = _align(at + nbytes, 256)
        out["total"] = at
        return out

    @property
    def nbytes(self) -> int:
        return self.offsets()["total"]

    def views(self, local: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of this rank's copy (``uint8 [nbytes]``)."""
        off = self.offsets()

        def view(name: str, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
            return local[off[name]: off[name] + nbytes].view(dtype)

        return {"sig": view("sig", self.sig_words * 8, torch.int64),
                "counts": view("counts", 2 * self.cnt_half * 4, torch.int32),
                "sorted": view("sorted", 2 * self.idx_half * 4, torch.int32),
                "weights": view("weights", 2 * self.idx_half * 4, torch.float32),
                "tokens": local[off["tokens"]: off["tokens"] + 2 * self.x_half_bytes],
                "scales": view("scales", 2 * self.s_half * 4, torch.float32),
                "ystage": local[off["ystage"]: off["ystage"] + self.capacity * self.y_row_bytes]}


class Scratch:
    """Per-Buffer device scratch of the layout (reused call after call: stream ordered)."""

    def __init__(self, regions: Regions, programs: int, device: torch.device):
        e, w = regions.num_experts, regions.world_size
        entries = regions.max_tokens * regions.topk
        ch = GPU_CHUNK if _gpu(device) else CPU_CHUNK
        self.chunk = ch
        self.chunks = max(1, -(-entries // ch))
        self.idx32 = torch.full((max(entries, 1),), -1, dtype=torch.int32, device=device)
        self.pos = torch.zeros(max(entries, 1), dtype=torch.int32, device=device)
        self.hist = torch.zeros(self.chunks * e, dtype=torch.int32, device=device)
        self.count = torch.zeros(e, dtype=torch.int32, device=device)
        self.bad = torch.full((1,), 2**63 - 1, dtype=torch.int64, device=device)
        el = e // w
        self.table_words = _align(4 * e + 3 * w * e + el + 2, 16)
        self.tables = torch.zeros(programs * self.table_words, dtype=torch.int32, device=device)
        self.dummy = torch.zeros(16, dtype=torch.float32, device=device)


def programs_per_rank(group: Group) -> int:
    """Programs of the waiting kernels on this rank (1 in the interpreter: it runs a grid's
    programs one after another, and a waiting program must not need a later one)."""
    if not _gpu(group.device):
        return 1
    return max(1, min(MAX_PROGRAMS, group.sm_share() - 1))


class DispatchPlan:
    """The bound launches of one dispatch variant of a Buffer: layout kernels (fresh layouts)
    and the dispatch kernel. Per call only the tensors and the token count change."""

    def __init__(self, buf, *, x_dtype: torch.dtype, idx_dtype, fp8: bool, round_scale: bool,
                 det: bool, has_w: bool, cached: bool, padded: bool, alignment: int, rows: int):
        group, reg, sc = buf.group, buf.regions, buf.scratch
        device = group.device
        gpu = _gpu(device)
        cfg = dict(GPU_DISPATCH if gpu else CPU_DISPATCH)
        self.det, self.cached = det, cached
        entries = reg.max_tokens * reg.topk
        views = buf.views
        record, claim = group._error_tensors()
        x_view = views["tokens"].view(torch.uint8 if fp8 else x_dtype)
        hid = reg.hidden
        self.layout = []
        if not cached:
            idx = torch.zeros(1, dtype=idx_dtype, device=device)
            grid = (sc.chunks,)
            if det:
                hist_e = GPU_HIST_E if gpu else CPU_HIST_E
                cb, eb = GPU_SCAN if gpu else CPU_SCAN
                self.layout.append(BoundKernel(
                    layout_chunk_kernel, grid,
                    (idx, sc.idx32, sc.pos, sc.hist, sc.bad, entries, reg.num_experts),
                    dict(CH=sc.chunk, EB=hist_e, num_warps=4), vary=("idx_ptr", "n_entries"),
                    device=device))
                self.layout.append(BoundKernel(
                    layout_scan_kernel, (-(-reg.num_experts // eb),),
                    (sc.hist, sc.count, entries, reg.num_experts),
                    dict(CH=sc.chunk, CB=cb, EB=eb, num_warps=4), vary=("n_entries",), device=device))
            else:
                self.layout.append(BoundKernel(
                    layout_atomic_kernel, grid,
                    (idx, sc.idx32, sc.pos, sc.count, sc.bad, entries, reg.num_experts),
                    dict(CH=sc.chunk, num_warps=4), vary=("idx_ptr", "n_entries"), device=device))
        # example per-call tensors: their 16-byte alignment is what the plan is built for
        x = torch.zeros(16, dtype=x_dtype, device=device)
        i32 = torch.zeros(16, dtype=torch.int32, device=device)
        out_x = torch.zeros(16, dtype=torch.uint8 if fp8 else x_dtype, device=device)
        self.kernel = BoundKernel(
            dispatch_kernel, (buf.programs,),
            (x, sc.dummy, i32, i32, out_x, sc.dummy, sc.dummy, i32, i32, i32, 0, 0, 0,
             sc.idx32, sc.pos, sc.hist, sc.count, sc.bad, sc.tables,
             views["sig"], buf.sym.ptr_table, views["counts"], views["sorted"], views["weights"],
             x_view, views["scales"], claim, record, buf.claim, buf.record,
             group.rank, group.world_size, reg.topk, reg.num_experts,
             reg.num_experts // group.world_size, reg.max_tokens, reg.capacity, hid, rows,
             reg.cnt_half, reg.idx_half, reg.x_half_bytes // x_view.element_size(), reg.s_half,
             sc.table_words, int(cached), int(padded), alignment, int(has_w), int(det),
             int(round_scale), group.timeout_us(), op_id("moe_dispatch")),
            dict(FP8=fp8, VEC=vec(x_dtype, fp8), CH=sc.chunk, **cfg),
            vary=("x_ptr", "w_ptr", "src_ptr", "dest_ptr", "out_x", "out_s", "out_w", "counts_ptr",
                  "offsets_ptr", "cstart_ptr", "n_tokens", "bad_kind", "bad_value"),
            device=device)

    def launch_layout(self, idx: torch.Tensor, n_entries: int) -> None:
        """The layout kernels (no waits): before ``waiting_launch``."""
        if self.det:
            self.layout[0].launch(idx, n_entries)
            self.layout[1].launch(n_entries)
        elif self.layout:
            self.layout[0].launch(idx, n_entries)


class CombinePlan:
    """The bound combine launch of one (Buffer, y dtype, hidden, weights) variant."""

    def __init__(self, buf, *, dtype: torch.dtype, hidden: int, has_w: bool):
        group, reg, sc = buf.group, buf.regions, buf.scratch
        device = group.device
        cfg = dict(GPU_COMBINE if _gpu(device) else CPU_COMBINE)
        record, claim = group._error_tensors()
        elem = torch.empty((), dtype=dtype).element_size()
        self.stage = buf.views["ystage"].view(dtype)
        self.stage_stride = reg.y_row_bytes // elem
        y = torch.zeros(16, dtype=dtype, device=device)
        i32 = torch.zeros(16, dtype=torch.int32, device=device)
        fp_opts = {"enable_fp_fusion": False}  # products and sums rounded apart (bitwise reference)
        self.kernel = BoundKernel(
            combine_kernel, (buf.programs,),
            (y, sc.dummy, i32, y, i32, i32, i32, 0, 1,
             buf.views["sig"], buf.sym.ptr_table, self.stage, claim, record,
             group.rank, group.world_size, reg.topk, reg.num_experts // group.world_size,
             reg.capacity, hidden, hidden, self.stage_stride, int(has_w), group.timeout_us(),
             op_id("moe_combine")),
            dict(VEC=vec(dtype, False), **cfg, **fp_opts),
            vary=("y_ptr", "w_ptr", "dest_ptr", "out_ptr", "counts_ptr", "offsets_ptr",
                  "cstart_ptr", "n_tokens", "copy_y"),
            device=device)


# ---- precompile ----------------------------------------------------------------------------------

class _OneRank:
    """Just enough of a Buffer for the plans, as a one-rank world (no wait can block)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, fp8: bool):
        from types import SimpleNamespace

        self.regions = Regions(1, 2, 4, 2, 128, dtype, fp8, 8)
        self.programs = MAX_PROGRAMS if _gpu(device) else 1
        local = torch.zeros(self.regions.nbytes, dtype=torch.uint8, device=device)
        self.sym = SimpleNamespace(local=local, ptr_table=pointer_table(local))
        self.views = self.regions.views(local)
        _, _, claim, record = one_rank_pad(device)
        self.claim, self.record = claim, record
        group = SimpleNamespace(device=device, rank=0, world_size=1, timeout_us=lambda: 10**7,
                                _error_tensors=lambda: (record, claim))
        self.group = group
        self.scratch = Scratch(self.regions, self.programs, device)


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """Every variant's plan on a one-rank world (``runtime.precompile``): layouts (both index
    dtypes, both modes), dispatch (every dtype with and without fp8, fresh and cached),
    combine (every dtype, in its own and in fp32)."""
    for dtype in (d for d in DTYPES if d in dtypes):
        for fp8 in (False, True):
            buf = _OneRank(device, dtype, fp8)
            for n, (idx_dtype, det) in enumerate(itertools.product(INDEX_DTYPES, (True, False))):
                DispatchPlan(buf, x_dtype=dtype, idx_dtype=idx_dtype, fp8=fp8, round_scale=False,
                             det=det, has_w=True, cached=False, padded=n % 2 == 1, alignment=1,
                             rows=8)
            DispatchPlan(buf, x_dtype=dtype, idx_dtype=None, fp8=fp8, round_scale=False,
                         det=False, has_w=True, cached=True, padded=False, alignment=1, rows=8)
            if not fp8:
                for y_dtype, width in ((dtype, buf.regions.hidden), (torch.float32, 8)):
                    CombinePlan(buf, dtype=y_dtype, hidden=width, has_w=True)


register_precompile(PURPOSE, _precompile, ("moe_dispatch", "moe_combine"))
