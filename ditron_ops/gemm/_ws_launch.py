"""Host side of the warp-specialized sm_90 GEMM (``_ws_kernels``): the ``MODE_SPLITR`` reduce
kernels (plain Triton), descriptors and launch arguments, scratch buffers, ``ws_matmul``.

Imports on a Triton without Gluon (``ws_matmul`` then raises).
"""
from __future__ import annotations

import functools
import itertools
import threading
import warnings
from typing import Optional

from ._ws_configs import (MODE_DP, MODE_SK, MODE_SPLIT, MODE_SPLITR, PARTIALS,  # noqa: F401
                          WS_CONFIGS, WsConfig, WsPlan, describe, fit_stages, plan,
                          rule_plans, smem_bytes, splitr_floats, splitr_pitch)
from ._ws_kernels import (HAVE_GLUON, MAXNREG, TRACE_POINTS, TRACE_UNITS,  # noqa: F401
                          ws_gemm_kernel)

if HAVE_GLUON:
    import triton
    import triton.language as tl
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
else:
    triton = tl = gl = GluonDescriptor = None


def _tl_jit(fn):
    return triton.jit(fn, do_not_specialize=["M", "N", "stride_om"]) if HAVE_GLUON else fn


@_tl_jit
def ws_reduce_kernel(ws_ptr, out_ptr, bias_ptr, M, N, stride_om, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out = sum_j ws[j] (+ bias)`` over the ``SPLIT`` fp32 planes of ``ws`` [SPLIT, M, N], in
    plane order 0..SPLIT-1 (``MODE_SPLITR``'s fixed order), one rounding. Grid: tiles of C."""
    pid = tl.program_id(0)
    tn = tl.cdiv(N, BLOCK_N)
    rm = (pid // tn) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tn) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    plane = M.to(tl.int64) * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + j * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


REDUCE_BLOCK = (16, 256, 4)
"""``ws_reduce_kernel``'s (BLOCK_M, BLOCK_N, num_warps)."""


def _tl_jit_tma(fn):
    # ld / plane stay specialized (multiples of 16: 16-byte loads); sizes do not
    return triton.jit(fn, do_not_specialize=["N"]) if HAVE_GLUON else fn


@_tl_jit_tma
def ws_reduce_tma_kernel(ws_ptr, out_desc, bias_ptr, N, ld, plane, SPLIT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``partials="tma"``'s reduce: ``out = sum_j ws[j] (+ bias)`` over ``SPLIT`` line-padded
    fp32 planes (``plane`` floats apart, rows ``ld`` floats, both multiples of 16: 16-byte
    loads), plane order 0..SPLIT-1, one rounding; C by TMA (``out_desc``, clipped to
    ``[M, N]``). Blocks never leave the padded planes (``BLOCK_M`` divides the plane's rows,
    ``BLOCK_N`` its pitch), so no load is masked; columns ``[N, ld)`` hold no data and are
    clipped away with the store. Grid: ``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)``."""
    pid = tl.program_id(0)
    tn = tl.cdiv(N, BLOCK_N)
    m0 = (pid // tn) * BLOCK_M
    n0 = (pid % tn) * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    offs = rm[:, None] * ld + rn[None, :]
    acc = tl.load(ws_ptr + offs, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + j * plane.to(tl.int64) + offs, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_desc.store([m0, n0], acc.to(out_desc.dtype))


REDUCE_TMA_BLOCK = (16, 128, 4)
"""``ws_reduce_tma_kernel``'s (BLOCK_M, BLOCK_N, num_warps): BLOCK_M divides every config's
block_m (the plane rows), BLOCK_N divides ``SPLITR_LD_ALIGN``; 16 x 128 blocks put the
few-tile shapes' reduce over all SMs (512 x 576: 160 programs)."""


def ws_reduce_operands(out, bias, p: WsPlan, ws):
    """``(grid, args, meta)`` of the ``MODE_SPLITR`` reduce launch (``ws_reduce_kernel``, or
    ``ws_reduce_tma_kernel`` for ``partials="tma"``: ``reduce_kernel(p)`` says which)."""
    M, N = out.shape
    if p.partials == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        bm, bn, nw = REDUCE_TMA_BLOCK
        rows, ld = splitr_pitch(M, N, p.cfg)
        assert rows % bm == 0 and ld % bn == 0
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), )
        out_desc = TensorDescriptor.from_tensor(out, [bm, bn])
        args = (ws, out_desc, bias if bias is not None else out, N, ld, rows * ld)
        return grid, args, dict(SPLIT=p.split, HAS_BIAS=bias is not None, BLOCK_M=bm,
                                BLOCK_N=bn, num_warps=nw)
    bm, bn, nw = REDUCE_BLOCK
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), )
    args = (ws, out, bias if bias is not None else out, M, N, out.stride(0))
    return grid, args, dict(SPLIT=p.split, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                            num_warps=nw)


def reduce_kernel(p: WsPlan):
    """The ``MODE_SPLITR`` reduce kernel of plan ``p``."""
    return ws_reduce_tma_kernel if p.partials == "tma" else ws_reduce_kernel


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _gl_dtype(torch_dtype):
    import torch
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
            torch.float32: gl.float32}[torch_dtype]


def _layout(block, torch_dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(torch_dtype))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


_SCRATCH = {}
"""Per device and thread: (fp32 workspace, int32 counters), grown on demand. Counters are zero
between launches (each reducer resets its tile's). Grow them outside CUDA-graph capture (a
warm-up)."""
_RETIRED = []
"""Outgrown scratch buffers, kept alive: a captured CUDA graph may still point at them."""


def _scratch(device, ws_floats: int, counters: int):
    import torch
    # Per thread: virtual ranks (threads) run GEMMs at once on one device; a thread's plans
    # share partials and counters, so its GEMMs with partials must run in one stream order
    # (one stream, or streams joined between them). Kept for the process (graphs point at
    # them): up to 2 * programs * 128 KiB per thread that ran a stream-K plan.
    key = (device.type, device.index, threading.get_ident())
    ws, cnt = _SCRATCH.get(key, (None, None))
    if ws is None or ws.numel() < max(ws_floats, 1):
        _RETIRED.append(ws)
        ws = torch.empty(max(ws_floats, 1 << 16), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < max(counters, 1):
        _RETIRED.append(cnt)
        cnt = torch.zeros(max(counters, 1 << 12), dtype=torch.int32, device=device)
    _SCRATCH[key] = (ws, cnt)
    return ws, cnt


def ws_operands(a, b, out, bias, p: WsPlan, trace=None, wait=None, push=None):
    """Descriptors and launch arguments of ``ws_gemm_kernel`` for plan ``p`` (no launch);
    ``trace``: an int64 ``[grid, TRACE_UNITS, TRACE_POINTS]`` tensor the consumers stamp (the
    probe's timeline), else none; ``wait``: the ag_gemm consumer's ``(sig, offsets, claim,
    record, rank, world_size, timeout_us, op_id)`` (the kernel's ``WAIT``), else none;
    ``push``: the gemm_rs / gemm_ar producer's ``(slots, peers, offsets, slot_rows, rank,
    world_size, broadcast)`` (the kernel's ``PUSH``; ``out`` then only gives C's dtype: a
    staging tile over a small stand-in is allocated, never stored), else none.

    Returns ``(args, meta)``: positional arguments and constexpr/launch keywords."""
    cfg = p.cfg
    M, K = a.shape
    N = b.shape[1]
    if cfg.pingpong and cfg.num_warps != 4:
        raise ValueError("ws_matmul: a ping-pong consumer is one warpgroup (num_warps=4)")
    if cfg.block_n % cfg.epi_n or cfg.epi_n & (cfg.epi_n - 1):
        raise ValueError(f"ws_matmul: epi_n {cfg.epi_n} must be a power-of-two divisor of block_n")
    if cfg.block_n2 % cfg.epi_n or (cfg.block_n2 and p.mode != MODE_DP):
        raise ValueError(f"ws_matmul: block_n2 {cfg.block_n2}: a multiple of epi_n, data "
                         "parallel only")
    b_kn = b.stride(1) == 1  # row-major [K, N]; else K-major (w.t() of a row-major [N, K])
    b_desc = _b_desc(b, cfg.block_n, cfg.block_k, b_kn)
    b2_desc = _b_desc(b, cfg.block_n2, cfg.block_k, b_kn) if cfg.block_n2 else b_desc
    a_desc = GluonDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k],
                                         _layout((cfg.block_m, cfg.block_k), a.dtype))
    if push is not None:
        out = _stand_in(out.device, out.dtype, cfg.block_m, cfg.epi_n)
    c_desc = GluonDescriptor.from_tensor(out, [cfg.block_m, cfg.epi_n],
                                         _layout((cfg.block_m, cfg.epi_n), out.dtype))
    stages = p.stages or fit_stages(cfg, a.element_size(), out.element_size())
    ws, cnt = _scratch(a.device, p.ws_tiles * cfg.block_m * cfg.block_n, p.counters)
    tma_parts = p.partials == "tma" and p.mode != MODE_DP
    p_desc, plane_rows = c_desc, 0
    if tma_parts:
        p_desc, plane_rows = _partials_desc(ws, M, N, out.element_size(), p)
    if (wait is not None or push is not None) and p.mode != MODE_DP:
        raise ValueError("ws_matmul: a waiting consumer or a pushing producer runs data "
                         "parallel only")
    if wait is not None and push is not None:
        raise ValueError("ws_matmul: wait or push, not both")
    if wait is not None:
        signals = tuple(wait) + (cnt, 0)
    elif push is not None:
        slots, peers, offsets, slot_rows, rank, world_size, _ = push
        ws = slots
        signals = (cnt, offsets, ws, ws, rank, world_size, 0, 0, peers, slot_rows)
    else:
        signals = (cnt, cnt, ws, ws, 0, 1, 0, 0, cnt, 0)
    args = (a_desc, b_desc, c_desc, bias if bias is not None else out, ws, cnt, p_desc,
            trace if trace is not None else cnt, b2_desc, M, N, K, p.dp_tiles, p.split,
            plane_rows) + signals
    meta = dict(HAS_BIAS=bias is not None, B_KN=b_kn, GROUP_M=cfg.group_m, STAGES=stages,
                PINGPONG=cfg.pingpong, MODE=p.mode, TMA_PARTS=tma_parts,
                num_warps=cfg.num_warps, maxnreg=MAXNREG, TRACE=trace is not None,
                N2=cfg.block_n2, WAIT=wait is not None,
                PUSH=0 if push is None else 2 if push[6] else 1)
    return args, meta


_STAND_INS = {}
"""Per (device, dtype, shape): the C stand-in of pushing launches (``ws_operands``)."""


def _stand_in(device, dtype, rows: int, cols: int):
    key = (str(device), dtype, rows, cols)
    if key not in _STAND_INS:
        _STAND_INS[key] = _torch().empty(rows, cols, dtype=dtype, device=device)
    return _STAND_INS[key]


def _b_desc(b, cols: int, block_k: int, b_kn: bool):
    """A descriptor over B with boxes of ``cols`` columns: ``[block_k, cols]`` of a row-major
    ``[K, N]`` B, or ``[cols, block_k]`` of the weight ``[N, K]`` under ``b = w.t()``."""
    if b_kn:
        return GluonDescriptor.from_tensor(b, [block_k, cols], _layout((block_k, cols), b.dtype))
    w = b.t()  # [N, K], rows contiguous
    return GluonDescriptor.from_tensor(w, [cols, block_k], _layout((cols, block_k), b.dtype))


def _partials_desc(ws, M, N, out_bytes, p: WsPlan):
    """``(p_desc, plane_rows)`` of ``partials="tma"``: fp32 boxes of the staging tile's bytes
    (``[block_m, epi_n * out_bytes / 4]``) over the workspace as ``[slots * block_m, block_n]``
    (``MODE`` 1/2) or as the line-padded planes ``[split * plane_rows, N]`` (``MODE_SPLITR``)."""
    cfg = p.cfg
    pn = cfg.epi_n * out_bytes // 4
    if pn < 4 or cfg.block_n % pn:
        raise ValueError(f"ws_matmul: partials='tma' needs epi_n * C bytes >= 16 (pn {pn})")
    layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, pn], gl.float32)
    if p.mode == MODE_SPLITR:
        rows, ld = splitr_pitch(M, N, cfg)
        assert ws.numel() >= p.split * rows * ld
        return GluonDescriptor(ws, [p.split * rows, N], [ld, 1], [cfg.block_m, pn], layout), rows
    slots = p.ws_tiles
    view = ws[:slots * cfg.block_m * cfg.block_n].view(slots * cfg.block_m, cfg.block_n)
    return GluonDescriptor.from_tensor(view, [cfg.block_m, pn], layout), 0


def check_operands(a, b, out, bias) -> None:
    """Raise ``ValueError`` where TMA cannot address the operands (16-byte rows and bases);
    ``out`` None: no C (a pushing producer's)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or 0 in (*a.shape, b.shape[1]):
        raise ValueError(f"ws_matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype not in (_torch().bfloat16, _torch().float16) or b.dtype != a.dtype:
        raise ValueError(f"ws_matmul: dtypes {a.dtype}, {b.dtype} (bf16 or fp16, equal)")
    if a.stride(1) != 1 or not (b.stride(1) == 1 or b.stride(0) == 1):
        raise ValueError("ws_matmul: A must be row-major; B row-major [K, N] or w.t()")
    if out is not None and (out.stride(1) != 1 or tuple(out.shape) != (a.shape[0], b.shape[1])):
        raise ValueError(f"ws_matmul: out {tuple(out.shape)} must be a row-major [M, N]")
    for t in (a, b) if out is None else (a, b, out):
        big = max(t.stride())
        if t.data_ptr() % 16 or (big * t.element_size()) % 16:
            raise ValueError("ws_matmul: TMA needs 16-byte aligned bases and row pitches")
    if bias is not None and (bias.shape != (b.shape[1], ) or bias.stride(0) != 1):
        raise ValueError(f"ws_matmul: bias {tuple(bias.shape)} must be a contiguous [N]")


def _padded_copy(t):
    """``_pad.padded_copy`` (rows onto 128-byte lines)."""
    from ._pad import padded_copy
    return padded_copy(t)


def _lined(a, b, p: WsPlan):
    """``a`` / ``b`` with the K-long rows the plan copies onto 128-byte lines (B's only when
    given as ``w.t()``; a row-major ``[K, N]`` B has N-long rows)."""
    if p.pad_a and (a.stride(0) * a.element_size()) % 128:
        a = _padded_copy(a)
    if p.pad_b and b.stride(0) == 1 and (b.stride(1) * b.element_size()) % 128:
        b = _padded_copy(b.t()).t()
    return a, b


def _torch():
    import torch
    return torch


def ws_matmul(a, b, out=None, bias=None, *, cfg=None, plan_: Optional[WsPlan] = None,
              mode: Optional[int] = None, deterministic: bool = False,
              partials: Optional[str] = None, trace=None):
    """``out = a @ b (+ bias)`` by ``ws_gemm_kernel`` on the current CUDA device (sm_90).

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K]`` row-major, bf16 or fp16.
    b : torch.Tensor
        ``[K, N]`` of ``a``'s dtype: row-major, or ``w.t()`` of a row-major ``[N, K]`` weight.
    out : torch.Tensor, optional
        ``[M, N]`` row-major, bf16, fp16 or fp32 (default: ``a``'s dtype, new).
    bias : torch.Tensor, optional
        ``[N]``, added in fp32 before rounding.
    cfg : str, optional
        Force a tile config (a ``WS_CONFIGS`` name); default: the rule's.
    plan_ : WsPlan, optional
        The whole launch plan (default ``_ws_configs.plan`` of the shape).
    mode : int, optional
        Force ``MODE_DP`` / ``MODE_SK`` / ``MODE_SPLITR``.
    deterministic : bool
        One fixed config, data parallel (DESIGN.md section 7).
    partials : str, optional
        Force how fp32 partials move, ``"reg"`` or ``"tma"`` (``_ws_configs.PARTIALS``;
        default: the rule's, ``"reg"``).
    trace : torch.Tensor, optional
        int64 ``[grid, TRACE_UNITS, TRACE_POINTS]``, zeroed: the consumers' timestamps
        (``_ws_kernels._stamp``; probes only).

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    if not HAVE_GLUON:
        raise RuntimeError("ws_matmul needs triton.experimental.gluon (triton >= 3.5)")
    torch = _torch()
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    check_operands(a, b, out, bias)
    if plan_ is None:
        dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
        plan_ = plan(a.shape[0], b.shape[1], a.shape[1], a.element_size(), out.element_size(),
                     _sm_count(dev), deterministic=deterministic, variant=cfg, mode=mode,
                     partials=partials)
    if plan_.pad_a or plan_.pad_b:
        a, b = _lined(a, b, plan_)
    args, meta = ws_operands(a, b, out, bias, plan_, trace)
    from ..runtime.compiler import settle_cache_keys
    settle_cache_keys(ws_gemm_kernel)  # (a launch outside any plan compiles here)
    ws_gemm_kernel[(plan_.grid, )](*args, **meta)
    if plan_.mode == MODE_SPLITR:
        grid, rargs, rmeta = ws_reduce_operands(out, bias, plan_, args[4])
        reduce_kernel(plan_)[grid](*rargs, **rmeta)
    return out


SKINNY_M = 32
"""At most this many rows the plain ``matmul`` keeps the portable core's skinny tiles
(``_core_configs.skinny``: N on the MMA's 64-row side; measured 0.78-1.01x cuBLAS at M = 1,
the WS core's smallest tile has 64 rows)."""
SECTOR_BYTES = 32
GLUON_VERSION = "3.6"
"""The Triton whose Gluon API the WS core is written against (3.9 renamed or dropped some of
it: ``shared_memory_descriptor._reinterpret``, ``thread_barrier``); on another, ``refusal``
refuses every product after one warning, without trying a compile."""
_STATE = {"broken": None}
"""``broken``: why the WS core cannot run on this Triton (set once, by the first failed
compile; the plain ``matmul`` then stays on the portable core)."""


def precompile_ws(device, dtypes, wait=None, push=None) -> None:
    """Bind every kernel form the rule can choose (``rule_plans``) for the 2-byte ``dtypes``
    (out in the same dtype), B ``[K, N]`` and ``w.t()``, with and without bias, and the
    deterministic plan into fp32 (the reducing ops' unfused deterministic partials); ``wait``: the
    waiting consumer's forms instead, ``push``: the pushing producer's (``WsGemm``'s tuples;
    data parallel only; a producer has no bias). Nothing is launched: ``runtime.precompile``
    calls it inside its ``compiler.batch``, and ``tools/sm90_compile.py`` with a CPU device
    (the stand-in driver)."""
    import torch
    for dtype in (d for d in (torch.float16, torch.bfloat16) if d in dtypes):
        for p in rule_plans(2, 2):
            if (wait is not None or push is not None) and p.mode != MODE_DP:
                continue
            cfg = p.cfg
            a = torch.ones(cfg.block_m, 2 * cfg.block_k, dtype=dtype, device=device)
            n, k = cfg.tile_n, a.shape[1]
            biases = (None, ) if push is not None else (None, a.new_ones(n))
            for b, bias in itertools.product((a.new_ones(k, n), a.new_ones(n, k).t()), biases):
                WsGemm(a, b, a.new_empty(cfg.block_m, n), bias, p.grid, wait=wait, plan_=p,
                       push=push)
        if wait is None and push is None:  # deterministic mode's fp32 products (DET_ON_WS)
            a = torch.ones(128, 256, dtype=dtype, device=device)
            for b in (a.new_ones(256, 256), a.new_ones(256, 256).t()):
                WsGemm(a, b, a.new_empty(128, 256, dtype=torch.float32), None, 1,
                       deterministic=True)


def core_refusal(device) -> Optional[str]:
    """Why the WS core does not run on ``device`` at all (None: it may; ``refusal`` adds the
    operands' reasons)."""
    torch = _torch()
    if not HAVE_GLUON:
        return "triton without gluon"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "not sm_90"
    if (_STATE["broken"] is None
            and triton.__version__.split(".")[:2] != GLUON_VERSION.split(".")):
        mark_broken(RuntimeError(f"written against triton {GLUON_VERSION}'s Gluon API"))
    return _STATE["broken"]


def mark_broken(exc: BaseException) -> None:
    """The WS core failed to build or compile on this Triton (a Gluon API this module does not
    know): ``refusal`` refuses every later product, and one warning says so."""
    if _STATE["broken"] is None:
        warnings.warn(f"ditron_ops: the warp-specialized GEMM does not run on triton "
                      f"{triton.__version__} ({type(exc).__name__}: {str(exc)[:160]}); "
                      "plain GEMMs run on the portable core", RuntimeWarning, stacklevel=3)
    _STATE["broken"] = f"WS core unavailable on this triton ({type(exc).__name__})"


def refusal(a, b, out, bias) -> Optional[str]:
    """Why the WS core does not take the plain ``out = a @ b (+ bias)`` (None: it does).

    It takes bf16/fp16 products on sm_90 (the mode is the caller's: ``matmul`` asks in the
    default mode, and in deterministic mode where ``DET_ON_WS``) whose operands TMA reads as
    they are (``check_operands``; ``out`` None: no C, a pushing producer's) with K-long rows
    on 32-byte sectors: A's rows, and B's when B is a
    weight's ``w.t()``. Rows off sectors run slower on it than on the portable core, which
    copies them onto lines (benchmarks/NOTES.md, the warp-specialized core); small M
    (``SKINNY_M``) stays on the skinny tiles."""
    return core_refusal(a.device) or operand_refusal(a, b, out, bias)


def operand_refusal(a, b, out, bias) -> Optional[str]:
    """``refusal``'s part that reads only shapes, strides and addresses (any device)."""
    if a.shape[0] <= SKINNY_M:
        return f"M <= {SKINNY_M} (skinny tiles)"
    try:
        check_operands(a, b, out, bias)
    except ValueError as exc:
        return str(exc)
    from ._pad import row_alignment  # (only ``matmul`` asks: the probe's stand-in never does)
    if row_alignment(a) < SECTOR_BYTES:
        return "A's rows off 32-byte sectors"
    if b.stride(0) == 1 and b.stride(1) != 1 and row_alignment(b.t()) < SECTOR_BYTES:
        return "B's rows off 32-byte sectors"
    return None


class WsGemm:
    """The plain ``matmul``'s plan on the WS core: the rule's ``WsPlan`` for the shapes, its
    kernels bound once (``runtime.launcher.BoundKernel``: compiled here, outside any graph
    capture; each call hands only the tensors' addresses to the compiled launcher, descriptors
    made once per address) and its scratch grown here; ``run`` launches it.

    Compile errors surface where the kernels are bound (the end of the ``compiler.batch`` the
    plan is built in); ``matmul(core="auto")`` passes them to ``mark_broken``.

    ``wait``: the ag_gemm consumer (``ws_operands``' tuple; ``a`` the gathered buffer): data
    parallel on at most ``sms`` programs, all resident (one per SM), each tile's loads after
    the chunks of its rows landed. ``push``: the gemm_rs / gemm_ar producer (``ws_operands``'
    tuple): data parallel, fp32 tiles into the ranks' slots, no C (``out`` gives its dtype).
    ``mode``: force a schedule (benches). ``plan_``: bind this plan instead of the rule's
    (``precompile_ws``). ``deterministic``: the rule's deterministic plan (one fixed config,
    data parallel: ``_ws_configs.plan``)."""

    def __init__(self, a, b, out, bias, sms: int, wait=None, mode=None, plan_=None, push=None,
                 deterministic=False):
        from ..runtime.launcher import BoundKernel
        m, k = a.shape
        dp = wait is not None or push is not None
        self.plan = p = plan_ or plan(m, b.shape[1], k, a.element_size(), out.element_size(),
                                      sms, mode=MODE_DP if dp else mode,
                                      deterministic=deterministic)
        self.name = "ws:" + describe(p)
        if p.pad_a or p.pad_b:  # (the rule plans copies only for rows off sectors: refused)
            raise RuntimeError(f"{self.name}: row copies are not bound")
        _scratch(a.device, p.ws_tiles * p.cfg.block_m * p.cfg.tile_n, p.counters)
        self._b_kn = b.stride(1) == 1
        self._tma_parts = p.partials == "tma" and p.mode != MODE_DP
        args, meta = ws_operands(a, b, out, bias, p, wait=wait, push=push)
        # per call: A, B (twice: its two boxes), C (and the partials' descriptor, over C in
        # every plan without TMA partials, where it is unused), bias (C again without one);
        # a pushing launch: no C, a bias only where it has one
        self._push = push is not None
        if self._push:
            vary = ("a_desc", "b_desc", "b2_desc") + (("bias_ptr", ) if bias is not None else ())
        else:
            vary = ("a_desc", "b_desc", "c_desc", "bias_ptr", "b2_desc") + (
                () if self._tma_parts else ("p_desc", ))
        self.kernel = BoundKernel(ws_gemm_kernel, (p.grid, ), args, meta, vary=vary,
                                  device=out.device)
        self.reduce = None
        if p.mode == MODE_SPLITR:
            grid, rargs, rmeta = ws_reduce_operands(out, bias, p, args[4])
            rvary = ("out_desc" if p.partials == "tma" else "out_ptr", "bias_ptr")
            self.reduce = BoundKernel(reduce_kernel(p), grid, rargs, rmeta, vary=rvary,
                                      device=out.device)

    def run(self, a, b, out, bias):
        w = b if self._b_kn else b.t()
        if self._push:
            self.kernel.launch(a, w, w, *(() if bias is None else (bias, )))
            return out
        bias_or_out = bias if bias is not None else out
        values = (a, w, out, bias_or_out, w) + (() if self._tma_parts else (out, ))
        self.kernel.launch(*values)
        if self.reduce is not None:
            self.reduce.launch(out, bias_or_out)
        return out
