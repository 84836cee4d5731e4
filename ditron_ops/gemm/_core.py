"""The persistent GEMM core shared by ag_gemm, gemm_rs and gemm_ar: the launch of
``persistent_gemm_kernel`` (``matmul`` alone, or as ag_gemm's waiting consumer); grids and B's
descriptors are ``_core_grid``'s (re-exported here).

The tile configuration is chosen per problem by ``_core_configs.select_config`` (a
wave-quantization model over a few compiled candidates) while a call's plan is built; the
configurations and the rule live in ``_core_configs`` and are re-exported here.

Split-K (``SplitKGemm``): the default mode's plain ``matmul`` only, where the same model
(``select_split``) predicts that K in S slices beats the unsplit tiles by a margin
(``SPLIT_MARGIN``; fewer tiles than a wave, long K)::

    splitk_gemm_kernel:   (tile, slice) units  -> fp32 partials  P [S, M_pad, N_pad]  (the plan's)
    splitk_reduce_kernel: P_0 + P_1 + ... (+ bias), in slice order -> out (its dtype)

Deterministic mode never splits (its K order per element is fixed: batch invariance), and the
fused ops (ag_gemm's consumer, gemm_rs / gemm_ar) keep the unsplit kernels.

Small M (``SkinnyGemm``, ``_core_configs.skinny``): the plain ``matmul`` at M <= 32 on the GPU,
either mode, runs ``skinny_gemm_kernel`` (``C^T = B^T A^T``; rows bitwise those of the other
tiles).

Wide tiles (``StripGemm``, ``_core_configs.wide``): the default mode's plain ``matmul`` with a
2-byte C, where tiles 272, 288 or 320 columns wide fill the SMs far better than the powers of
two, runs ``strip_gemm_kernel``.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..deterministic import resolve_deterministic
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel, unused_pointer
from ..runtime.plan import PlanCache, tensor_key
from ._core_configs import (GPU_CONFIG, GPU_CONFIGS, MAX_SPLIT,  # noqa: F401
                            NARROW_CANDIDATES, SHORT_K_CANDIDATE, SKINNY_CANDIDATES,
                            SLICED_TAIL_MAIN, TileConfig,
                            WIDE_CANDIDATES, pad_operands, rule_configs, scaled_config,
                            scaled_configs, scaled_forms,
                            select_config,
                            select_split, slices,
                            tail_tiles, tile_width)
from ._pad import (LINE_BYTES, RowPad, off_sectors, padded_copy, read_rows, row_alignment,
                   tma_ok)
from ._core_grid import (b_descriptor, b_operand, consumer_grid,  # noqa: F401
                         consumer_programs, half_b_descriptor, program_budget)
from ._core_kernels import (persistent_gemm_kernel, skinny_gemm_kernel, splitk_gemm_kernel,
                            splitk_reduce_kernel, strip_gemm_kernel)
from ..runtime import compiler
from ._tune import TUNE_CORES, prefer_ws, time_alternating
from ._ws_launch import WsGemm
from ._ws_launch import mark_broken as ws_mark_broken
from ._ws_launch import refusal as ws_refusal


CORES = ("auto", "tl", "ws")
"""``matmul(core=)``: the tuned choice, the portable core, the warp-specialized one."""
DET_ON_WS = True
"""Deterministic ``matmul`` may run on the WS core (its fixed data-parallel 128x256 plan, timed
against the portable core's batch-invariant tiles as in the default mode): its rows carry the
same bits as those tiles' at every M (``tests/gpu/test_gemm_ws_gpu.py``,
``tools/det_ws_probe.py``; benchmarks/NOTES.md), so the timed choice moves no bit. Read when
a plan is built: a change reaches plans built afterwards."""


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
    if cfg.ctas_per_sm > 1:  # the SM's memory (the block limit + 1 KB reserved) shared out
        limit = (limit + 1024) // cfg.ctas_per_sm - 1024
    stage = (cfg.block_m + cfg.block_n + cfg.strip) * cfg.block_k * in_bytes
    c_block = cfg.block_m * (cfg.block_n // 2 + cfg.strip) * out_bytes
    stages = cfg.num_stages
    while stages > 2 and stages * stage + c_block + 1024 > limit:
        stages -= 1
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


@functools.cache
def _shared_memory_limit(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _c_descriptor(out: torch.Tensor, cfg: TileConfig) -> Optional[TensorDescriptor]:
    """TMA store descriptor (two ``block_n / 2`` halves per tile) when ``out`` allows it."""
    if tma_ok(out):
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
        As the kernel takes them (``cfg`` default: ``select_config`` for ``m`` x N on the
        group's program budget, default mode).
    push : dict, optional
        ag_gemm's one-launch call instead of the plain consumer: ``kernel`` (its
        ``ag_gemm_push_kernel``), ``sig_table``, ``src`` (an example of the per-call source
        rows, or the plan's padded copy of them with ``src_varies=False``), ``buf`` and
        ``buf_table`` (the gathered buffer), ``pitch``, ``copy_block`` and ``src_varies``.
    b_pad : torch.Tensor, optional
        The padded copy of ``b`` to reuse (a rebuilt plan's; else made here when needed).
    left : int
        The last tiles (in the grouped order) that another launch runs (``SlicedTailGemm``,
        with ``cfg.split_tail`` off): this one stops before them; 0 runs every tile.
    scales : Scales, optional
        fp8 operands' scales (``tile_product``'s ``SCALE``): examples of the per-call scale
        tensors (or the plan's, when they do not vary), their row strides and the mode.
    """

    def __init__(self, a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor], *, group: Optional[Group], wait: bool,
                 sig: torch.Tensor, offsets: torch.Tensor, claim: torch.Tensor,
                 record: torch.Tensor, m: int, programs: Optional[int] = None,
                 cfg: Optional[TileConfig] = None, a_varies: bool = False,
                 push: Optional[dict] = None, b_pad: Optional[torch.Tensor] = None,
                 left: int = 0, scales: Optional["Scales"] = None):
        if cfg is None:
            cfg = select_config(m, b.shape[1], program_budget(out.device, group), out.device,
                                deterministic=False)
        if wait and cfg.ctas_per_sm > 1:
            raise ValueError(f"{cfg}: a waiting grid runs one program per SM (all resident)")
        cfg = fit_stages(cfg, out.device, b.element_size(), out.element_size())
        self.cfg = cfg
        self._b_pad, b_desc, b_kn = b_operand(b, cfg, b_pad)
        if self._b_pad is not None:
            b = self._b_pad
        c_desc = _c_descriptor(out, cfg) if out.is_cuda else None
        n, k = b.shape[1], b.shape[0]
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        grid = programs or consumer_grid(out.device, group, tiles, cfg)
        tail = left or tail_tiles(tiles, grid, cfg)
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
        # which scales vary (not the Scales: its example tensors would outlive the call)
        self._scales = None if scales is None else (scales.a_varies, scales.b_varies)
        if scales is None:
            sizes += (unused_pointer(out.device, out.dtype),) * 2 + (0, 0)
            scale_vary = ()
        else:
            sizes += (scales.a, scales.b, scales.a_row, scales.b_row)
            tiles_cfg["SCALE"] = scales.mode
            scale_vary = (("sa_ptr",) if scales.a_varies else ()) + (
                ("sb_ptr",) if scales.b_varies else ())
        if push is None:
            self.kernel = BoundKernel(persistent_gemm_kernel, (grid,),
                                      head + (offsets, claim, record) + sizes,
                                      dict(WAIT=wait, **tiles_cfg),
                                      vary=vary + ("c_ptr", "bias_ptr") + scale_vary,
                                      device=out.device)
        else:
            self.kernel = BoundKernel(
                push["kernel"], (grid,),
                head + (push["sig_table"], offsets, push["src"], push["buf"], push["buf_table"],
                        claim, record) + sizes + (push["pitch"], grid if out.is_cuda else 1),
                dict(COPY_BLOCK=push["copy_block"], **tiles_cfg),
                vary=vary + ("c_ptr", "bias_ptr") + scale_vary
                + (("src_ptr",) if self._src_varies else ()),
                device=out.device)

    def run(self, a: Optional[torch.Tensor], b: torch.Tensor, out: torch.Tensor,
            bias: Optional[torch.Tensor], src: Optional[torch.Tensor] = None,
            scale_a: Optional[torch.Tensor] = None,
            scale_b: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Launch on the current stream (``a`` only when it varies, else None; ``src``, the
        push call's rows, only when they vary; the scales only when they vary)."""
        values = _ab_values(a, b, self._a_varies, self._b_pad, 2)
        if self._c_tma:
            values.append(out)
        values += (out, bias if bias is not None else out)
        if self._scales is not None:
            a_varies, b_varies = self._scales
            values += ([scale_a] if a_varies else []) + ([scale_b] if b_varies else [])
        if self._src_varies:
            values.append(src)
        self.kernel.launch(*values)
        return out


@dataclasses.dataclass(frozen=True)
class Scales:
    """fp8 scales of a bound GEMM (``CoreGemm(scales=)``; ``tile_product``'s ``SCALE``):
    ``mode`` 1 (a scale per row of A and per column of B, row strides 0 for tensor-wise) or 2
    (1x128 blocks of A, 128x128 of B); ``a`` / ``b`` fp32 examples (or the plan's own tensors
    when ``*_varies`` is off); ``a_row`` / ``b_row``: floats between rows (block rows of B)."""
    mode: int
    a: torch.Tensor
    b: torch.Tensor
    a_row: int
    b_row: int
    a_varies: bool = True
    b_varies: bool = True


def _ab_values(a: Optional[torch.Tensor], b: torch.Tensor, a_varies: bool,
               b_pad: Optional[torch.Tensor], b_descs: int = 1) -> list:
    """The per-call A and B values of a bound GEMM whose B has ``b_descs`` descriptors: ``a``
    when it varies, ``b`` for each descriptor (their templates say ``[K, N]`` or ``[N, K]``)
    unless a padded copy stands in for it (refreshed here: its values may have changed since
    the last call)."""
    values = [a] if a_varies else []
    if b_pad is None:
        values += [b] * b_descs
    else:
        b_pad.copy_(b)
    return values


REDUCE_BLOCKS = {"cuda": (8, 128, 4), "cpu": (16, 32, 4)}
"""``splitk_reduce_kernel``'s ``(BLOCK_R, BLOCK_C, num_warps)`` per device type: on the GPU 1024
fp32 per slice and program, two 16-byte loads a thread (800x768: 600 programs, so every SM
keeps several blocks' loads in flight; the fastest of four shapes measured, H200); small blocks
in the interpreter, whose cost is per element of a block."""


class SplitKGemm:
    """``out = A @ b (+ bias)`` with K cut into slices, bound once for a plan (default-mode
    ``matmul`` only): ``splitk_gemm_kernel`` writes every (tile, slice) unit's fp32 product into
    the plan's workspace ``parts``, ``splitk_reduce_kernel`` sums the slices in order, adds the
    bias and rounds once into ``out``.

    Parameters
    ----------
    a_desc : TensorDescriptor
        Over an example of the per-call ``a [m, K]`` (``a_varies``) or the plan's padded copy,
        in ``[cfg.block_m, cfg.block_k]`` blocks.
    b, out, bias : torch.Tensor
        As ``CoreGemm`` takes them (``out`` any strides and dtype; ``bias [N]`` or None).
    m : int
    cfg : TileConfig
        The tiles (``split_tail`` is ignored: every unit is a whole tile; the stages are fitted
        to an fp32 TMA store).
    split : int
        The K slices asked for; ``slices`` may leave fewer (``self.slices``, at least 2).
    a_varies : bool
    b_pad : torch.Tensor, optional
    tile0 : int
        The first tile (in ``_tile_coords``' grouped order) to split, the rest of C's tiles
        with it: 0 splits all; ``SlicedTailGemm`` passes its whole waves' tiles.

    Notes
    -----
    ``parts`` is ``[slices * tiles * block_m, block_n]`` fp32, the split tiles packed:
    ``slices x tiles x 4`` bytes a tile element (800x768x10760 in 6 slices of 128x256 tiles:
    15 MB). The persistent grid is ``min(units, program_budget)``; nothing waits.
    """

    def __init__(self, a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor], *, m: int, cfg: TileConfig, split: int,
                 a_varies: bool, b_pad: Optional[torch.Tensor] = None, tile0: int = 0):
        device = out.device
        cfg = fit_stages(dataclasses.replace(cfg, split_tail=False, tail_slices=0), device,
                         b.element_size(), 4)
        self.cfg = cfg
        self._b_pad, b_desc, b_kn = b_operand(b, cfg, b_pad)
        if self._b_pad is not None:
            b = self._b_pad
        n, k = b.shape[1], b.shape[0]
        self.slices, steps = slices(k, cfg.block_k, split)
        assert self.slices > 1, (k, split)
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n) - tile0
        assert tiles > 0, (m, n, tile0)
        self.parts = torch.empty(self.slices * tiles * cfg.block_m, cfg.block_n,
                                 dtype=torch.float32, device=device)
        p_desc = (TensorDescriptor(self.parts, list(self.parts.shape), [cfg.block_n, 1],
                                   [cfg.block_m, cfg.block_n // 2]) if out.is_cuda else None)
        self._a_varies = a_varies
        vary = (("a_desc",) if a_varies else ()) + (("b_desc",) if self._b_pad is None else ())
        self.gemm = BoundKernel(
            splitk_gemm_kernel, (min(tiles * self.slices, program_budget(device, None)),),
            (a_desc, b_desc, p_desc, self.parts, m, n, k, tile0, tiles, self.slices, steps),
            dict(B_KN=b_kn, P_TMA=p_desc is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages), vary=vary, device=device)
        block_r, block_c, warps = REDUCE_BLOCKS["cuda" if out.is_cuda else "cpu"]
        block_r, block_c = min(block_r, cfg.block_m), min(block_c, cfg.block_n)
        per_tile = (cfg.block_m // block_r) * (cfg.block_n // block_c)
        self.reduce = BoundKernel(
            splitk_reduce_kernel, (tiles * per_tile,),
            (self.parts, out, bias if bias is not None else out, m, n, tile0, tiles,
             self.slices, out.stride(0), out.stride(1), int(bias is not None)),
            dict(MAX_SLICES=max(MAX_SPLIT, self.slices), TILE_M=cfg.block_m,
                 TILE_N=cfg.block_n, GROUP_M=cfg.group_m, BLOCK_R=block_r, BLOCK_C=block_c,
                 num_warps=warps),
            vary=("c_ptr", "bias_ptr"), device=device)

    def run(self, a: Optional[torch.Tensor], b: torch.Tensor, out: torch.Tensor,
            bias: Optional[torch.Tensor], b_fresh: bool = False) -> torch.Tensor:
        """Both launches on the current stream (``a`` only when it varies, else None;
        ``b_fresh``: the padded copy of ``b``, if any, was already refreshed for this call)."""
        if b_fresh and self._b_pad is not None:  # (the kernel reads the plan's copy: no value)
            self.gemm.launch(*([a] if self._a_varies else []))
        else:
            self.gemm.launch(*_ab_values(a, b, self._a_varies, self._b_pad))
        self.reduce.launch(out, bias if bias is not None else out)
        return out


class SlicedTailGemm:
    """``out = A @ b (+ bias)`` with the partial last wave in K slices (``cfg.tail_slices``;
    ``_core_configs.sliced_tail``), bound once for a plan (default-mode ``matmul`` only): the
    persistent GEMM (``CoreGemm``) runs the whole waves' tiles unsplit, then ``SplitKGemm``
    the tiles left after them as ``cfg.tail_slices`` slices each and sums them into ``out``.
    Three launches; nothing waits. Where the tiles fill whole waves (or less than one) on the
    budget, only the unsplit GEMM runs (``self.tail`` None).

    Arguments as ``SplitKGemm``'s (no ``split``); ``programs``: the persistent grid (default
    the device's ``program_budget``; tests give the interpreter's one program more).
    """

    def __init__(self, a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor], *, m: int, cfg: TileConfig, a_varies: bool,
                 b_pad: Optional[torch.Tensor] = None, programs: Optional[int] = None):
        programs = programs or program_budget(out.device, None)
        tiles = -(-m // cfg.block_m) * -(-b.shape[1] // cfg.block_n)
        full, left = divmod(tiles, programs)
        if full == 0 or slices(b.shape[0], cfg.block_k, cfg.tail_slices)[0] < 2:
            left = 0
        sig, offsets, claim, record = _dummies(out.device)
        self.main = CoreGemm(a_desc, b, out, bias, group=None, wait=False, sig=sig,
                             offsets=offsets, claim=claim, record=record, m=m,
                             programs=min(tiles, programs),
                             cfg=dataclasses.replace(cfg, split_tail=False, tail_slices=0),
                             a_varies=a_varies, b_pad=b_pad, left=left)
        self.cfg = dataclasses.replace(self.main.cfg, tail_slices=cfg.tail_slices if left else 0)
        self.tail = (SplitKGemm(a_desc, b, out, bias, m=m, cfg=cfg, split=cfg.tail_slices,
                                a_varies=a_varies, b_pad=self.main._b_pad, tile0=tiles - left)
                     if left else None)

    def run(self, a: Optional[torch.Tensor], b: torch.Tensor, out: torch.Tensor,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The launches on the current stream (``a`` only when it varies, else None)."""
        self.main.run(a, b, out, bias)
        if self.tail is not None:
            self.tail.run(a, b, out, bias, b_fresh=True)
        return out



class StripGemm:
    """``out = A @ b (+ bias)`` by ``strip_gemm_kernel`` (``cfg.strip``: tiles ``block_n +
    strip`` wide), bound once for a plan: persistent over the tiles on the program budget.
    Arguments as ``SplitKGemm``'s (no ``split``)."""

    def __init__(self, a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor], *, m: int, cfg: TileConfig, a_varies: bool,
                 b_pad: Optional[torch.Tensor] = None):
        device = out.device
        cfg = fit_stages(cfg, device, b.element_size(), out.element_size())
        self.cfg = cfg
        self._b_pad, b_desc, b_kn = b_operand(b, cfg, b_pad)
        if self._b_pad is not None:
            b = self._b_pad
        n, k = b.shape[1], b.shape[0]
        strip = [cfg.block_k, cfg.strip] if b_kn else [cfg.strip, cfg.block_k]
        bs_desc = TensorDescriptor(b_desc.base, b_desc.shape, b_desc.strides, strip)
        c_desc = _c_descriptor(out, cfg) if out.is_cuda else None
        cs_desc = (TensorDescriptor(out, list(out.shape), list(out.stride()),
                                    [cfg.block_m, cfg.strip]) if c_desc is not None else None)
        tiles = -(-m // cfg.block_m) * -(-n // tile_width(cfg))
        self._a_varies, self._b_varies = a_varies, self._b_pad is None
        self._c_tma = c_desc is not None
        vary = (("a_desc",) if a_varies else ()) + (("b_desc", "bs_desc") if self._b_varies
                                                    else ()) + (("c_desc", "cs_desc") if c_desc
                                                                else ())
        self.kernel = BoundKernel(
            strip_gemm_kernel, (max(1, min(tiles, program_budget(device, None))),),
            (a_desc, b_desc, bs_desc, c_desc, cs_desc, out, bias if bias is not None else out, m,
             n, k, out.stride(0), out.stride(1), int(bias is not None)),
            dict(B_KN=b_kn, C_TMA=c_desc is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 STRIP=cfg.strip, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            vary=vary + ("c_ptr", "bias_ptr"), device=device)

    def run(self, a: Optional[torch.Tensor], b: torch.Tensor, out: torch.Tensor,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Launch on the current stream (``a`` only when it varies, else None)."""
        values = _ab_values(a, b, self._a_varies, self._b_pad, 2)
        if self._c_tma:
            values += (out, out)
        self.kernel.launch(*values, out, bias if bias is not None else out)
        return out


class SkinnyGemm:
    """``out = A @ b (+ bias)`` by ``skinny_gemm_kernel`` (``cfg.swap_ab``: small M), bound once
    for a plan: one program per ``[cfg.block_n, cfg.block_m]`` tile of ``C^T``. Arguments as
    ``SplitKGemm``'s (``a_desc`` in ``[cfg.block_m, cfg.block_k]`` blocks; ``out`` any strides)."""

    def __init__(self, a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor], *, m: int, cfg: TileConfig, a_varies: bool,
                 b_pad: Optional[torch.Tensor] = None):
        cfg = fit_stages(cfg, out.device, b.element_size(), 0)  # (no staged C block)
        self.cfg = cfg
        self._b_pad, b_desc, b_kn = b_operand(b, cfg, b_pad)
        if self._b_pad is not None:
            b = self._b_pad
        n, k = b.shape[1], b.shape[0]
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        self._a_varies = a_varies
        vary = (("a_desc",) if a_varies else ()) + (("b_desc",) if self._b_pad is None else ())
        self.kernel = BoundKernel(
            skinny_gemm_kernel, (tiles,),
            (a_desc, b_desc, out, bias if bias is not None else out, m, n, k, out.stride(0),
             out.stride(1), int(bias is not None)),
            dict(B_KN=b_kn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            vary=vary + ("c_ptr", "bias_ptr"), device=out.device)

    def run(self, a: Optional[torch.Tensor], b: torch.Tensor, out: torch.Tensor,
            bias: Optional[torch.Tensor]) -> torch.Tensor:
        """One launch on the current stream (``a`` only when it varies, else None)."""
        self.kernel.launch(*_ab_values(a, b, self._a_varies, self._b_pad), out,
                           bias if bias is not None else out)
        return out


def launch_consumer(a_desc: TensorDescriptor, b: torch.Tensor, out: torch.Tensor,
                    bias: Optional[torch.Tensor], *, group: Optional[Group], wait: bool,
                    sig: torch.Tensor, offsets: torch.Tensor, claim: torch.Tensor,
                    record: torch.Tensor, m: int, programs: Optional[int] = None,
                    cfg: Optional[TileConfig] = None) -> torch.Tensor:
    """One launch of the persistent GEMM built for it (``wait=False``: a plain GEMM; the
    waiting arguments are unused), for benches that drive the kernel directly. ``cfg``: the
    configuration ``a_desc``'s blocks were made for (default the rule's, as ``CoreGemm``)."""
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
    """``matmul`` of one key: with ``core="ws"`` the warp-specialized core's plan
    (``WsGemm``; ``ValueError`` where ``_ws_launch.refusal`` refuses); with ``core="auto"``
    that plan where it is timed faster (``_tune``); else the portable core's tile
    configuration and K slices (``cfg`` and ``split_k``,
    else the rule's for the shapes and mode: ``select_split``), the operands' rows copied onto
    128-byte lines per call where the rule says (``pad_operands``; ``RowPad``) or where no
    descriptor reads them as they are (``padded_copy``), then the bound core (``CoreGemm``;
    ``SplitKGemm`` when K is split, ``SlicedTailGemm`` when only the last wave's is,
    ``StripGemm`` / ``SkinnyGemm`` for wide / small-M tiles; ``self.split``: the whole product's
    slices, 1 unsplit)."""

    def __init__(self, a, b, bias, out, cfg, deterministic, split_k=None, core="auto"):
        self.ws = self.core = self.a_copy = self.a_pad = self.b_copy = self.b_ex = None
        self.split, self.name = 1, "given"  # (the rule's candidate's name; benches print it)
        ws_mode = not deterministic or DET_ON_WS
        tune = (core == "auto" and cfg is None and split_k is None and ws_mode
                and TUNE_CORES and ws_refusal(a, b, out, bias) is None)
        if core == "ws" and cfg is None and split_k is None and ws_mode:
            why = ws_refusal(a, b, out, bias)
            if why is not None:
                raise ValueError(f"ditron.matmul: core='ws' refused: {why}")
            self.ws = WsGemm(a, b, out, bias, program_budget(a.device, None),
                             deterministic=deterministic)
            self.name = self.ws.name
            return
        elif core == "ws":
            raise ValueError("ditron.matmul: core='ws' takes the rule's plan in the default "
                             "mode only (no cfg or split_k; deterministic mode where "
                             "DET_ON_WS)")
        if not tune:
            self._build_tl(a, b, bias, out, cfg, deterministic, split_k)
            return
        # Tuning times bound kernels: each core's plan binds at the end of its own batch (the
        # plan cache's outer batch would bind them only after this build, and unbound kernels
        # launch through Triton's run: its host time, not the GPU's, would be timed).
        with compiler.batch("matmul"):
            self._build_tl(a, b, bias, out, cfg, deterministic, split_k)
        self._tune(a, b, bias, out, deterministic)

    def _build_tl(self, a, b, bias, out, cfg, deterministic, split_k) -> None:
        """The portable core's plan (the class docstring)."""
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        split = 1
        a_rows, b_rows = (a if tma_ok(a) else None), read_rows(b)  # (A has no transposed read)
        # Rows of K elements (A's; B's when given as a weight's ``w.t()``) are what
        # ``pad_operands`` weighs: a row-major [K, N] B's 512-byte box rows straddle one line
        # more, not twice as many, and were never measured slower (None: as on lines).
        b_k = None if b_rows is b else b_rows
        pad_a = pad_b = False
        if cfg is None:
            programs = program_budget(a.device, None)
            pad_a, pad_b = pad_operands(
                m, n, k, programs, a.device, deterministic=deterministic,
                out_bytes=out.element_size(), a_sectored=not off_sectors(a_rows),
                b_sectored=not off_sectors(b_k), elem_bytes=a.element_size())
            pad_a &= a_rows is not None  # (rows no descriptor reads: ``padded_copy`` below)
            pad_b &= b_k is not None
            lined = ((pad_a or row_alignment(a_rows) == 128)
                     and (pad_b or row_alignment(b_k) == 128))
            chosen, split = select_split(m, n, k, programs, a.device,
                                         deterministic=deterministic, split=split_k,
                                         out_bytes=out.element_size(), lined=lined)
            cfg, self.name = chosen.cfg, chosen.name
        elif split_k is not None and split_k > 1:  # a fixed configuration, split as asked
            split = slices(k, cfg.block_k, split_k)[0]
        self.a_copy = RowPad(a_rows) if pad_a else None
        self.a_pad = None if a_rows is not None else padded_copy(a)
        self.b_copy = RowPad(b_k) if pad_b else None
        a_ex = self.a_copy.buf if pad_a else a if self.a_pad is None else self.a_pad
        a_varies = a_ex is a
        self.b_ex = self.b_copy.buf.t() if pad_b else None
        b = b if self.b_ex is None else self.b_ex
        a_desc = TensorDescriptor(a_ex, list(a_ex.shape), list(a_ex.stride()),
                                  [cfg.block_m, cfg.block_k])
        if cfg.swap_ab:
            self.core = SkinnyGemm(a_desc, b, out, bias, m=m, cfg=cfg, a_varies=a_varies)
        elif split > 1:
            self.core = SplitKGemm(a_desc, b, out, bias, m=m, cfg=cfg, split=split,
                                   a_varies=a_varies)
            self.split = self.core.slices
        elif cfg.strip:
            self.core = StripGemm(a_desc, b, out, bias, m=m, cfg=cfg, a_varies=a_varies)
        elif cfg.tail_slices:
            self.core = SlicedTailGemm(a_desc, b, out, bias, m=m, cfg=cfg, a_varies=a_varies)
        else:
            sig, offsets, claim, record = _dummies(a.device)
            self.core = CoreGemm(a_desc, b, out, bias, group=None, wait=False, sig=sig,
                                 offsets=offsets, claim=claim, record=record, m=m, cfg=cfg,
                                 a_varies=a_varies)

    def _tune(self, a, b, bias, out, deterministic=False) -> None:
        """``core="auto"`` where the WS core takes the product: time the built ``tl`` plan and
        the WS core's on the call's tensors (both bound), keep the WS plan where it is faster
        than ``_tune.TUNE_MARGIN`` of the other (``prefer_ws``). Cached with the plan: a
        repeated call times nothing. Deterministic mode (``DET_ON_WS``): the WS core's one
        fixed data-parallel config, whose rows carry the bits of the portable core's
        batch-invariant tiles (so the choice, which M moves, moves no bit)."""
        ws = build_ws("matmul", lambda: WsGemm(a, b, out, bias, program_budget(a.device, None),
                                               deterministic=deterministic))
        if ws is None:
            return
        t_tl, t_ws = time_alternating([lambda: self.run(a, b, bias, out),
                                       lambda: ws.run(a, b, out, bias)], out.device)
        if prefer_ws(t_tl, t_ws):
            self.ws, self.name, self.split = ws, ws.name, 1
            self.core = self.a_copy = self.a_pad = self.b_copy = self.b_ex = None

    def run(self, a, b, bias, out):
        if self.ws is not None:
            return self.ws.run(a, b, out, bias)
        if self.a_copy is not None:
            self.a_copy(a)
            a = None
        elif self.a_pad is not None:
            self.a_pad.copy_(a)
            a = None
        if self.b_copy is not None:
            self.b_copy(b.t())
            b = self.b_ex
        return self.core.run(a, b, out, bias)


_MATMUL_PLANS = threading.local()
"""One plan cache per thread: a plan owns padded copies of unaligned operands, which virtual
ranks (threads) must not share."""


def matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None, cfg: Optional[TileConfig] = None, *,
           deterministic: Optional[bool] = None, split_k: Optional[int] = None,
           core: str = "auto") -> torch.Tensor:
    """Our persistent GEMM alone (the ag_gemm consumer without waits): ``a @ b + bias``.

    Parameters
    ----------
    a, b : torch.Tensor
        ``a [M, K]``, ``b [K, N]`` (any strides; ``w.t()`` works without a copy), fp16/bf16 on
        GPU (fp16/fp32 in the interpreter).
    bias : torch.Tensor, optional
        ``[N]``, added in fp32 before rounding.
    out : torch.Tensor, optional
        ``[M, N]`` (any strides; fp32 keeps the products unrounded, as deterministic mode's
        partial products are).
    cfg : TileConfig, optional
        A fixed tile configuration (benches: e.g. ``GPU_CONFIGS[name]``), unsplit unless
        ``split_k`` says; default the rule's (``select_split``) for M, N, K and the device's
        SMs.
    deterministic : bool, optional
        The rule picks only batch-invariant configurations (a row's bits do not depend on M)
        and never splits K; default the ``ditron_ops.deterministic()`` mode.
    split_k : int, optional
        K slices forced (benches and tests; default mode only): 1 runs the unsplit GEMM, S > 1
        fp32 partials of S slices summed in slice order (fewer when K has fewer ``BLOCK_K``
        steps to share). Default the rule's: a split only where the model predicts one
        clearly faster (``SPLIT_MARGIN``: fewer tiles than the SMs, long K).
    core : str
        ``"auto"``: where the warp-specialized sm_90 core takes the product
        (``_ws_launch.refusal``: rows on sectors, M > 32; no ``cfg`` or ``split_k``; the
        default mode, or deterministic mode where ``DET_ON_WS``),
        the faster of its plan and the portable core's, timed once when the plan is built
        (``_MatmulPlan._tune``; neither core wins everywhere: benchmarks/NOTES.md), else the
        portable ``tl`` core; ``"tl"`` / ``"ws"`` force one (``"ws"``: ``ValueError`` where it
        is refused).

    Returns
    -------
    torch.Tensor
        ``out``, or a new ``[M, N]`` tensor of ``a``'s dtype.

    Notes
    -----
    The core the benchmarks compare with cuBLAS. Plans are cached per (shapes, strides, dtypes,
    16-byte alignment, where A's and B's rows start in a 128-byte line, configuration, mode,
    split): a repeated call selects and compiles nothing; a new
    plan during CUDA-graph capture raises. A split plan owns its fp32 partials (``SplitKGemm``);
    its result differs from the unsplit one by fp32 rounding (the same bits run to run).
    """
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"ditron.matmul: split_k must be a positive int, got {split_k!r}")
    if core not in CORES:
        raise ValueError(f"ditron.matmul: core must be one of {CORES}, got {core!r}")
    m = a.shape[0]
    out = a.new_empty((m, b.shape[1])) if out is None else out
    if m == 0 or b.shape[1] == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    det = resolve_deterministic(deterministic)
    if det and split_k is not None and split_k > 1:
        raise ValueError(f"ditron.matmul: split_k={split_k} in deterministic mode; it never "
                         "splits K (a fixed K order per element keeps rows batch invariant)")
    if det and cfg is not None and cfg.tail_slices:
        raise ValueError(f"ditron.matmul: tail_slices={cfg.tail_slices} in deterministic mode; "
                         "it never splits K (a fixed K order per element keeps rows batch "
                         "invariant)")
    return _plan(_matmul_key(a, b, bias, out, cfg, det, split_k, core), a, b, bias, out, cfg,
                 det, split_k, core).run(a, b, bias, out)


def _matmul_key(a, b, bias, out, cfg, det, split_k, core="auto") -> tuple:
    """A ``matmul`` plan's key: the tensors' ``tensor_key`` and where A's and B's rows start
    within a 128-byte line (``pad_operands`` and ``select_split(lined=)`` read it: views of
    one layout 16 bytes apart get plans of their own)."""
    e = a.element_size()
    b_pitch = b.stride(0) if b.stride(1) == 1 else b.stride(1)
    lines = ((a.data_ptr() | a.stride(0) * e) & (LINE_BYTES - 1),
             (b.data_ptr() | b_pitch * e) & (LINE_BYTES - 1))
    return ("matmul", a.device, cfg, det, split_k, core, tensor_key(a), tensor_key(b),
            tensor_key(bias), tensor_key(out), lines)


def _plan(key, a, b, bias, out, cfg, det, split_k, core="auto") -> _MatmulPlan:
    """This thread's plan of ``key`` (built on a miss)."""
    cache = getattr(_MATMUL_PLANS, "cache", None)
    if cache is None:
        cache = _MATMUL_PLANS.cache = PlanCache(None)
    return cache.get(key, lambda: _MatmulPlan(a, b, bias, out, cfg, det, split_k, core))


def _plan_of(a, b, out, deterministic, core="auto") -> "_MatmulPlan":
    """The plan ``matmul(a, b, out=out)`` runs (built here when missing, as the call would)."""
    out = a.new_empty((a.shape[0], b.shape[1])) if out is None else out
    det = resolve_deterministic(deterministic)
    return _plan(_matmul_key(a, b, None, out, None, det, None, core), a, b, None, out, None, det,
                 None, core)


def build_ws(purpose: str, make):
    """``make()`` (a ``WsGemm``) bound in its own ``compiler.batch`` (compile errors raised at
    its end), or None where the portable core must serve instead: the plan's own limits
    (``RuntimeError`` of WsGemm's checks, Triton's ``OutOfResources`` for one config), or a
    Gluon this module does not know (``mark_broken``: one warning, every later plan
    portable). Out-of-memory and bad arguments propagate."""
    try:
        with compiler.batch(purpose):
            return make()
    except (torch.OutOfMemoryError, ValueError):
        raise
    except RuntimeError:
        return None
    except Exception as exc:  # noqa: BLE001 - a Gluon this module does not know
        if type(exc).__name__ != "OutOfResources":
            ws_mark_broken(exc)
        return None


def prefers_ws(a, b, bias, out) -> bool:
    """Whether ``matmul(a, b, bias, out)`` (``core="auto"``, the default mode) runs on the WS
    core: its plan, built here when missing (both cores timed on these tensors, ``_tune``).
    The ag_gemm consumer's choice for its gathered buffer."""
    return _plan(_matmul_key(a, b, bias, out, None, False, None), a, b, bias, out, None, False,
                 None).ws is not None


def matmul_split(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 deterministic: Optional[bool] = None, core: str = "auto") -> int:
    """The K slices ``matmul(a, b, out=out, core=core)`` runs the whole product in (1:
    unsplit, also where only a partial last wave is sliced: the ``config`` name's ``/kt<S>``,
    and a WS plan), from its plan: what ``bench gemm_sweep`` records as ``split_k``."""
    return _plan_of(a, b, out, deterministic, core).split


def matmul_config(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                  deterministic: Optional[bool] = None, core: str = "auto") -> str:
    """The candidate that ``matmul(a, b, out=out, core=core)`` runs (``ws:...`` for a WS
    plan), with ``+copyA`` / ``+copyB`` where its plan copies an operand's rows onto lines
    (``pad_operands``): what ``bench gemm_sweep`` records as ``config``."""
    plan = _plan_of(a, b, out, deterministic, core)
    return plan.name + "".join(f"+copy{x}" for x, c in (("A", plan.a_copy), ("B", plan.b_copy))
                               if c is not None)
