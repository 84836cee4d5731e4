"""Host side of ag_gemm: tile configuration, TMA descriptors, grids, streams, warm-up.

The tile configuration depends only on the dtype and the device kind, never on a rank's shapes,
so every rank of a group uses the same one.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _env
from ..errors import DitronError
from ..runtime.group import Group, op_id, sm_count
from ..runtime.warmup import one_rank_pad, pointer_table, register_warmup
from ._kernels import ag_gemm_kernel, ag_pull_kernel, ag_start_kernel

PURPOSE = "ag_gemm"
PRODUCERS = ("copy", "pull")
PRODUCER = "copy"
"""How the fused path moves the shards: ``"copy"``, copy engines on a side stream (no SM); or
``"pull"``, ``ag_pull_kernel`` on ``pull_programs`` SMs taken from the GEMM. The ``ag_gemm``
bench measures both (``producer`` rows)."""
PULL_SM_FRACTION = 8
"""Pull mode: one SM in this many of a rank's share runs the pull kernel (at least one)."""
_PULL_BLOCK, _PULL_WARPS = 4096, 8


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiles and schedule of the persistent GEMM (``ag_gemm_kernel``; gemm_rs uses the tiles).

    ``split_tail``: a partial last wave of at most half the grid runs as half-width tiles
    (``SPLIT_TAIL``, ``tail_tiles``).
    """
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split_tail: bool = False


GPU_CONFIGS = {
    "128x256x64/s3": TileConfig(128, 256, 64, 8, 8, 3),
    "128x256x64/s4": TileConfig(128, 256, 64, 8, 8, 4),
    "128x256x64/s3/tail": TileConfig(128, 256, 64, 8, 8, 3, split_tail=True),
    "128x256x64/s4/tail": TileConfig(128, 256, 64, 8, 8, 4, split_tail=True),
}
"""Candidates the ``ag_gemm`` bench compares; ``GPU_CONFIG`` names the one used (every rank the
same; ``DITRON_AG_GEMM_CONFIG`` picks another at import, so the warm-up compiles it).

Measured on the H200 (bf16, local model shapes M=8192, CUDA-graph replay, paired timing):
earlier sessions 3 stages 0.953-0.954x cuBLAS (geo-mean), 4 stages 0.965x; 128x128x64 (4-5
stages, 4 or 8 warps) 0.91-0.92x, 256x128x64 0.93x, 128x128x128 0.89x, GROUP_M 16 0.974x (one
unpaired sweep where s3 read 0.975x). The shapes that trail most fill their last wave worst
(8192x1792: 448 tiles = 3.4 waves of 132 SMs; 8192x3696: 7.3 waves): ``split_tail``.

Six runs, P1 geo-mean vs cuBLAS (P2 overhead geo-mean, consumer with every chunk present vs
the same configuration's plain GEMM; the last two with the interleaved pairing of
``paired_graph_times``, the first four with blocks of rounds; (+) is 3b9a903 with this default
and ``fit_stages``):

    config   9ad02c3 (*)   a902b56       c6eb20b       ff305fc       97abeab       (+)
    s3       0.905 (+2.0%) 0.956 (-2.4%) 0.964 (-1.9%) 0.961 (-1.8%) 0.948 (+0.7%) 0.948 (+0.8%)
    s4       0.936 (+1.5%) 0.969 (+1.2%) 0.978 (+0.4%) 0.977 (+0.5%) 0.946 (+0.8%) 0.950 (+0.4%)
    s3/tail  0.946 (+2.5%) 0.986 (+1.4%) 0.990 (+1.9%) 0.995 (+1.1%) 0.970 (+0.8%) 0.970 (+0.5%)
    s4/tail  -             0.996 (+3.1%) 0.996 (+2.5%) 0.997 (+1.9%) 0.985 (+0.4%) 0.985 (+0.4%)

A seventh run, 83e3a62 (the code of (+)), on a machine where cuBLAS and ours both ran 1-3%
slower on the large shapes: s3 0.941, s4 0.941, s3/tail 0.962 (+1.0%), s4/tail 0.978 (+0.6%,
at most 1.7% per shape; s3/tail 2.2%). An eighth, 577d1d7 (same GEMM code): s3 0.947 (+0.7%),
s4 0.944 (+0.9%), s3/tail 0.966 (+0.5%), s4/tail 0.984 (+0.6%, at most 1.7%); per shape
0.931 / 1.03 / 0.988 / 0.993 / 0.972 / 0.994. The two shapes that trail (8192x1376: 0.93x,
8192x3696: 0.95-0.97x) leave their last 256-wide column mostly empty, but running that column as
half tiles would not shorten them: counted in half tiles they still need as many waves (704 half
tiles on 132 programs, 6 per program as now; 1856, 7.5 waves as with ``split_tail`` now). cuBLAS
runs exactly these two with tiles that are not powers of two (torch.profiler on the H200,
2026-12-01: ``nvjet_sm90_tst_160x192_64x4_1x2`` on 8192x1376x4096, ``..._208x192_64x4_1x2`` on
8192x3696x8192; 320x128 on 8192x1792 and 256x128 on the other three). Triton's block shapes are
powers of two, so those tiles are out of its reach. Hopper warp specialization
(``tl.range(warp_specialize=True)``), which would overlap the epilogue with the next tile's
loads, does nothing in Triton 3.6 for sm_90a: a tutorial-style persistent TMA GEMM compiled
with it at 8 warps came out as without it (no ``ttg.warp_specialize`` in the TTGIR, the same
registers and SASS instruction counts); at 4 warps the NVGPUWarpSpecialization pass failed.

(*) a machine whose cuBLAS ran 7-10% faster than in every other run (777 TFLOPS on
8192x6144x12288; ours the same as elsewhere), where a flattened tile + K loop
(``tl.range(flatten=True)``, since removed) also ran: 0.766x, 0.816x with split tail. In the
last two runs cuBLAS was again faster than in the middle three (136.5-138.1 us on
8192x1376x4096 against 141.1, 703.2-704.2 on 8192x3696x8192 against 728.2) while ours was not.
Before the interleaved pairing, per-shape P2 moved by up to +-5% between runs; with it, two
builds of the same GEMM agree within 0.4% on five of the six shapes. s4/tail is the default: the
best P1 in every run that measured it, and in the last two the lowest per-shape P2 (at most
1.2%, where s3/tail reached 3.3% and 3.0% on 8192x1792). It needs 229 KB of shared memory
(s3: 180 KB), so fp32 products drop to 3 stages (``fit_stages``); gemm_rs, with the same tiles
and stages, compiles to 229,408 bytes in every variant."""
GPU_CONFIG = _env.ag_gemm_config("128x256x64/s4/tail")
if GPU_CONFIG not in GPU_CONFIGS:
    raise ValueError(f"ditron: DITRON_AG_GEMM_CONFIG must be one of {sorted(GPU_CONFIGS)}, "
                     f"got {GPU_CONFIG!r}")
INTERPRETER_CONFIG = TileConfig(16, 16, 16, 4, 4, 1)
"""Small tiles in the interpreter (its cost is per element of every block, masked or not); tests
swap in variants (``split_tail`` with ``block_n=32``)."""
INTERPRETER_PROGRAMS = 1
"""Consumer programs in the interpreter (it runs a grid's programs one after the other, so a
waiting program must not need a later one; the fused path's producer runs first there)."""


def tile_config(device: torch.device) -> TileConfig:
    """``GPU_CONFIGS[GPU_CONFIG]`` on the GPU (Hopper: TMA + wgmma), ``INTERPRETER_CONFIG`` in
    the interpreter. Rank-independent."""
    return GPU_CONFIGS[GPU_CONFIG] if device.type == "cuda" else INTERPRETER_CONFIG


def program_budget(device: torch.device, group: Optional[Group]) -> int:
    """Programs a persistent consumer may use: every SM (the default all-gather runs on copy
    engines), or this rank's share of them in a virtual world (all ranks' waiting grids must be
    resident together); ``INTERPRETER_PROGRAMS`` in the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return group.sm_share() if group is not None else sm_count(device)


def consumer_programs(device: torch.device, group: Optional[Group], tiles: int) -> int:
    """Persistent GEMM grid: one program per tile up to ``program_budget``; pull mode gives
    ``pull_programs`` of them to the producer (see ``fused``)."""
    return max(1, min(tiles, program_budget(device, group)))


def tail_tiles(tiles: int, programs: int, cfg: TileConfig) -> int:
    """Tiles the consumer runs as half tiles (``split_tail``): a partial last wave of at most
    half the grid (its halves then fit in one wave), else 0 (e.g. 448 tiles on 132 programs:
    the last 52 as 104 halves, 3.5 waves instead of 4)."""
    left = tiles % programs
    return left if cfg.split_tail and 0 < 2 * left <= programs else 0


def consumer_grid(device: torch.device, group: Optional[Group], tiles: int,
                  cfg: TileConfig) -> int:
    """``consumer_programs``, doubled when ``split_tail`` can run every tile as two halves
    within the budget (small M: e.g. 7 tiles on 14 programs)."""
    if cfg.split_tail and 2 * tiles <= program_budget(device, group):
        return 2 * tiles
    return consumer_programs(device, group, tiles)


def _tma_ok(t: torch.Tensor) -> bool:
    """``t`` (2-D) can back a TMA descriptor as is: last dim contiguous, 16-byte aligned."""
    e = t.element_size()
    return (t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * e) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


def _padded_copy(t: torch.Tensor) -> torch.Tensor:
    """Row-major copy of ``t`` with a 16-byte aligned row pitch (viewed back to ``t``'s shape)."""
    rows, cols = t.shape
    pitch = -(-cols * t.element_size() // 16) * 16 // t.element_size()
    buf = t.new_empty((rows, pitch))[:, :cols]
    buf.copy_(t)
    return buf


def b_descriptor(b: torch.Tensor, cfg: TileConfig) -> tuple[TensorDescriptor, bool]:
    """TMA descriptor for ``b [K, N]`` (blocks ``cfg.block_n`` wide) and whether it is over
    ``b`` (True) or ``b.T`` (False).

    ``[K, N]`` row-major and ``w.t()`` of a row-major Linear weight ``w [N, K]`` are used as they
    are; any other stride pattern is copied once into an aligned row-major buffer.
    """
    bn = cfg.block_n
    if _tma_ok(b):
        return TensorDescriptor(b, list(b.shape), list(b.stride()), [cfg.block_k, bn]), True
    bt = b.t()
    if _tma_ok(bt):
        return TensorDescriptor(bt, list(bt.shape), list(bt.stride()), [bn, cfg.block_k]), False
    b = _padded_copy(b)
    return TensorDescriptor(b, list(b.shape), list(b.stride()), [cfg.block_k, bn]), True


def half_b_descriptor(b_desc: TensorDescriptor, b_kn: bool, cfg: TileConfig) -> TensorDescriptor:
    """``b_desc`` (from ``b_descriptor``) in ``cfg.block_n / 2`` wide blocks for the split tail,
    over the same memory (no second copy of an unaligned B); ``b_desc`` itself without it."""
    if not cfg.split_tail:
        return b_desc
    half = cfg.block_n // 2
    block = [cfg.block_k, half] if b_kn else [half, cfg.block_k]
    return TensorDescriptor(b_desc.base, b_desc.shape, b_desc.strides, block)


def fit_stages(cfg: TileConfig, device: torch.device, in_bytes: int, out_bytes: int) -> TileConfig:
    """``cfg`` with as many of its pipeline stages as fit the device's shared memory per block:
    each stage holds an A and a B block (``in_bytes`` per element), and the C store stages a
    ``[block_m, block_n / 2]`` block (``out_bytes``), plus 1 KB for barriers and alignment.
    The one case cut on the H200 (232,448 bytes): fp32 C at 4 stages, 262,176 bytes compiled
    (the plain GEMM's fp32 products); bf16 C at 4 stages compiles to 229,408. The stage count
    never changes the K order (results are the same)."""
    if device.type != "cuda":
        return cfg
    limit = _shared_memory_limit(device.index if device.index is not None else 0)
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * in_bytes
    c_block = cfg.block_m * cfg.block_n // 2 * out_bytes
    stages = cfg.num_stages
    while stages > 2 and stages * stage + c_block + 1024 > limit:
        stages -= 1
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


@functools.cache
def _shared_memory_limit(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _c_descriptor(out: torch.Tensor, cfg: TileConfig) -> Optional[TensorDescriptor]:
    """TMA store descriptor (two ``block_n / 2`` halves per tile) when ``out`` allows it."""
    if _tma_ok(out):
        return TensorDescriptor(out, list(out.shape), list(out.stride()),
                                [cfg.block_m, cfg.block_n // 2])
    return None


def launch_consumer(a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                    bias: Optional[torch.Tensor], *, group: Optional[Group], wait: bool,
                    sig: torch.Tensor, offsets: torch.Tensor, claim: torch.Tensor,
                    record: torch.Tensor, m: int, programs: Optional[int] = None,
                    cfg: Optional[TileConfig] = None) -> torch.Tensor:
    """Launch the persistent GEMM (``wait=False``: a plain GEMM; the waiting arguments are
    unused) with tile configuration ``cfg`` (default ``tile_config``)."""
    cfg = fit_stages(cfg or tile_config(out.device), out.device, b.element_size(),
                     out.element_size())
    b_desc, b_kn = b_descriptor(b, cfg)
    c_desc = _c_descriptor(out, cfg) if out.is_cuda else None
    n, k = b.shape[1], b.shape[0]
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    grid = programs or consumer_grid(out.device, group, tiles, cfg)
    tail = tail_tiles(tiles, grid, cfg)
    bh_desc = half_b_descriptor(b_desc, b_kn, cfg)
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    timeout_us = group.timeout_us() if group is not None else 1
    ag_gemm_kernel[(grid,)](
        a_desc, b_desc, bh_desc, c_desc, out, bias if bias is not None else out, sig, offsets,
        claim, record, m, n, k, out.stride(0), out.stride(1), int(bias is not None), tail,
        rank, world, timeout_us, op_id("ag_gemm"),
        B_KN=b_kn, C_TMA=c_desc is not None, WAIT=wait, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_TAIL=cfg.split_tail,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


_DUMMY: dict[str, tuple] = {}


def _dummies(device: torch.device) -> tuple:
    key = str(device)
    if key not in _DUMMY:
        sig = torch.zeros(16, dtype=torch.int64, device=device)
        offsets = torch.zeros(2, dtype=torch.int32, device=device)
        claim = torch.zeros(1, dtype=torch.int64, device=device)
        _DUMMY[key] = (sig, offsets, claim, claim)
    return _DUMMY[key]


def matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None, cfg: Optional[TileConfig] = None) -> torch.Tensor:
    """Our persistent Triton GEMM alone (the ag_gemm consumer without waits): ``a @ b + bias``.

    ``a [M, K]``, ``b [K, N]`` (any strides; ``w.t()`` works without a copy), fp16/bf16 on GPU.
    The core the benchmarks compare with cuBLAS (``cfg``: a tile configuration other than
    ``tile_config``'s, e.g. ``GPU_CONFIGS[name]``).
    """
    m = a.shape[0]
    out = a.new_empty((m, b.shape[1])) if out is None else out
    if m == 0 or b.shape[1] == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    cfg = cfg or tile_config(a.device)
    if not _tma_ok(a):
        a = _padded_copy(a)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [cfg.block_m, cfg.block_k])
    sig, offsets, claim, record = _dummies(a.device)
    return launch_consumer(a_desc, b, out, bias, group=None, wait=False, sig=sig, offsets=offsets,
                           claim=claim, record=record, m=m, cfg=cfg)


def k_pitch(k: int, elem: int) -> int:
    """Row pitch (elements) of the gathered buffer: ``k`` rounded up to 16 bytes."""
    return -(-k * elem // 16) * 16 // elem


def side_stream(group: Group) -> torch.cuda.Stream:
    stream = getattr(group, "_ag_gemm_side_stream", None)
    if stream is None:
        stream = group._ag_gemm_side_stream = torch.cuda.Stream(group.device)
    return stream


def pull_programs(group: Group) -> int:
    """Programs of the pull kernel (pull mode); the consumer runs on the rest of the share. One
    in the interpreter, which runs a grid's programs one after the other (a program waiting for
    a peer whose chunk needs this rank's later programs would never return)."""
    if group.device.type != "cuda":
        return 1
    return max(1, group.sm_share() // PULL_SM_FRACTION)


def fused(group: Group, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
          out: torch.Tensor, shard_sizes: list[int], gathered: Optional[torch.Tensor],
          producer: Optional[str] = None) -> None:
    """One fused call (schedule in ``_kernels``): start barrier, all-gather on a side stream
    with a flag per chunk (``producer``, default ``PRODUCER``), persistent GEMM over the
    gathered rows as chunks land."""
    producer = producer or PRODUCER
    if producer not in PRODUCERS:
        raise ValueError(f"ditron.ag_gemm: producer must be one of {PRODUCERS}, got {producer!r}")
    group.check()
    ws = group.workspace(PURPOSE)
    cfg = tile_config(a.device)
    m, k = sum(shard_sizes), a.shape[1]
    w, rank = group.world_size, group.rank
    elem = a.element_size()
    pitch = k_pitch(k, elem)
    data = ws.ensure_data(m * pitch * elem)
    if data.peers is None and producer == "copy":
        raise DitronError(f"ditron.ag_gemm: group {group.group_name!r} ({group.backend}) gives no "
                          "peer tensors for copy-engine transfers")
    buf = data.local.view(a.dtype)
    a_desc = TensorDescriptor(buf, [m, k], [pitch, 1], [cfg.block_m, cfg.block_k])
    offsets = ws.row_offsets(shard_sizes, "ag_gemm")
    rows, first = shard_sizes[rank], sum(shard_sizes[:rank])
    # one contiguous [rows, pitch] region per chunk; for the pull kernel also 16-byte aligned
    # (its only specialisation: an unaligned view would compile another variant mid-call)
    aligned = a.is_contiguous() and pitch == k and (producer == "copy" or a.data_ptr() % 16 == 0)
    src = a if aligned else _padded_rows(a, pitch)
    record, claim = group._error_tensors()
    sig = ws.signal_pad()

    def copies() -> None:  # copy engines: contiguous D2D / peer copies, then the flags
        flat = src.reshape(-1)  # src is [rows, pitch], contiguous
        for region, flags in _copy_plan(ws, data, a.dtype, first, rows, pitch, rank, w):
            if region is not None:
                region.copy_(flat)
            for dst_word, src_word in flags:  # meta (rows), then the arrival (epoch)
                dst_word.copy_(src_word)

    def pull() -> None:  # SMs: every rank pulls its peers' chunks from their gathered buffers
        ag_pull_kernel[(pull_programs(group),)](
            src, buf, data.ptr_table, sig, ws.signal.ptr_table, offsets, claim, record, rank, w,
            pitch, group.timeout_us(), op_id("ag_gemm"), BLOCK=_PULL_BLOCK, VEC=16 // elem,
            num_warps=_PULL_WARPS)

    produce, programs = copies, None  # None: launch_consumer's default grid
    if producer == "pull":
        produce = pull
        if a.is_cuda:  # the pull programs must be resident beside the GEMM's
            tiles = -(-m // cfg.block_m) * -(-b.shape[1] // cfg.block_n)
            programs = max(1, min(consumer_programs(a.device, group, tiles),
                                  group.sm_share() - pull_programs(group)))
    ws.calls += 1
    with group.waiting_launch("ag_gemm", ws.calls):
        ag_start_kernel[(1,)](sig, ws.signal.ptr_table, claim, record, rank, w, rows,
                              group.timeout_us(), op_id("ag_gemm"))
        if producer == "pull":  # the pull kernel waits (event) for this start barrier
            group.launch_step("ag_gemm", ws.calls)
        if a.is_cuda:
            main = torch.cuda.current_stream(a.device)
            side = side_stream(group)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                produce()
            launch_consumer(a_desc, b, out, bias, group=group, wait=True, sig=sig,
                            offsets=offsets, claim=claim, record=record, m=m, programs=programs)
            main.wait_stream(side)
        else:  # interpreter: kernels run synchronously, one after the other
            produce()
            launch_consumer(a_desc, b, out, bias, group=group, wait=True, sig=sig,
                            offsets=offsets, claim=claim, record=record, m=m, programs=programs)
    if gathered is not None:
        gathered.copy_(buf[:m * pitch].view(m, pitch)[:, :k])
    if _env.sync_check():
        group.synchronize()


def _copy_plan(ws, data, dtype: torch.dtype, first: int, rows: int, pitch: int, rank: int,
               w: int) -> list:
    """Per destination, in push order: ``(this rank's region of its gathered buffer or None,
    [(meta word, its source), (arrival word, its source)])``, all views made once and kept for
    the last layout (the host cost of an eager call is mostly such small tensor ops)."""
    key = (dtype, first, rows, pitch)
    cached = ws.__dict__.get("_ag_copy_plan")  # (buffer, key, plan): the buffer by identity
    if cached is not None and cached[0] is data and cached[1] == key:
        return cached[2]
    sig = ws.signal_pad()
    sig_peers = [p.view(torch.int64) for p in ws.signal.peers]  # the pad never moves
    plan = []
    for i in range(w):
        dst = (rank + i) % w
        region = data.peers[dst].view(dtype)[first * pitch:(first + rows) * pitch] if rows else None
        meta = (sig_peers[dst][2 * w + rank:2 * w + rank + 1], sig[3 * w + 1:3 * w + 2])
        arrival = (sig_peers[dst][rank:rank + 1], sig[3 * w:3 * w + 1])
        plan.append((region, [meta, arrival]))
    ws._ag_copy_plan = (data, key, plan)
    return plan


def _padded_rows(a: torch.Tensor, pitch: int) -> torch.Tensor:
    """``a`` copied into contiguous rows of ``pitch`` elements (so each chunk is one memcpy)."""
    out = a.new_empty((a.shape[0], pitch))
    out[:, :a.shape[1]] = a
    return out


def _warmup(device: torch.device) -> None:
    """Compile and load every kernel variant (dtype x B layout x C store x wait) as a one-rank
    call whose waits are already satisfied."""
    cfg = tile_config(device)
    # W=1 pad: flag[0] = 1, start count 1, rows[0] = 64, epoch 1
    sig, sig_table, claim, record = one_rank_pad(device, (1, 1, 64, 1))
    offsets = torch.tensor([0, 64], dtype=torch.int32, device=device)
    for dtype in (torch.float16, torch.bfloat16):
        a = torch.ones(64, 64, dtype=dtype, device=device)
        a_desc = TensorDescriptor(a, [64, 64], [64, 1], [cfg.block_m, cfg.block_k])
        # with split_tail two programs on the one tile run it as halves (the second past N),
        # so the tail loop runs too
        variants = itertools.product((a.clone(), a.clone().t()), (False, True), (False, True))
        for b, wait, c_tma in variants:
            out = torch.empty(64, 64 if c_tma else 65, dtype=dtype, device=device)[:, :64]
            launch_consumer(a_desc, b, out, None, group=None, wait=wait, sig=sig, offsets=offsets,
                            claim=claim, record=record, m=64, programs=2 if cfg.split_tail else 1)
            torch.cuda.synchronize(device)
            if int(record[0]) != 0 or not torch.equal(out, torch.full_like(out, 64)):
                raise RuntimeError(f"ditron: ag_gemm warm-up failed for {dtype} (kernel bug)")
        for b in (a.clone(), a.clone().t()):  # fp32 products (gemm_rs references, baselines)
            out = torch.empty(64, 64, dtype=torch.float32, device=device)
            launch_consumer(a_desc, b, out, None, group=None, wait=False, sig=sig, offsets=offsets,
                            claim=claim, record=record, m=64, programs=1)
    ag_start_kernel[(1,)](sig, sig_table, claim, record, 0, 1, 64, 10**6, 0)
    torch.cuda.synchronize(device)
    if int(record[0]) != 0:
        raise RuntimeError("ditron: ag_gemm start-barrier warm-up failed (kernel bug)")
    for dtype in (torch.float16, torch.bfloat16):  # pull producer: W=1 pad, epoch 1, 64 rows sent
        sig, sig_table, claim, record = one_rank_pad(device, (0, 1, 0, 1, 64))
        src = torch.ones(64, 64, dtype=dtype, device=device)
        buf = torch.zeros(64 * 64, dtype=dtype, device=device)
        ag_pull_kernel[(1,)](src, buf, pointer_table(buf), sig, sig_table, offsets, claim, record,
                             0, 1, 64, 10**6, 0, BLOCK=_PULL_BLOCK, VEC=8, num_warps=_PULL_WARPS)
        torch.cuda.synchronize(device)
        if int(record[0]) != 0 or not bool((buf == 1).all()) or sig[:3].tolist() != [1, 1, 64]:
            raise RuntimeError(f"ditron: ag_gemm pull-producer warm-up failed for {dtype} (kernel bug)")


register_warmup(PURPOSE, _warmup)
