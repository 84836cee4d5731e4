"""The persistent GEMM core shared by ag_gemm, gemm_rs and gemm_ar: tile configuration, TMA
descriptors, grids and the launch of ``persistent_gemm_kernel`` (``matmul`` alone, or as
ag_gemm's waiting consumer).

The tile configuration depends only on the dtype and the device kind, never on a rank's shapes,
so every rank of a group uses the same one.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime.group import Group, op_id, sm_count
from ..runtime.launcher import BoundKernel
from ..runtime.plan import PlanCache, tensor_key
from ._core_kernels import persistent_gemm_kernel


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiles and schedule of the persistent GEMM (``persistent_gemm_kernel``; gemm_rs uses the tiles).

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
"""Candidates the ``ag_gemm`` bench compares (``matmul(..., cfg=)``); ``GPU_CONFIG`` names the one
every op uses (every rank the same). ``/tail`` (``split_tail``): the shapes that trailed most
filled their last wave worst (8192x1792: 448 tiles = 3.4 waves of 132 SMs). Other tiles measured
lower (128x128, 256x128: 0.89-0.93x cuBLAS). History: benchmarks/NOTES.md, GEMM core."""
GPU_CONFIG = "128x256x64/s4/tail"
"""s4/tail: the best P1 in every run that measured it (0.978-0.997x cuBLAS geo-mean, H200, bf16,
model shapes at M=8192) and the lowest per-shape P2 in the last paired runs (at most 1.2%). It
needs 229 KB of shared memory (s3: 180 KB), so fp32 products drop to 3 stages (``fit_stages``).
Its weakest shape, 8192x1376x4096 (0.93x), is one cuBLAS runs with non-power-of-two tiles
(160x192), out of Triton's reach; Hopper warp specialization is a no-op in Triton 3.6 for
sm_90a. History: benchmarks/NOTES.md, GEMM core."""
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


class CoreGemm:
    """The persistent GEMM of one plan, bound once: ``out = A @ b (+ bias)`` with the tile
    configuration, grid, split tail and descriptors fixed; ``run`` launches it with the tensors
    of the call (only their addresses may change; a plan key holds the rest).

    Parameters
    ----------
    a_desc : TensorDescriptor
        Over ``A [m, K]``: a workspace the plan owns (``a_varies=False``, ag_gemm's gathered
        rows) or an example of the per-call ``a`` (``a_varies=True``, ``matmul``).
    b, out, bias : torch.Tensor
        Examples of the call's ``b [K, N]`` (any strides), ``out [m, N]`` and ``bias [N]`` (or
        None). A ``b`` that no descriptor can read as it is (neither ``[K, N]`` nor ``[N, K]``
        row-major and aligned) is copied per call into a buffer the plan owns.
    group : Group, optional
        The waiting consumer's group (``wait=True``); None for a plain GEMM.
    wait, sig, offsets, claim, record, m, programs, cfg
        As the kernel takes them (``cfg`` default ``tile_config``).
    push : dict, optional
        ag_gemm's one-launch call instead of the plain consumer: ``kernel`` (its
        ``ag_gemm_push_kernel``), ``sig_table``, ``src`` (an example of the per-call source
        rows, or the plan's padded copy of them with ``src_varies=False``), ``buf`` and
        ``buf_table`` (the gathered buffer), ``pitch``, ``copy_block`` and ``src_varies``.
    b_pad : torch.Tensor, optional
        The padded copy of ``b`` to reuse (a rebuilt plan's; else made here when needed).
    """

    def __init__(self, a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor], *, group: Optional[Group], wait: bool,
                 sig: torch.Tensor, offsets: torch.Tensor, claim: torch.Tensor,
                 record: torch.Tensor, m: int, programs: Optional[int] = None,
                 cfg: Optional[TileConfig] = None, a_varies: bool = False,
                 push: Optional[dict] = None, b_pad: Optional[torch.Tensor] = None):
        cfg = fit_stages(cfg or tile_config(out.device), out.device, b.element_size(),
                         out.element_size())
        self.cfg = cfg
        self._b_pad = None
        if not _tma_ok(b) and not _tma_ok(b.t()):
            self._b_pad = b_pad if b_pad is not None else _padded_copy(b)
            b = self._b_pad
        b_desc, b_kn = b_descriptor(b, cfg)
        c_desc = _c_descriptor(out, cfg) if out.is_cuda else None
        n, k = b.shape[1], b.shape[0]
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        grid = programs or consumer_grid(out.device, group, tiles, cfg)
        tail = tail_tiles(tiles, grid, cfg)
        bh_desc = half_b_descriptor(b_desc, b_kn, cfg)
        rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
        timeout_us = group.timeout_us() if group is not None else 10**7  # (precompile, benches: 10 s)
        vary = (("a_desc",) if a_varies else ()) + (("b_desc", "bh_desc") if self._b_pad is None
                                                    else ()) + (("c_desc",) if c_desc else ())
        self._a_varies, self._b_varies, self._c_tma = a_varies, self._b_pad is None, c_desc is not None
        self._src_varies = bool(push and push["src_varies"])
        tiles_cfg = dict(B_KN=b_kn, C_TMA=c_desc is not None, BLOCK_M=cfg.block_m,
                         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                         SPLIT_TAIL=cfg.split_tail, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)
        head = (a_desc, b_desc, bh_desc, c_desc, out, bias if bias is not None else out, sig)
        sizes = (m, n, k, out.stride(0), out.stride(1), int(bias is not None), tail, rank, world,
                 timeout_us, op_id("ag_gemm"))
        if push is None:
            self.kernel = BoundKernel(persistent_gemm_kernel, (grid,),
                                      head + (offsets, claim, record) + sizes,
                                      dict(WAIT=wait, **tiles_cfg),
                                      vary=vary + ("c_ptr", "bias_ptr"), device=out.device)
        else:
            self.kernel = BoundKernel(
                push["kernel"], (grid,),
                head + (push["sig_table"], offsets, push["src"], push["buf"], push["buf_table"],
                        claim, record) + sizes + (push["pitch"], grid if out.is_cuda else 1),
                dict(COPY_BLOCK=push["copy_block"], **tiles_cfg),
                vary=vary + ("c_ptr", "bias_ptr") + (("src_ptr",) if self._src_varies else ()),
                device=out.device)

    def run(self, a: Optional[torch.Tensor], b: torch.Tensor, out: torch.Tensor,
            bias: Optional[torch.Tensor], src: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Launch on the current stream (``a`` only when it varies, else None; ``src``, the
        push call's rows, only when they vary)."""
        values = [a] if self._a_varies else []
        if self._b_varies:
            values += (b, b)  # the descriptors' templates say [K, N] or [N, K]
        else:
            self._b_pad.copy_(b)  # its values may have changed since the last call
        if self._c_tma:
            values.append(out)
        values += (out, bias if bias is not None else out)
        if self._src_varies:
            values.append(src)
        self.kernel.launch(*values)
        return out


def launch_consumer(a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                    bias: Optional[torch.Tensor], *, group: Optional[Group], wait: bool,
                    sig: torch.Tensor, offsets: torch.Tensor, claim: torch.Tensor,
                    record: torch.Tensor, m: int, programs: Optional[int] = None,
                    cfg: Optional[TileConfig] = None) -> torch.Tensor:
    """One launch of the persistent GEMM built for it (``wait=False``: a plain GEMM; the
    waiting arguments are unused), for benches that drive the kernel directly."""
    core = CoreGemm(a_desc, b, out, bias, group=group, wait=wait, sig=sig, offsets=offsets,
                    claim=claim, record=record, m=m, programs=programs, cfg=cfg)
    return core.run(None, b, out, bias)


_DUMMY: dict[str, tuple] = {}


def _dummies(device: torch.device) -> tuple:
    key = str(device)
    if key not in _DUMMY:
        sig = torch.zeros(16, dtype=torch.int64, device=device)
        offsets = torch.zeros(2, dtype=torch.int32, device=device)
        claim = torch.zeros(1, dtype=torch.int64, device=device)
        _DUMMY[key] = (sig, offsets, claim, claim)
    return _DUMMY[key]


class _MatmulPlan:
    """``matmul`` of one key: an ``a`` that no descriptor reads as it is goes through a padded
    buffer of the plan (copied per call), then the bound core."""

    def __init__(self, a, b, bias, out, cfg):
        self.a_pad = None if _tma_ok(a) else _padded_copy(a)
        a_ex = a if self.a_pad is None else self.a_pad
        a_desc = TensorDescriptor(a_ex, list(a_ex.shape), list(a_ex.stride()),
                                  [cfg.block_m, cfg.block_k])
        sig, offsets, claim, record = _dummies(a.device)
        self.core = CoreGemm(a_desc, b, out, bias, group=None, wait=False, sig=sig,
                             offsets=offsets, claim=claim, record=record, m=a.shape[0], cfg=cfg,
                             a_varies=self.a_pad is None)

    def run(self, a, b, bias, out):
        if self.a_pad is not None:
            self.a_pad.copy_(a)
            a = None
        return self.core.run(a, b, out, bias)


_MATMUL_PLANS = threading.local()
"""One plan cache per thread: a plan owns padded copies of unaligned operands, which virtual
ranks (threads) must not share."""


def matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None, cfg: Optional[TileConfig] = None) -> torch.Tensor:
    """Our persistent Triton GEMM alone (the ag_gemm consumer without waits): ``a @ b + bias``.

    ``a [M, K]``, ``b [K, N]`` (any strides; ``w.t()`` works without a copy), fp16/bf16 on GPU.
    The core the benchmarks compare with cuBLAS (``cfg``: a tile configuration other than
    ``tile_config``'s, e.g. ``GPU_CONFIGS[name]``). Plans are cached per (shapes, strides,
    dtypes, alignment, configuration); a new one during CUDA-graph capture raises.
    """
    m = a.shape[0]
    out = a.new_empty((m, b.shape[1])) if out is None else out
    if m == 0 or b.shape[1] == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    cfg = cfg or tile_config(a.device)
    key = ("matmul", a.device, cfg, tensor_key(a), tensor_key(b), tensor_key(bias),
           tensor_key(out))
    cache = getattr(_MATMUL_PLANS, "cache", None)
    if cache is None:
        cache = _MATMUL_PLANS.cache = PlanCache(None)
    return cache.get(key, lambda: _MatmulPlan(a, b, bias, out, cfg)).run(a, b, bias, out)
