"""Host side of ag_gemm: workspace, the copy-engine (or SM pull) producer, the launches of one
fused call, the precompile list. The GEMM itself is the shared core (``_core``)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import DitronError
from ..language.barrier import start_barrier_kernel
from ..runtime import cuda_driver
from ..runtime.group import Group, op_id
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from ..runtime.launcher import BoundKernel
from ..runtime.plan import tensor_key
from ._ag_kernels import ag_gemm_push_kernel, ag_publish_kernel, ag_pull_kernel
from ._core import (CoreGemm, Scales, build_ws, consumer_programs, prefers_ws,
                    program_budget, rule_configs, scaled_config, select_config)
from ._ws_launch import WsGemm, precompile_ws
from ._ws_launch import core_refusal as ws_core_refusal
from ._ws_launch import refusal as ws_refusal

PURPOSE = "ag_gemm"
PRODUCERS = ("copy", "pull", "push")
PRODUCER = "auto"
"""How the fused path moves the shards: ``"copy"``, copy engines on a side stream (no SM);
``"pull"``, ``ag_pull_kernel`` on ``pull_programs`` SMs taken from the GEMM; ``"push"``, the
GEMM kernel's own programs push this rank's rows before their tiles (``ag_gemm_push_kernel``: the
whole call is one launch); ``"auto"``, push for gathers of at most ``PUSH_MAX_BYTES``, else copy.
The ``ag_gemm`` bench measures them (``producer`` rows)."""
CONSUMER_CORES = ("auto", "tl", "ws")
CONSUMER_CORE = "tl"
"""The GEMM core of the copy and pull producers' consumer (default ``"tl"`` until the waiting
WS consumer has a GPU run: benchmarks/NOTES.md, ag_gemm): ``"auto"``, the warp-specialized
core where it takes the gathered product (``_ws_launch.refusal``) and the plain ``matmul``
times it faster on these operands (``_core.prefers_ws``: its choice for the gathered buffer,
B, bias and out, made once per plan), else the portable one; ``"tl"`` / ``"ws"`` force one
(tests, benches; ``"ws"`` still falls back where the WS core refuses). Ranks may differ: each
rank's consumer only waits for flags. The push producer runs the portable core (its kernel
pushes the rows); fp8 rows follow ``SCALED_CONSUMER_CORE``."""
SCALED_CONSUMER_CORE = "ws"
"""The copy and pull producers' consumer of fp8 rows (``ag_gemm_scaled``): ``"ws"``, the fp8 WS
core's split kernel waiting for chunks (``_ws_scaled.consumer_config``) where it takes the
operands, else the portable core; ``"tl"`` the portable core. Default ``"ws"``: with every
chunk present it runs close to the plain scaled GEMM, the portable consumer about half as fast
(``bench fp8 --only present``; figures: benchmarks/NOTES.md, fp8)."""
PUSH_MAX_BYTES = 1 << 20
"""``"auto"`` pushes gathers (``ΣM_r · K`` elements) of at most this many bytes: the call is
then host-bound (a fused call with copy engines costs four launches, a copy, and a stream fork
and join: 3.3x ``torch.matmul``'s host time on the H200 machine, against one launch), and the
copy by the GEMM's programs is a few µs. Rank-uniform (a function of the shard sizes and K)."""
PULL_SM_FRACTION = 8
"""Pull mode: one SM in this many of a rank's share runs the pull kernel (at least one)."""
_PULL_BLOCK, _PULL_WARPS = 4096, 8
_PUSH_BLOCK, _PUSH_BLOCK_INTERPRETER = 4096, 256


def k_pitch(k: int, elem: int) -> int:
    """Row pitch (elements) of the gathered buffer: ``k`` rounded up to 16 bytes."""
    return -(-k * elem // 16) * 16 // elem


def pull_programs(group: Group) -> int:
    """Programs of the pull kernel (pull mode); the consumer runs on the rest of the share. One
    in the interpreter, which runs a grid's programs one after the other (a program waiting for
    a peer whose chunk needs this rank's later programs would never return)."""
    if group.device.type != "cuda":
        return 1
    return max(1, group.sm_share() // PULL_SM_FRACTION)


@dataclasses.dataclass(frozen=True)
class ScaledRows:
    """fp8 rows (``ag_gemm_scaled``): ``a`` is the packed rows as fp32 words (``scaled.packed_row``):
    ``k`` fp8 values a row, then its scales from word ``scale_word``; ``mode`` the kernel's
    ``SCALE``; ``b_row`` the stride of ``scale_b`` (``scaled._b_scales``). The transport is that
    of any rows; the consumer reads A as fp8 and its scales from the gathered buffer."""
    k: int
    mode: int
    scale_word: int
    b_row: int

    def views(self, words: torch.Tensor, m: int, pitch: int) -> tuple:
        """``(a8, sa)`` of ``m`` packed rows ``pitch`` words apart from the start of the flat
        fp32 ``words``: the e4m3 values ``[m, k]`` a consumer reads, and the base of their
        scales (a row's ``pitch`` floats after the last's)."""
        a8 = torch.as_strided(words.view(torch.float8_e4m3fn), (m, self.k),
                              (pitch * words.element_size(), 1))
        return a8, words[self.scale_word:]


def fused(group: Group, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor],
          out: torch.Tensor, shard_sizes: list[int], gathered: Optional[torch.Tensor],
          producer: Optional[str] = None, own_out: bool = False, tensor_keys=None,
          scaled: Optional[ScaledRows] = None, scale_b: Optional[torch.Tensor] = None) -> None:
    """One fused call (schedule in ``_ag_kernels``): start barrier, all-gather on a side stream
    with a flag per chunk, persistent GEMM over the gathered rows as chunks land; or, pushed,
    all of it in one kernel (``producer``, default ``PRODUCER``). Everything but the launches
    comes from the call's plan.

    ``own_out``: ``out`` was allocated by the op (contiguous, aligned: its layout follows from
    the shapes, so the key leaves it out). ``tensor_keys``: ``(a, b, bias)``'s ``tensor_key``s
    when the caller has them. Every path to the same layouts builds the same key."""
    group.check()
    producer = producer or PRODUCER
    if producer == "auto":
        producer = "push" if sum(shard_sizes) * a.shape[1] * a.element_size() <= PUSH_MAX_BYTES \
            else "copy"
    if tensor_keys is None:
        tensor_keys = (tensor_key(a), tensor_key(b), tensor_key(bias))
    core = _consumer_core(scaled)  # (read once: the key's and the plan's)
    key = ("ag_gemm", producer, core, *tensor_keys, None if own_out else tensor_key(out),
           tuple(shard_sizes), scaled, None if scaled is None else tensor_key(scale_b), out.dtype)
    plan = group.plans.get(key, lambda previous=None: AgGemmPlan(
        group, a, b, bias, out, shard_sizes, producer, previous, scaled, scale_b, core))
    plan.run(a, b, bias, out, gathered, scale_b)


def _consumer_core(scaled: Optional[ScaledRows]) -> str:
    """The consumer core setting of a call: ``CONSUMER_CORE``, or ``SCALED_CONSUMER_CORE`` for
    fp8 rows."""
    return CONSUMER_CORE if scaled is None else SCALED_CONSUMER_CORE


class AgGemmPlan:
    """ag_gemm's fused path for one key (producer, dtypes, shapes, strides, alignment, shard
    sizes): the gathered buffer's views and descriptor, the producer's copies (one region per
    destination, in push order) and its bound launches, the start barrier and the consumer."""

    def __init__(self, group: Group, a: torch.Tensor, b: torch.Tensor,
                 bias: Optional[torch.Tensor], out: torch.Tensor, shard_sizes: list[int],
                 producer: str, previous: "AgGemmPlan | None" = None,
                 scaled: Optional[ScaledRows] = None, scale_b: Optional[torch.Tensor] = None,
                 core: Optional[str] = None):  # (core: _consumer_core(scaled) if None)
        if producer not in PRODUCERS:
            raise ValueError(f"ditron.ag_gemm: producer must be one of {PRODUCERS}, got {producer!r}")
        self.group, self.producer = group, producer
        self.gpu = a.is_cuda
        self.device_index = a.device.index if a.device.index is not None else 0
        # the side stream's raw handles (the group's): copy and pull producers only
        self.side = group.side_stream() if self.gpu and producer != "push" else None
        self.ws = ws = group.workspace(PURPOSE)
        m, k = sum(shard_sizes), a.shape[1]
        # the rule's tiles for the gathered product on the programs the consumer may use (pull
        # mode: the share less the pull kernel's); every rank gathers the same M, N, K
        budget = program_budget(a.device, group)
        if producer == "pull" and a.is_cuda:
            budget = max(1, group.sm_share() - pull_programs(group))
        self.cfg = cfg = select_config(m, b.shape[1], budget, a.device, deterministic=False)
        if scaled is not None:  # fp8 (``scaled_config``)
            self.cfg = cfg = scaled_config(cfg, scaled.mode, m, b.shape[1], budget)
        w, rank = group.world_size, group.rank
        elem = a.element_size()
        pitch = k_pitch(k, elem)
        self.data = data = ws.ensure_data(m * pitch * elem)
        if data.peers is None and producer == "copy":
            raise DitronError(f"ditron.ag_gemm: group {group.group_name!r} ({group.backend}) gives "
                              "no peer tensors for copy-engine transfers")
        buf = data.local.view(a.dtype)
        self.gathered_view = buf[:m * pitch].view(m, pitch)[:, :k]
        scales = self._fp8 = None
        if scaled is None:
            a_desc = TensorDescriptor(buf, [m, k], [pitch, 1], [cfg.block_m, cfg.block_k])
        else:  # fp8 values at the start of each packed row, its scales from scale_word
            self._fp8 = a8, sa = scaled.views(buf, m, pitch)
            a_desc = TensorDescriptor(a8, [m, scaled.k], list(a8.stride()),
                                      [cfg.block_m, cfg.block_k])
            scales = Scales(scaled.mode, sa, scale_b, pitch, scaled.b_row, a_varies=False)
        offsets = ws.row_offsets(shard_sizes, "ag_gemm")
        rows, first = shard_sizes[rank], sum(shard_sizes[:rank])
        # one contiguous [rows, pitch] region per chunk; for the pull kernel also 16-byte aligned
        # (its only specialisation: an unaligned view would compile another variant mid-call)
        aligned = a.is_contiguous() and pitch == k and (producer == "copy" or a.data_ptr() % 16 == 0)
        if previous is not None:  # a stale plan of this key: its padded buffers, no allocation
            self.src_pad = previous.src_pad
        else:
            self.src_pad = None if aligned else a.new_empty((rows, pitch))
        record, claim = group._error_tensors()
        sig, timeout = ws.signal_pad(), group.timeout_us()
        self.start = None if producer == "push" else BoundKernel(  # (push: its own start)
            start_barrier_kernel, (1,), (sig, ws.signal.ptr_table, claim, record, rank, w, rows,
                                         timeout, op_id("ag_gemm")), {}, device=a.device)
        programs = None  # the core's default grid
        push = None
        if producer == "push":  # one launch: the core kernel's programs push the rows first
            push = dict(kernel=ag_gemm_push_kernel, sig_table=ws.signal.ptr_table,
                        src=a if self.src_pad is None else self.src_pad, buf=buf,
                        buf_table=data.ptr_table, pitch=pitch, src_varies=self.src_pad is None,
                        copy_block=_PUSH_BLOCK if a.is_cuda else _PUSH_BLOCK_INTERPRETER)
        elif producer == "copy":
            # per destination, in push order: this rank's region of its gathered buffer (None
            # without rows; its address and bytes for the driver's copy on a GPU), then the
            # publish of rows and arrival
            self.pushes = []
            nbytes = rows * pitch * elem
            for i in range(w):
                dst = (rank + i) % w
                region = (data.peers[dst].view(a.dtype)[first * pitch:(first + rows) * pitch]
                          if rows else None)
                publish = BoundKernel(ag_publish_kernel, (1,),
                                      (sig, ws.signal.ptr_table, dst, rank, w), {},
                                      device=a.device)
                self.pushes.append((region, region.data_ptr() if rows else 0, nbytes, publish))
        else:
            src = a if self.src_pad is None else self.src_pad
            self.pull = BoundKernel(
                ag_pull_kernel, (pull_programs(group),),
                (src, buf, data.ptr_table, sig, ws.signal.ptr_table, offsets, claim, record, rank,
                 w, pitch, timeout, op_id("ag_gemm")),
                dict(BLOCK=_PULL_BLOCK, VEC=16 // elem, num_warps=_PULL_WARPS),
                vary=("src_ptr",), device=a.device)
            if a.is_cuda:  # the pull programs must be resident beside the GEMM's
                tiles = -(-m // cfg.block_m) * -(-b.shape[1] // cfg.block_n)
                programs = max(1, min(consumer_programs(a.device, group, tiles), budget))
        self.core = None
        self.ws_core = self._ws_consumer(b, out, bias, producer, scaled, budget, previous,
                                         (sig, offsets, claim, record, rank, w, timeout,
                                          op_id("ag_gemm")), scale_b,
                                         core or _consumer_core(scaled))
        if self.ws_core is None:
            self.core = CoreGemm(a_desc, b, out, bias, group=group, wait=True, sig=sig,
                                 offsets=offsets, claim=claim, record=record, m=m,
                                 programs=programs, cfg=cfg, push=push,
                                 b_pad=previous.core._b_pad if previous and previous.core
                                 else None, scales=scales)

    def _ws_consumer(self, b, out, bias, producer, scaled, budget, previous, wait, scale_b,
                     core):
        """The waiting WS consumer where ``core`` (``CONSUMER_CORE``, or ``SCALED_CONSUMER_CORE``
        for fp8 rows: the plan key's) and the product allow it, else None (the portable
        consumer). A stale plan's rebuild (possibly under graph capture: nothing
        timed there) keeps the previous plan's choice; a WS build or compile failure falls
        back (``_core.build_ws``, as ``matmul``'s tuning does)."""
        if scaled is not None:
            return self._ws_scaled_consumer(b, out, bias, producer, scaled, budget, previous,
                                            wait, scale_b, core)
        if core not in CONSUMER_CORES:
            raise ValueError(f"ditron.ag_gemm: CONSUMER_CORE must be one of {CONSUMER_CORES}")
        a = self.gathered_view
        if (core == "tl" or producer == "push" or ws_refusal(a, b, out, bias) is not None):
            return None
        if previous is not None:
            if previous.ws_core is None:
                return None
        elif core == "auto" and not prefers_ws(a, b, bias, out):
            return None
        # A WS program holds a whole SM's registers: one SM of the share stays free for the
        # copy producer's flag publishes (kernels); pull mode's budget already leaves the pull
        # kernel's SMs.
        sms = max(1, budget - 1) if producer == "copy" else budget
        return build_ws("ag_gemm", lambda: WsGemm(a, b, out, bias, sms, wait))

    def _ws_scaled_consumer(self, b, out, bias, producer, scaled, budget, previous, wait,
                            scale_b, core):
        """``_ws_consumer``'s fp8 form (``core``: ``SCALED_CONSUMER_CORE``): the gathered rows'
        fp8 values and scales as ``WsScaledGemm`` reads them, in ``_ws_scaled.consumer_config``'s
        kernel, waiting; None where the core or its refusal says the portable one."""
        from . import _ws_scaled
        if core not in ("tl", "ws"):
            raise ValueError("ditron.ag_gemm: SCALED_CONSUMER_CORE must be 'tl' or 'ws'")
        if (core == "tl" or producer == "push"
                or (previous is not None and previous.ws_core is None)):
            return None
        a8, sa = self._fp8
        if _ws_scaled.refusal(a8, b, out, bias) is not None:
            return None
        sms = max(1, budget - 1) if producer == "copy" else budget  # (as _ws_consumer's)
        return build_ws("ag_gemm", lambda: _ws_scaled.WsScaledGemm(
            a8, b, out, bias, sa, scale_b, self.gathered_view.stride(0), scaled.b_row,
            scaled.mode, _ws_scaled.consumer_config(scaled.mode, a8.shape[0], b.shape[1], sms),
            sms=sms, wait=wait))

    def stale(self) -> bool:
        """The workspace grew since (another call's plan): the views are of a freed buffer."""
        return self.ws.data is not self.data

    def _produce_on(self, side: int, src: torch.Tensor) -> None:
        """The producer's work on the raw side stream (GPU)."""
        if self.producer == "copy":  # copy engines: the chunk into every rank, then its flags
            address = src.data_ptr()
            for _, region, nbytes, publish in self.pushes:
                if nbytes:
                    cuda_driver.copy_async(region, address, nbytes, side)
                publish.launch_on(side)
        else:  # SMs: every rank pulls its peers' chunks from their gathered buffers
            self.pull.launch_on(side, src)

    def _produce_here(self, src: torch.Tensor) -> None:
        """The producer's work in the interpreter (kernels run synchronously)."""
        if self.producer == "copy":
            for region, _, _, publish in self.pushes:
                if region is not None:
                    region.copy_(src.view(-1))
                publish.launch()
        else:
            self.pull.launch(src)

    def run(self, a, b, bias, out, gathered, scale_b=None) -> None:
        group, ws = self.group, self.ws
        src = a
        if self.src_pad is not None:
            self.src_pad[:, :a.shape[1]] = a
            src = self.src_pad
        ws.calls += 1
        if self.producer == "push":
            with group.waiting_launch("ag_gemm", ws.calls):
                self.core.run(None, b, out, bias, src, scale_b=scale_b)
            self._finish(gathered)
            return
        with group.waiting_launch("ag_gemm", ws.calls):
            self.start.launch()
            if self.producer == "pull":  # the pull kernel waits (event) for this start barrier
                group.launch_step("ag_gemm", ws.calls)
            if self.gpu:  # fork the side stream, produce there, GEMM here, join
                side, fork, join = self.side
                main = torch._C._cuda_getCurrentRawStream(self.device_index)
                cuda_driver.record(fork, main)
                cuda_driver.wait(side, fork)
                self._produce_on(side, src)
                cuda_driver.record(join, side)
                if self.ws_core is not None and self._fp8 is not None:  # (fp8 rows)
                    self.ws_core.run(self._fp8[0], b, out, bias, self._fp8[1], scale_b)
                elif self.ws_core is not None:
                    self.ws_core.run(self.gathered_view, b, out, bias)
                else:
                    self.core.run(None, b, out, bias, scale_b=scale_b)
                cuda_driver.wait(main, join)
            else:
                self._produce_here(src)
                self.core.run(None, b, out, bias, scale_b=scale_b)
        self._finish(gathered)

    def _finish(self, gathered) -> None:
        if gathered is not None:
            gathered.copy_(self.gathered_view)
        if self.group.sync_check:
            self.group.synchronize()


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """Every variant as one-rank launches (``runtime.precompile``): per tile configuration the
    rule can pick (``rule_configs``), the consumer (dtype x B layout x C store x wait, and fp32
    products for gemm_rs's references and baselines) and the one-launch push call; then the
    start barrier and publish, the pull producer; the waiting WS consumer's forms where
    ``CONSUMER_CORE`` may choose it (``precompile_ws``)."""
    sig, sig_table, claim, record = one_rank_pad(device)
    offsets = torch.tensor([0, 64], dtype=torch.int32, device=device)
    wanted = [d for d in (torch.float16, torch.bfloat16) if d in dtypes]
    for cfg, dtype in itertools.product(rule_configs(device), wanted):
        _precompile_consumer(device, cfg, dtype, sig, sig_table, claim, record, offsets)
    for dtype in wanted:
        a = torch.ones(64, 64, dtype=dtype, device=device)
        buf = torch.zeros(64 * 64, dtype=dtype, device=device)
        BoundKernel(ag_pull_kernel, (1,), (a, buf, pointer_table(buf), sig, sig_table, offsets,
                                           claim, record, 0, 1, 64, 10**6, 0),
                    dict(BLOCK=_PULL_BLOCK, VEC=8, num_warps=_PULL_WARPS), device=device)
    BoundKernel(start_barrier_kernel, (1,), (sig, sig_table, claim, record, 0, 1, 64, 10**6, 0),
                {}, device=device)
    BoundKernel(ag_publish_kernel, (1,), (sig, sig_table, 0, 0, 1), {}, device=device)
    if CONSUMER_CORE != "tl" and device.type == "cuda" and ws_core_refusal(device) is None:
        precompile_ws(device, dtypes, wait=(sig, offsets, claim, record, 0, 1, 10**6, 0))


def _precompile_consumer(device, cfg, dtype, sig, sig_table, claim, record, offsets) -> None:
    """``_precompile``'s variants of one tile configuration and dtype."""
    programs = 2 if cfg.split_tail else 1  # split_tail: two programs on the one tile
    a = torch.ones(64, 64, dtype=dtype, device=device)
    a_desc = TensorDescriptor(a, [64, 64], [64, 1], [cfg.block_m, cfg.block_k])
    layouts = (a.clone(), a.clone().t())
    for b, wait, c_tma in itertools.product(layouts, (False, True), (False, True)):
        out = torch.empty(64, 64 if c_tma else 65, dtype=dtype, device=device)[:, :64]
        CoreGemm(a_desc, b, out, None, group=None, wait=wait, sig=sig, offsets=offsets,
                 claim=claim, record=record, m=64, programs=programs, cfg=cfg)
    for b in layouts:
        out = torch.empty(64, 64, dtype=torch.float32, device=device)
        CoreGemm(a_desc, b, out, None, group=None, wait=False, sig=sig, offsets=offsets,
                 claim=claim, record=record, m=64, programs=1, cfg=cfg)
    buf = torch.zeros(64 * 64, dtype=dtype, device=device)
    buf_desc = TensorDescriptor(buf, [64, 64], [64, 1], [cfg.block_m, cfg.block_k])
    push = dict(kernel=ag_gemm_push_kernel, sig_table=sig_table, src=a, buf=buf,
                buf_table=pointer_table(buf), pitch=64, src_varies=True,
                copy_block=_PUSH_BLOCK)
    for b, c_tma in itertools.product(layouts, (False, True)):
        out = torch.empty(64, 64 if c_tma else 65, dtype=dtype, device=device)[:, :64]
        CoreGemm(buf_desc, b, out, None, group=None, wait=True, sig=sig, offsets=offsets,
                 claim=claim, record=record, m=64, programs=programs, cfg=cfg, push=push)


def precompile_scaled(device: torch.device, out_dtype: torch.dtype, cfg, mode: int) -> None:
    """The fp8 variants (``ag_gemm_scaled``) of one tile configuration (``BLOCK_K`` 128), output
    dtype and scale mode (``SCALE``): the waiting consumer over packed rows (e4m3 values read
    through a descriptor over the fp32 words, their scales from the rows) and the one-launch
    push call, either C store; the pull producer of fp32 words."""
    sig, sig_table, claim, record = one_rank_pad(device)
    offsets = torch.tensor([0, 64], dtype=torch.int32, device=device)
    programs = 2 if cfg.split_tail else 1  # split_tail: two programs on the one tile
    words = torch.zeros(64, 64, dtype=torch.float32, device=device)  # 64 packed rows of 256 B
    buf = torch.zeros(64 * 64, dtype=torch.float32, device=device)
    b = torch.ones(64, 128, dtype=torch.float8_e4m3fn, device=device).t()  # K-major, as the op's
    scale_b = torch.ones(64, device=device)
    push = dict(kernel=ag_gemm_push_kernel, sig_table=sig_table, src=words, buf=buf,
                buf_table=pointer_table(buf), pitch=64, src_varies=True, copy_block=_PUSH_BLOCK)
    for rows, with_push in ((words, None), (buf.view(64, 64), push)):
        a_desc = TensorDescriptor(rows.view(torch.float8_e4m3fn), [64, 128], [256, 1],
                                  [cfg.block_m, cfg.block_k])
        scales = Scales(mode, rows.reshape(-1)[32:], scale_b, 64, 1, a_varies=False)
        for c_tma in (False, True):
            out = torch.empty(64, 64 if c_tma else 65, dtype=out_dtype, device=device)[:, :64]
            CoreGemm(a_desc, b, out, None, group=None, wait=True, sig=sig, offsets=offsets,
                     claim=claim, record=record, m=64, programs=programs, cfg=cfg,
                     push=with_push, scales=scales)
    BoundKernel(ag_pull_kernel, (1,), (words, buf, pointer_table(buf), sig, sig_table, offsets,
                                       claim, record, 0, 1, 64, 10**6, 0),
                dict(BLOCK=_PULL_BLOCK, VEC=4, num_warps=_PULL_WARPS), device=device)


register_precompile(PURPOSE, _precompile, ("ag_gemm",))
