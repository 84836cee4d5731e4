"""Host side of the MoE exchange: the symmetric memory layout of a ``Buffer``, its private
scratch, the per-call plans (bound kernel launches) and the precompile list.

Symmetric allocation of one Buffer (offsets 256-byte aligned; W ranks, E experts, T = max tokens
per rank, k = top-k, H = hidden, CAP = receive capacity in rows)::

    signal   int64 [8 + 3W]        epochs, done counters, in-place combine: y's offset and
                                   stride; ready_d[W], ready_c[W], finish_c[W]
    counts   int32 [2][W][E + 4]   per parity: every source's counts and meta (pushed by it)
    sorted   int32 [2][T k]        per parity: this rank's entries in expert-major order
    weights  fp32  [2][T k]        per parity: this rank's routing weights
    tokens   bytes [2][T][H elem]  per parity: this rank's token rows (fp8 codes with fp8)
    scales   fp32  [2][T][H/128]   per parity (fp8 buffers only)
    y stage  bytes [CAP][row]      expert outputs in compact order, row = max(H elem, 4 k8) bytes
    row map  int32 [CAP]           in-place combine: the row of y holding each compact row

Private scratch (``Scratch``): the layout's per-entry and per-chunk words, each program's count
tables, and the combine's routes (``int64 [T k]``: element offset of each entry's row).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from .. import _env
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from ._combine_kernels import combine_kernel
from ._kernels import (META, QUANT_DIV, QUANT_RCP, SIG_HEAD, dispatch_kernel, layout_atomic_kernel,
                       layout_chunk_kernel, layout_scan_kernel, quantize_kernel)

PURPOSE = "moe"
MAX_PROGRAMS = 32
"""Programs per rank of the waiting kernels on a GPU (DeepEP's kernels take 20-24 SMs); fewer
where W virtual ranks share the GPU: all ranks' programs must be resident together, and one SM
is left per rank for the layout kernels and small torch kernels queued in a graph before them."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# launch configurations: fixed parts here, tile sizes from the rules below (``dispatch_tiles``,
# ``combine_tiles``); the interpreter gets small tiles and one program per rank
GPU_DISPATCH = dict(BLOCK_I=512, BLOCK_W=8, BLOCK_E=256, num_warps=8)
CPU_DISPATCH = dict(BLOCK_I=64, BLOCK_W=8, BLOCK_E=16, num_warps=4)
GPU_CHUNK, CPU_CHUNK = 128, 32
"""Entries per program of the layout kernels (the deterministic pass compares every pair of a
chunk: CH^2 work per chunk)."""
GPU_CHUNK_J, CPU_CHUNK_J = 8, 8
"""Entries the deterministic chunk pass compares with the whole chunk per step: a [CH, JB]
tile (registers: the pass must fit on an SM beside a dispatch program, ``layout_chunk_kernel``)."""
GPU_HIST_E, CPU_HIST_E = 64, 16
"""Experts per step of the chunk histogram's zero fill."""
GPU_SCAN, CPU_SCAN = (64, 32), (16, 16)
"""Layout scan tile: (chunks, experts) per step."""

FP8_VARIANTS = ("div", "rcp", "split")
"""How an fp8 dispatch quantizes (``Buffer._fp8_variant``; measured against each other by
the bench): ``div`` an IEEE division per value in the dispatch kernel's staging loop, ``rcp``
the group's reciprocal and two corrections there (``_kernels._quotient``), ``split`` ``rcp``
in a kernel of its own before the dispatch kernel (``quantize_kernel``). The same codes and
scales, bit for bit, for any tokens (groups with +-inf or NaN included: the same NaN codes)."""
FP8_SPLIT_MIN_VALUES = 1 << 22
"""The fp8 variant a Buffer uses (``fp8_variant``): ``split`` from this many token values per
rank (``max_tokens_per_rank x hidden``; 4M: from 586 tokens of 7168), ``rcp`` below. Why: the
separate quantization pass pays for its launch and second read only with many tokens (the
measured crossover, ``bench moe --only tokens``, lies between 512 and 1024 tokens of 7168;
figures in benchmarks/NOTES.md, moe). Per Buffer, not per call, so every plan a Buffer runs is
built before its first wait: a Buffer sized for prefill runs ``split`` on small decode batches
too; size a decode Buffer of its own."""
GPU_QUANT_VALUES, CPU_QUANT_VALUES = 4096, 512
"""Values per ``quantize_kernel`` tile (``split``): 4 warps, 32 values a thread, like a
thread's share of the fused loop's tile, in many small programs (the interpreter: small, so
the tests' 6 tokens of 256 channels are 3 tiles, 2 on one program)."""
GPU_QUANT_WARPS, GPU_QUANT_REGS = 4, 64
"""``quantize_kernel``: 4 warps, at most 64 registers a thread (``maxnreg``): the grid-stride
loop's bookkeeping took 66-72 (allocated as 72: 7 programs an SM, not 8); capped, sm_90a
shows no spills and about the same instructions (``tools/sm90_compile.py``)."""
GPU_QUANT_PER_SM, CPU_QUANT_PROGRAMS = 8, 2
"""``quantize_kernel`` programs P: 8 per SM of the rank's share (8 x 4 warps x 64 registers:
an SM's registers, 32 warps), fewer when the token bound has fewer tiles; program p quantizes the
call's tiles p, p + P, ... Why: one program per tile of the bound left most of them idle at
small token counts (7168 programs for 128 tokens of a 4096 bound). The interpreter's 2
programs stride too."""

GPU_WARPS_COMBINE = 16
"""Warps per combine program: with one program per SM, 16 warps that never wait for each
other in the summing loop keep 16 x 32 x (up to 8 slots) row loads of 16 bytes in flight."""
ROWS_IN_FLIGHT = 8
"""Row loads of 16 bytes each combine thread keeps in flight per step (slots x repeats)."""
SPREAD = 8
"""Combine work units per program wanted: fewer token blocks than that split the hidden
dimension into segments (balance at small token counts)."""


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def hidden_block(width: int, elem: int, max_bytes: int, floor: int = 0) -> int:
    """Columns per kernel step over rows of ``width`` elements of ``elem`` bytes: the widest
    power of two of at most ``max_bytes`` whose steps pad a row by at most 1/8 (hidden 7168:
    1024, seven exact steps, rather than four of 2048 with the last half empty), at least 16
    bytes and at least ``floor`` elements."""
    low = max(16 // elem, floor, 1)
    block = max(low, min(_pow2_ceil(width), _pow2_floor(max_bytes // elem)))
    while block > low and (-(-width // block) * block - width) * 8 > width:
        block //= 2
    return block


def _rows_for(bytes_per_step: int, row_bytes: int, most: int = 64) -> int:
    """Rows per step so one step moves about ``bytes_per_step`` (a power of two, 1..most)."""
    return max(1, min(most, _pow2_floor(max(1, bytes_per_step // row_bytes))))


def dispatch_tiles(hidden: int, x_elem: int, fp8: bool, gpu: bool) -> dict:
    """Tiles of the dispatch kernel, a rule over the row size (bytes per step, not a shape table):

    * receive (``BLOCK_R`` rows x ``BLOCK_H`` staged elements, fp8 with the rows' scales in the
      same step): about 32 KB per step on a GPU (8 warps: 128 bytes in flight per thread),
      whatever the element size, so an fp8 row block costs the steps a bf16 one does, not twice;
    * staging (``BLOCK_SR`` x ``BLOCK_SH``): a bf16 copy like the receive; fp8 quantization
      8K values per step (32 fp32 registers a thread), whole 128-channel groups.
    """
    staged = 1 if fp8 else x_elem
    step = 32768 if gpu else 4096
    floor = 128 if fp8 else 0
    bh = hidden_block(hidden, staged, 4096 if gpu else 512, floor)
    tiles = dict(BLOCK_H=bh, BLOCK_R=_rows_for(step, bh * staged))
    if fp8:
        sh = hidden_block(hidden, x_elem, (4096 if gpu else 512) * x_elem, 128)
        tiles.update(BLOCK_SH=sh, BLOCK_SR=_rows_for((8192 if gpu else 1024) * x_elem, sh * x_elem))
    else:
        tiles.update(BLOCK_SH=bh, BLOCK_SR=tiles["BLOCK_R"])
    return tiles


def combine_tiles(hidden: int, elem: int, topk: int, max_tokens: int, gpu: bool) -> dict:
    """Tiles of the combine kernel, a rule over (row size, top-k, token bound):

    * summing step: ``BLOCK_T`` tokens x ``BLOCK_H`` columns per slot, one 16-byte load per
      thread per slot (repeated when k < ``ROWS_IN_FLIGHT``), slots loaded ``KC`` at a time
      (at most 8: registers) before they are added in k order; ``BLOCK_H`` from
      ``hidden_block`` (no mostly-empty last chunk), the rest of the tile in tokens;
    * routes: ``UNITS`` units' entries per step of the routing pass (2048 lanes on a GPU);
    * staging copy (multi-process backends): about 64 KB per step;
    * row map (in place): ``BLOCK_F`` rows per step, expert search ``BLOCK_S`` wide.
    """
    vec = 16 // elem
    kc = min(topk, ROWS_IN_FLIGHT)
    lanes = 32 * GPU_WARPS_COMBINE if gpu else 64
    tile = lanes * vec * max(1, ROWS_IN_FLIGHT // kc)
    bh = hidden_block(hidden, elem, tile * elem)
    bt = max(1, min(tile // bh, 64, _pow2_ceil(max_tokens)))
    kp = _pow2_ceil(topk)
    units = max(1, _pow2_floor((2048 if gpu else 256) // (bt * kp)))
    bc = hidden_block(hidden, elem, 4096 if gpu else 512)
    return dict(TOPK=topk, KP=kp, KC=kc, BLOCK_T=bt, BLOCK_H=bh, UNITS=units, SPREAD=SPREAD,
                BLOCK_C=bc, BLOCK_R=_rows_for(65536 if gpu else 4096, bc * elem),
                BLOCK_F=512 if gpu else 64, BLOCK_S=32 if gpu else 16,
                num_warps=GPU_WARPS_COMBINE if gpu else 4)


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
                 ("ystage", self.capacity * self.y_row_bytes), ("rowmap", self.capacity * 4)]
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
                "ystage": local[off["ystage"]: off["ystage"] + self.capacity * self.y_row_bytes],
                "rowmap": view("rowmap", self.capacity * 4, torch.int32)}


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
        self.route = torch.zeros(max(entries, 1), dtype=torch.int64, device=device)


def fp8_variant(max_tokens: int, hidden: int) -> str:
    """The quantization variant of an fp8 Buffer (``FP8_SPLIT_MIN_VALUES``): fixed per Buffer,
    so every rank of a group picks the same one and every plan is built before a wait."""
    return "split" if max_tokens * hidden >= FP8_SPLIT_MIN_VALUES else "rcp"


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
                 det: bool, has_w: bool, cached: bool, padded: bool, alignment: int, rows: int,
                 variant: str):
        if variant not in FP8_VARIANTS:
            raise ValueError(f"moe dispatch: fp8 variant {variant!r} is not one of {FP8_VARIANTS}")
        group, reg, sc = buf.group, buf.regions, buf.scratch
        device = group.device
        gpu = _gpu(device)
        cfg = dict(GPU_DISPATCH if gpu else CPU_DISPATCH)
        cfg.update(dispatch_tiles(reg.hidden, torch.empty((), dtype=x_dtype).element_size(), fp8, gpu))
        self.tiles = cfg
        self.det, self.cached = det, cached
        entries = reg.max_tokens * reg.topk
        views = buf.views
        record, claim = group._error_tensors()
        x_view = views["tokens"].view(torch.uint8 if fp8 else x_dtype)
        hid = reg.hidden
        split = fp8 and variant == "split"
        quant = QUANT_RCP if fp8 and variant != "div" else QUANT_DIV
        self.layout = []
        if not cached:
            idx = torch.zeros(1, dtype=idx_dtype, device=device)
            grid = (sc.chunks,)
            if det:
                hist_e = GPU_HIST_E if gpu else CPU_HIST_E
                jb = GPU_CHUNK_J if gpu else CPU_CHUNK_J
                cb, eb = GPU_SCAN if gpu else CPU_SCAN
                self.layout.append(BoundKernel(
                    layout_chunk_kernel, grid,
                    (idx, sc.idx32, sc.pos, sc.hist, sc.bad, entries, reg.num_experts),
                    dict(CH=sc.chunk, JB=jb, EB=hist_e, num_warps=4), vary=("idx_ptr", "n_entries"),
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
            dict(FP8=fp8, VEC=vec(x_dtype, fp8), CH=sc.chunk, QUANT=quant, STAGE=not split, **cfg),
            vary=("x_ptr", "w_ptr", "src_ptr", "dest_ptr", "out_x", "out_s", "out_w", "counts_ptr",
                  "offsets_ptr", "cstart_ptr", "n_tokens", "bad_kind", "bad_value"),
            device=device)
        self.stage = None
        if split:  # built (compiled) with the plan, before any dispatch kernel is launched
            bh = cfg["BLOCK_SH"]
            br = _rows_for(GPU_QUANT_VALUES if gpu else CPU_QUANT_VALUES, bh)
            tiles = max(1, -(-reg.max_tokens // br) * -(-hid // bh))
            most = GPU_QUANT_PER_SM * group.sm_share() if gpu else CPU_QUANT_PROGRAMS
            self.stage = BoundKernel(
                quantize_kernel, (min(tiles, most),),
                (x, views["sig"], x_view, views["scales"], 0, hid, reg.x_half_bytes, reg.s_half,
                 int(round_scale)),
                dict(QUANT=quant, VEC=vec(x_dtype, fp8), BLOCK_R=br, BLOCK_H=bh,
                     **(dict(num_warps=GPU_QUANT_WARPS, maxnreg=GPU_QUANT_REGS) if gpu
                        else dict(num_warps=CPU_DISPATCH["num_warps"]))),
                vary=("x_ptr", "n_tokens"), device=device)

    def launch_layout(self, idx: torch.Tensor, n_entries: int) -> None:
        """The layout kernels (no waits): before ``waiting_launch``."""
        if self.det:
            self.layout[0].launch(idx, n_entries)
            self.layout[1].launch(n_entries)
        elif self.layout:
            self.layout[0].launch(idx, n_entries)

    def launch_stage(self, x: torch.Tensor, n_tokens: int) -> None:
        """``split``: the quantization kernel (no waits), before ``waiting_launch``."""
        if self.stage is not None:
            self.stage.launch(x, n_tokens)


class CombinePlan:
    """The bound combine launch of one (Buffer, y dtype, hidden, weights, in place) variant.

    ``in_place``: peers read each rank's expert outputs where they are (``y`` itself, through
    the row map), which needs every rank's kernels to address every rank's tensors (a virtual
    world); else each rank first copies its outputs into its symmetric staging (unless ``y``
    is that staging already, ``Buffer.combine_input``)."""

    def __init__(self, buf, *, dtype: torch.dtype, hidden: int, has_w: bool, in_place: bool):
        group, reg, sc = buf.group, buf.regions, buf.scratch
        device = group.device
        gpu = _gpu(device)
        elem = torch.empty((), dtype=dtype).element_size()
        cfg = combine_tiles(hidden, elem, reg.topk, reg.max_tokens, gpu)
        self.tiles, self.in_place = cfg, in_place
        record, claim = group._error_tensors()
        self.stage = buf.views["ystage"].view(dtype)
        self.stage_stride = reg.y_row_bytes // elem
        y = torch.zeros(16, dtype=dtype, device=device)
        i32 = torch.zeros(16, dtype=torch.int32, device=device)
        fp_opts = {"enable_fp_fusion": False}  # products and sums rounded apart (bitwise reference)
        self.kernel = BoundKernel(
            combine_kernel, (buf.programs,),
            (y, sc.dummy, i32, y, i32, i32, i32, 0, 1, hidden,
             sc.route, buf.views["sig"], buf.sym.ptr_table, self.stage, buf.views["rowmap"],
             claim, record, group.rank, group.world_size, reg.num_experts // group.world_size,
             reg.capacity, hidden, self.stage_stride, int(has_w), group.timeout_us(),
             op_id("moe_combine")),
            dict(IN_PLACE=in_place, VEC=vec(dtype, False), **cfg, **fp_opts),
            vary=("y_ptr", "w_ptr", "dest_ptr", "out_ptr", "counts_ptr", "offsets_ptr",
                  "cstart_ptr", "n_tokens", "copy_y", "y_stride"),
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
    combine (every dtype, in its own and in fp32, in place and staged). Tile sizes follow the
    shapes (``dispatch_tiles``, ``combine_tiles``): a Buffer of other sizes compiles its own
    variants when its plans are built (before any launch). fp8: the two variants Buffers pick
    (``fp8_variant``), not ``div``, which only a caller that sets it runs."""
    for dtype in (d for d in DTYPES if d in dtypes):
        for fp8, variant in ((False, "div"), (True, "rcp"), (True, "split")):  # (``fp8_variant``'s)
            buf = _OneRank(device, dtype, fp8)
            for n, (idx_dtype, det) in enumerate(itertools.product(INDEX_DTYPES, (True, False))):
                DispatchPlan(buf, x_dtype=dtype, idx_dtype=idx_dtype, fp8=fp8, round_scale=False,
                             det=det, has_w=True, cached=False, padded=n % 2 == 1, alignment=1,
                             rows=8, variant=variant)
            DispatchPlan(buf, x_dtype=dtype, idx_dtype=None, fp8=fp8, round_scale=False,
                         det=False, has_w=True, cached=True, padded=False, alignment=1, rows=8,
                         variant=variant)
            if not fp8:
                for (y_dtype, width), in_place in itertools.product(
                        ((dtype, buf.regions.hidden), (torch.float32, 8)), (True, False)):
                    CombinePlan(buf, dtype=y_dtype, hidden=width, has_w=True, in_place=in_place)


register_precompile(PURPOSE, _precompile, ("moe_dispatch", "moe_combine"))
