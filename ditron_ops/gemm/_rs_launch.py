"""Host side of gemm_rs / gemm_ar: workspace, descriptors, the launches of one call (the
reduce-scatter GEMM, its own start barrier; or start barrier + broadcast GEMM + finish for
one-shot)."""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..language.barrier import start_barrier_kernel
from ..runtime.group import Group, op_id
from ..runtime.launcher import BoundKernel, unused_pointer
from ..runtime.plan import tensor_key
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from ._pad import padded_copy, tma_ok
from ._core import (Scales, b_descriptor, build_ws, consumer_programs, half_b_descriptor,
                    program_budget, rule_configs, scaled_config, select_config, tail_tiles)
from ._rs_kernels import gemm_broadcast_kernel, gemm_rs_kernel, reduce_finish_kernel
from . import _ws_scaled as ws_scaled
from ._ws_launch import WsGemm, precompile_ws
from ._ws_launch import core_refusal as ws_core_refusal
from ._ws_launch import refusal as ws_refusal

PURPOSE = "gemm_reduce"
_FINISH_BLOCK = dict(BLOCK_R=8, BLOCK_C=256)
PRODUCER_CORE = "tl"
"""The core of the fused path's partial GEMM: ``"tl"`` (the portable kernels: the
reduce-scatter kernel, or the broadcast GEMM + finish) or ``"ws"`` (the warp-specialized sm_90
core pushing fp32 tiles into the slots, ``_ws_kernels._push_part``, then the finish kernel's
rank-ordered sum, reduce-scatter and one-shot alike) where ``_ws_producer`` allows it. Part of
the plan key. Ranks may differ (a rank whose K slice the WS core refuses runs the portable
kernel): both paths write slot ``rank`` of the owners' slots, count one call in and one
``CALL_UNIT`` out per rank. ``"tl"`` until a GPU run measures the WS producer.
``using_producer_core`` overrides it for the calling thread (benches)."""
SCALED_PRODUCER_CORE = "ws"
"""``PRODUCER_CORE`` of the fp8 ops (``gemm_rs_scaled`` / ``gemm_ar_scaled``): ``"ws"`` runs
the fp8 WS core's pushing form (``_ws_scaled_kernels``' ``PUSH``, default mode) where it takes
the operands and this rank's K reaches ``SCALED_WS_MIN_K``, in place of the portable kernels,
whose fp8 forms spill; ``"tl"`` the portable kernels always."""
SCALED_WS_MIN_K = {1: 6144, 2: 2048}
"""Per scale mode (1 tensor / row, 2 blocks), the least K of this rank's product the fp8 WS
producer takes: its fp32 sums make a round trip through the slots (a cost per output element)
where the portable kernel keeps its own rows in registers but runs each K step slower (its fp8
forms spill), so the WS producer wins from a K on; each threshold sits between the K where it
lost and the K where it won (measured: benchmarks/NOTES.md, fp8)."""
PRODUCER_CORES = ("tl", "ws")
_LOCAL = threading.local()


def producer_core(scaled: bool = False) -> str:
    """``PRODUCER_CORE`` (``scaled``: ``SCALED_PRODUCER_CORE``), or this thread's
    ``using_producer_core`` override."""
    return getattr(_LOCAL, "core", None) or (SCALED_PRODUCER_CORE if scaled else PRODUCER_CORE)


@contextlib.contextmanager
def using_producer_core(core: str):
    """Plans built by this thread inside take ``core`` (a virtual rank is a thread: each
    rank's setting is its own)."""
    saved, _LOCAL.core = getattr(_LOCAL, "core", None), core
    try:
        yield
    finally:
        _LOCAL.core = saved
LOWP_PARTIALS = False
"""Experimental (the benches' ``--lowp-partials`` sets it before any plan is built, so plans compile
its variants): in the default (non-deterministic) mode the partial tiles travel and wait in the
input dtype instead of fp32 (half the NVLink bytes; each partial rounded once before the fp32
rank-ordered sum, the precision of cuBLAS + NCCL). Off: not yet measured (the fp32 partials may
be why gemm_rs gains only 1.04x against a bound of 1.38x on 2 H200s; benchmarks/NOTES.md,
gemm_rs / gemm_ar). Deterministic mode always keeps fp32 partials."""


def finish_programs(group: Group) -> int:
    """Programs of the finish kernel: this rank's share of the SMs (they wait, so all ranks'
    programs must fit on the GPU together)."""
    return group.sm_share() if group.device.type == "cuda" else 1


def fused(group: Group, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: list[int],
          *, broadcast: bool, op: str, partials: torch.dtype = torch.float32,
          deterministic: bool = True, tensor_keys: Optional[tuple] = None,
          scales: Optional[Scales] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One call: scattered partial GEMM with the reduction in its epilogue (its own start
    barrier), or start barrier + broadcast GEMM + finish (one-shot), into ``out``.

    ``rows[s]``: rows of the product owned by rank s (reduce-scatter). ``broadcast``: every rank
    receives every partial and reduces all rows (one-shot all-reduce; ``rows`` unused).
    ``partials``: dtype of the partial tiles in the slots (fp32, or the input dtype: see
    ``LOWP_PARTIALS``); the sums are fp32 either way. ``deterministic``: the tiles are picked
    among the batch-invariant configurations only (``select_config``). ``tensor_keys``:
    ``(a, b)``'s ``tensor_key``s when the caller has them (its validation key). Everything but
    the launches comes from the call's plan. ``scales``: fp8 operands' scales (the call's
    tensors; ``tile_product``'s ``SCALE``), each rank's own, applied to its partial. ``bias``:
    ``[N]``, added once, to rank 0's partial (``_rs_kernels._plus_bias``; other ranks ignore it).
    """
    group.check()
    if tensor_keys is None:
        tensor_keys = (tensor_key(a), tensor_key(b))
    scale_key = None if scales is None else (scales.mode, scales.a_row, scales.b_row,
                                             tensor_key(scales.a), tensor_key(scales.b))
    bias = bias if group.rank == 0 else None
    key = (op, broadcast, partials, deterministic, producer_core(scales is not None), *tensor_keys,
           None if broadcast else tuple(rows), scale_key, out.dtype,  # out: made by the op
           tensor_key(bias))
    plan = group.plans.get(key, lambda previous=None: RsPlan(group, a, b, out, rows, broadcast, op,
                                                             partials, previous, deterministic,
                                                             scales, bias))
    return plan.run(a, b, out, scales, bias)


class RsPlan:
    """gemm_rs / gemm_ar's fused path for one key: slots in the workspace, descriptors, grids
    and the bound launches."""

    def __init__(self, group: Group, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 rows: list[int], broadcast: bool, op: str, partials: torch.dtype,
                 previous: "RsPlan | None" = None, deterministic: bool = True,
                 scales: Optional[Scales] = None, bias: Optional[torch.Tensor] = None):
        self.group, self.op, self.broadcast = group, op, broadcast
        self.ws = ws = group.workspace(PURPOSE)
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        # Every rank must run the same tiles (partial tiles and slots are exchanged): the rule
        # sees only M, N, the mode and the SM share, which all ranks agree on, never K_r.
        budget = program_budget(a.device, group)
        self.cfg = cfg = select_config(m, n, budget, a.device, deterministic=deterministic)
        if scales is not None:  # fp8 (``scaled_config``)
            self.cfg = cfg = scaled_config(cfg, scales.mode, m, n, budget, deterministic)
        self.scaled = scales is not None
        scale_args = ((unused_pointer(out.device, out.dtype),) * 2 + (0, 0) if scales is None
                      else (scales.a, scales.b, scales.a_row, scales.b_row))
        scale_vary = ("sa_ptr", "sb_ptr") if self.scaled else ()
        self.has_bias = bias is not None
        scale_args += (unused_pointer(out.device, out.dtype),)  # bias_ptr (a call's bias: vary)
        if self.has_bias:
            scale_vary += ("bias_ptr",)
        w, rank = group.world_size, group.rank
        slot_rows = m if broadcast else max(rows)
        self.data = data = ws.ensure_data(max(1, w * slot_rows * n * partials.itemsize))
        buf = data.local.view(partials)
        offsets = None if broadcast else ws.row_offsets(rows, op)  # (uploads before any wait)
        if previous is not None:  # a stale plan of this key: its padded buffers, no allocation
            self.a_pad, self.b_pad = previous.a_pad, previous.b_pad
        else:
            self.a_pad = None if tma_ok(a) else padded_copy(a)
            self.b_pad = None if (tma_ok(b) or tma_ok(b.t())) else padded_copy(b)
        a_ex = a if self.a_pad is None else self.a_pad
        a_desc = TensorDescriptor(a_ex, list(a_ex.shape), list(a_ex.stride()),
                                  [cfg.block_m, cfg.block_k])
        b_desc, b_kn = b_descriptor(b if self.b_pad is None else self.b_pad, cfg)
        record, claim = group._error_tensors()
        sig, timeout = ws.signal_pad(), group.timeout_us()
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        aligned = n % 16 == 0 and out.stride(0) % 16 == 0  # vector loads/stores of the slots and out
        programs = consumer_programs(a.device, group, tiles)
        tiles_cfg = dict(B_KN=b_kn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         ALIGNED=aligned)
        if self.scaled:
            tiles_cfg["SCALE"] = scales.mode
        if self.has_bias:
            tiles_cfg["HAS_BIAS"] = True
        # per call: a (unless padded), b (unless padded), out (and its descriptor)
        ab = (("a_desc",) if self.a_pad is None else ()) + (("b_desc",) if self.b_pad is None else ())
        device = a.device
        self.ws_gemm = self._ws_producer(a, b, out, bias, rows, slot_rows, buf, data, offsets,
                                         partials, deterministic, budget, previous, scales)
        if broadcast or self.ws_gemm is not None:
            self.start = BoundKernel(start_barrier_kernel, (1,),
                                     (sig, ws.signal.ptr_table, claim, record, rank, w, m, timeout,
                                      op_id(op)), {}, device=device)
            self.finish = BoundKernel(reduce_finish_kernel, (finish_programs(group),),
                                      (buf, out, sig, ws.signal.ptr_table, claim, record,
                                       m if broadcast else rows[rank], n, out.stride(0),
                                       slot_rows, rank, w, timeout, op_id(op)),
                                      dict(ALIGNED=aligned, **_FINISH_BLOCK), vary=("out_ptr",),
                                      device=device)
            self.c_tma = False
        if broadcast and self.ws_gemm is None:
            self.gemm = BoundKernel(gemm_broadcast_kernel, (programs,),
                                    (a_desc, b_desc, buf, data.ptr_table, m, n, k, slot_rows, rank,
                                     w) + scale_args, tiles_cfg, vary=ab + scale_vary,
                                    device=device)
        elif self.ws_gemm is None:
            lo, hi = sum(rows[:rank]), sum(rows[:rank + 1])
            c_desc, slots_desc = _epilogue_descriptors(out, buf, w * slot_rows, cfg)
            self.c_tma = c_desc is not None
            if self.b_pad is None and "b_desc" in ab:
                ab = ab + ("bh_desc",)
            self.gemm = BoundKernel(
                gemm_rs_kernel, (programs,),
                (a_desc, b_desc, half_b_descriptor(b_desc, b_kn, cfg), slots_desc, c_desc, buf,
                 data.ptr_table, offsets, out, sig, ws.signal.ptr_table, claim, record, m, n, k,
                 slot_rows, out.stride(0), lo, hi, own_tail(m, n, lo, hi, programs, cfg), rank, w,
                 timeout, op_id(op)) + scale_args,
                dict(C_TMA=self.c_tma, SPLIT_TAIL=cfg.split_tail, **tiles_cfg),
                vary=ab + (("c_desc",) if self.c_tma else ()) + ("out_ptr",) + scale_vary,
                device=device)

    def _ws_producer(self, a, b, out, bias, rows, slot_rows, buf, data, offsets, partials,
                     deterministic, budget, previous, scales):
        """The WS core's pushing GEMM (``producer_core`` ``"ws"``) where it takes the product:
        default mode, fp32 partials, N a multiple of 16 (its 8-byte stores), operands it reads
        as they are; bf16/fp16 without bias (``_ws_launch.refusal``), or fp8 with ``scales``
        and rank 0's bias (``_ws_scaled.refusal``, K from ``SCALED_WS_MIN_K``, the config of
        ``consumer_config``'s wave rule: a kernel writing peers' slots is not timed); else None
        (the portable kernels).
        A stale plan's rebuild keeps the previous plan's choice; a WS build or compile failure
        falls back (``_core.build_ws``)."""
        core = producer_core(self.scaled)
        if core not in PRODUCER_CORES:
            raise ValueError(f"ditron.{self.op}: PRODUCER_CORE must be one of {PRODUCER_CORES}")
        if (core == "tl" or deterministic or partials != torch.float32 or b.shape[1] % 16
                or self.a_pad is not None or self.b_pad is not None
                or (previous is not None and previous.ws_gemm is None)):
            return None
        if self.scaled:
            if ws_scaled.refusal(a, b, None, bias) or a.shape[1] < SCALED_WS_MIN_K[scales.mode]:
                return None
        elif bias is not None or ws_refusal(a, b, None, bias):
            return None
        if offsets is None:  # (broadcast: never read)
            offsets = torch.zeros(1, dtype=torch.int32, device=a.device)
        push = (buf, data.ptr_table, offsets, slot_rows, self.group.rank, self.group.world_size,
                self.broadcast)
        if self.scaled:
            config = ws_scaled.consumer_config(scales.mode, a.shape[0], b.shape[1], budget)
            return build_ws(PURPOSE, lambda: ws_scaled.WsScaledGemm(
                a, b, out, bias, scales.a, scales.b, scales.a_row, scales.b_row, scales.mode,
                config, sms=budget, push=push))
        return build_ws(PURPOSE, lambda: WsGemm(a, b, out, bias, budget, push=push))

    def stale(self) -> bool:
        """The workspace grew since (another call's plan): the slots are of a freed buffer."""
        return self.ws.data is not self.data

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
            scales: Optional[Scales] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        group, ws = self.group, self.ws
        values = []
        if self.a_pad is None:
            values.append(a)
        else:
            self.a_pad.copy_(a)
        if self.b_pad is None:
            values.append(b)
            if not self.broadcast:
                values.append(b)  # the half-width descriptor over the same memory
        else:
            self.b_pad.copy_(b)
        ws.calls += 1
        scale_values = [scales.a, scales.b] if self.scaled else []
        if self.has_bias:
            scale_values.append(bias)
        with group.waiting_launch(self.op, ws.calls):
            if self.ws_gemm is not None:
                self.start.launch()
                if self.scaled:
                    self.ws_gemm.run(a, b, out, bias, scales.a, scales.b)
                else:
                    self.ws_gemm.run(a, b, out, bias)
                self.finish.launch(out)
            elif self.broadcast:
                self.start.launch()
                self.gemm.launch(*values, *scale_values)
                self.finish.launch(out)
            else:
                if self.c_tma:
                    values.append(out)
                values.append(out)
                self.gemm.launch(*values, *scale_values)
        if group.sync_check:
            group.synchronize()
        return out


def own_tail(m: int, n: int, lo: int, hi: int, programs: int, cfg) -> int:
    """``tail_tiles`` of the reduce-scatter GEMM when its partial last wave lies within this
    rank's whole row tiles (the kernel's last tiles; ``[lo, hi)`` its rows), else 0."""
    tiles_m, tiles_n = -(-m // cfg.block_m), -(-n // cfg.block_n)
    full_end = tiles_m if hi == m else hi // cfg.block_m
    own = max(full_end - -(-lo // cfg.block_m), 0) * tiles_n
    tail = tail_tiles(tiles_m * tiles_n, programs, cfg)
    return tail if tail <= own else 0


def _epilogue_descriptors(out: torch.Tensor, buf: torch.Tensor, slot_rows_total: int, cfg):
    """``(c_desc, slots_desc)`` for the TMA epilogue of whole own tiles (``_reduce_store_tma``):
    ``out [rows_r, N]`` and the slots ``[W * slot_rows, N]`` in half-tile blocks; or
    ``(None, None)`` (masked pointer epilogue) when ``out`` cannot back a descriptor."""
    if not tma_ok(out):
        return None, None
    n = out.shape[1]
    block = [cfg.block_m, cfg.block_n // 2]
    slots = buf[:slot_rows_total * n].view(slot_rows_total, n)
    return (TensorDescriptor(out, list(out.shape), list(out.stride()), block),
            TensorDescriptor(slots, [slot_rows_total, n], [n, 1], block))


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """Every variant (tile configuration the rule can pick x dtype x B layout x epilogue;
    reduce-scatter, broadcast and finish) as one-rank launches (``runtime.precompile``); the
    WS producer's forms where ``PRODUCER_CORE`` may choose it (``precompile_ws``)."""
    for cfg in rule_configs(device):
        _precompile_tiles(device, dtypes, cfg)
    if PRODUCER_CORE != "tl" and device.type == "cuda" and ws_core_refusal(device) is None:
        slots = torch.zeros(1 << 16, dtype=torch.float32, device=device)
        offsets = torch.tensor([0, 64], dtype=torch.int32, device=device)
        for broadcast in (False, True):
            precompile_ws(device, dtypes, push=(slots, pointer_table(slots), offsets, 64, 0, 1,
                                                broadcast))


def _precompile_tiles(device: torch.device, dtypes: tuple, cfg) -> None:
    """``_precompile``'s variants of one tile configuration."""
    variants = itertools.product((d for d in (torch.float16, torch.bfloat16) if d in dtypes),
                                 (True, False), (False, True) if LOWP_PARTIALS else (False,))
    for dtype, aligned, lowp in variants:
        a = torch.ones(64, 64, dtype=dtype, device=device)
        out = torch.empty(64, 64, dtype=dtype, device=device)
        for b in (a.clone(), a.clone().t()):
            _precompile_launches(device, cfg, a, b, out, dtype if lowp else torch.float32,
                                 aligned)


def precompile_scaled(device: torch.device, out_dtype: torch.dtype, cfg, mode: int) -> None:
    """The fp8 variants (``gemm_rs_scaled`` / ``gemm_ar_scaled``) of one tile configuration
    (``BLOCK_K`` 128), output dtype and scale mode (``SCALE``): e4m3 A and the K-major B the op
    passes, fp32 partials, with and without rank 0's bias (``HAS_BIAS``)."""
    a = torch.ones(64, 128, dtype=torch.float8_e4m3fn, device=device)
    b = a.clone().t()
    out = torch.empty(64, 64, dtype=out_dtype, device=device)
    one = torch.ones(64, device=device)
    for aligned, bias in itertools.product((True, False), (False, True)):
        _precompile_launches(device, cfg, a, b, out, torch.float32, aligned,
                             dict(SCALE=mode, **({"HAS_BIAS": True} if bias else {})),
                             (one, one, 1, 1, out))


def _precompile_launches(device, cfg, a, b, out, partials: torch.dtype, aligned: bool,
                         extra: Optional[dict] = None, scale_args: tuple = ()) -> None:
    """The reduce-scatter GEMM (either epilogue), broadcast GEMM and finish of one operand
    layout as one-rank launches (``extra``: constexprs; ``scale_args``: the scale and bias
    arguments, default none)."""
    offsets = torch.tensor([0, 64], dtype=torch.int32, device=device)
    tiles_cfg = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     **(extra or {}))
    scale_args = scale_args or (out, out, 0, 0, out)
    buf = torch.zeros(64 * 64, dtype=partials, device=device)
    table = pointer_table(buf)
    k = a.shape[1]
    a_desc = TensorDescriptor(a, list(a.shape), [k, 1], [cfg.block_m, cfg.block_k])
    sig, sig_table, claim, record = one_rank_pad(device)
    b_desc, b_kn = b_descriptor(b, cfg)
    for c_tma in (True, False):
        c_desc, slots_desc = (_epilogue_descriptors(out, buf, 64, cfg) if c_tma
                              else (None, None))
        BoundKernel(gemm_rs_kernel, (1,),
                    (a_desc, b_desc, half_b_descriptor(b_desc, b_kn, cfg), slots_desc,
                     c_desc, buf, table, offsets, out, sig, sig_table, claim, record, 64,
                     64, k, 64, 64, 0, 64, 0, 0, 1, 10**6, 0) + scale_args,
                    dict(B_KN=b_kn, ALIGNED=aligned, C_TMA=c_tma,
                         SPLIT_TAIL=cfg.split_tail, **tiles_cfg), device=device)
    BoundKernel(gemm_broadcast_kernel, (1,),
                (a_desc, b_desc, buf, table, 64, 64, k, 64, 0, 1) + scale_args,
                dict(B_KN=b_kn, ALIGNED=aligned, **tiles_cfg), device=device)
    BoundKernel(reduce_finish_kernel, (1,),
                (buf, out, sig, sig_table, claim, record, 64, 64, 64, 64, 0, 1, 10**6, 0),
                dict(ALIGNED=aligned, **_FINISH_BLOCK), device=device)


register_precompile(PURPOSE, _precompile, ("gemm_rs", "gemm_ar"))
