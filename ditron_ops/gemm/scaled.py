"""``ag_gemm_scaled``: all-gather of fp8 (e4m3) row shards and their scales, fused with the scaled
GEMM that consumes them.

``out = (all_gather(a) * scale_a) @ (b * scale_b) (+ bias)`` in ``torch._scaled_mm``'s
conventions: ``a [M_r, K]`` and ``b [K, N]`` (column-major: ``b = w.t()`` of a row-major
``[N, K]`` weight) in ``float8_e4m3fn``, fp32 scales, the product accumulated in fp32 and
rounded once to ``out_dtype``.

Scale modes (told apart by the scales' shapes):

- tensor-wise: ``scale_a`` and ``scale_b`` one element each;
- row-wise: ``scale_a [M_r, 1]``, ``scale_b [1, N]``;
- block-wise (DeepSeek-V3's recipe): ``scale_a [M_r, ceil(K/128)]`` (1x128 blocks of A),
  ``scale_b [ceil(K/128), ceil(N/128)]`` (128x128 blocks of B); every 128 of K the partial
  product is promoted into the fp32 sum with its blocks' scales, so accuracy does not depend
  on K.

What moves: each rank's rows travel as fp8 bytes with their scales packed behind them in the
same row (``packed_row``): ``K`` bytes rounded up to 16, then one fp32 scale (tensor-wise and
row-wise: a tensor-wise scale becomes every row's, so ranks may quantize with scales of their
own) or ``ceil(K/128)`` of them, the row rounded up to whole 128-byte lines. The gather is one
transfer of those rows, never a bf16 copy: ``gathered_bytes`` says how many bytes a call
moves.

No autograd (fp8 training recipes quantize around the op; there is no gradient formula here).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence

import torch

from .._library import define_op, direct
from .._validation import check_sizes, check_tensor, memo
from ..collectives.unfused import gather_rows, reduce_rows, sum_all
from ..deterministic import resolve_deterministic
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, name_for_rows, resolve_group
from ..runtime.plan import PlanCache, call_key, tensor_key
from ..runtime.precompile import register_precompile
from ..runtime.split import split_sizes
from ._core_configs import LINE_BYTES, SCALE_BLOCKWISE, SCALE_ROWWISE
from .ag_gemm import IMPLS, use_fused
from .gemm_rs import ALGORITHMS, ONE_SHOT_MAX_BYTES, _fused_wanted

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)
SCALE_BLOCK = 128
"""K (and N, for B) elements per block scale; also the fp8 GEMM's ``BLOCK_K``: one K step is one
scale block (``_core_configs.scaled_config``)."""
MODES = {"tensor": SCALE_ROWWISE, "row": SCALE_ROWWISE, "block": SCALE_BLOCKWISE}
"""The kernel's ``SCALE`` per mode (tensor-wise runs as row-wise with strides of 0)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round16(n: int) -> int:
    return _cdiv(n, 16) * 16


@dataclasses.dataclass(frozen=True)
class PackedRow:
    """One gathered row's layout, in bytes: fp8 values ``[0, k)``, ``scales`` fp32 scales from
    ``scale_offset`` (a multiple of 16), the whole row ``pitch`` bytes, whole 128-byte lines
    (``LINE_BYTES``): the consumer's TMA boxes then read each row's K steps from one line, not
    two (the waiting consumer's speed: benchmarks/NOTES.md, fp8). Rows land on lines where the
    gathered buffer's base does (torch's and NVSHMEM's allocations); no line holds two rows'
    scales either way (rows are 128 bytes apart or more)."""
    k: int
    scales: int
    scale_offset: int
    pitch: int


def packed_row(k: int, mode: str) -> PackedRow:
    """The packed row of ``k`` fp8 values under ``mode`` (module docstring)."""
    scales = _cdiv(k, SCALE_BLOCK) if mode == "block" else 1
    offset = _round16(k)
    return PackedRow(k, scales, offset, _cdiv(offset + 4 * scales, LINE_BYTES) * LINE_BYTES)


def gathered_bytes(shard_sizes: Sequence[int], k: int, mode: str) -> int:
    """Bytes one ``ag_gemm_scaled`` call gathers into each rank (fp8 rows + their scales), against
    ``2 * ΣM_r * K`` for the bf16 ``ag_gemm``."""
    return sum(shard_sizes) * packed_row(k, mode).pitch


def scale_mode(op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
               scale_b: torch.Tensor) -> str:
    """``"tensor"``, ``"row"`` or ``"block"`` from the scales' shapes (``torch._scaled_mm``'s
    rules: both scales of one mode); a ``ValueError`` naming the expected shapes otherwise."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    kb, nb = _cdiv(k, SCALE_BLOCK), _cdiv(n, SCALE_BLOCK)
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensor"
    if sa == (m, 1) and sb == (1, n):
        return "row"
    if sa == (m, kb) and sb == (kb, nb):
        return "block"
    raise ValueError(
        f"ditron.{op}: scale_a {sa} and scale_b {sb} match no scale mode for a [{m}, {k}] and "
        f"b [{k}, {n}]: tensor-wise (one element each), row-wise ([{m}, 1] and [1, {n}]) or "
        f"block-wise ([{m}, {kb}] and [{kb}, {nb}])")


def ag_gemm_scaled(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, group: Optional[Group] = None, *,
                   bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                   impl: str = "auto",
                   shard_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-gather the fp8 row shards ``a`` of every rank (with their scales) and multiply by
    ``b``, scaled.

    Parameters
    ----------
    a : torch.Tensor
        ``[M_r, K]`` ``float8_e4m3fn``, this rank's rows (any row stride; unit column stride).
    b : torch.Tensor
        ``[K, N]`` ``float8_e4m3fn``, column-major (``w.t()`` of a row-major ``[N, K]`` weight),
        as ``torch._scaled_mm`` takes it.
    scale_a, scale_b : torch.Tensor
        fp32, contiguous: one element each (tensor-wise), ``[M_r, 1]`` and ``[1, N]``
        (row-wise), or ``[M_r, ceil(K/128)]`` and ``[ceil(K/128), ceil(N/128)]`` (block-wise).
        ``x = x_fp8 * scale``. Each rank passes the scales of its own rows.
    group : Group, optional
        Defaults to the current group.
    bias : torch.Tensor, optional
        ``[N]`` of ``out_dtype``, added in fp32 after the scales, before rounding.
    out_dtype : torch.dtype
        ``torch.bfloat16`` (default) or ``torch.float16``.
    impl : {"auto", "fused", "baseline"}
        As ``ag_gemm``: ``"baseline"`` gathers the packed rows, then runs the scaled GEMM.
    shard_sizes : sequence of int, optional
        ``[M_0, ..., M_{W-1}]``, the same on every rank (default: ``a.shape[0]`` each).

    Returns
    -------
    torch.Tensor
        ``[ΣM_r, N]`` of ``out_dtype`` (rank 0's rows first).

    Constraints
    -----------
    Collective: every rank calls it in the same order relative to the group's other ops, with
    the same ``shard_sizes``, ``K``, ``N``, scale mode, ``out_dtype`` and ``impl``. Runs on the
    current stream. No autograd. Moves ``gathered_bytes`` bytes into each rank (about half the
    bf16 op's).

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # rank r: 2 rows of ones at scale r + 1; B all ones at scale 0.5; K = 32
    ...     a = torch.ones(2, 32, device=group.device).to(torch.float8_e4m3fn)
    ...     b = torch.ones(16, 32, device=group.device).to(torch.float8_e4m3fn).t()
    ...     sa = torch.full((2, 1), group.rank + 1.0, device=group.device)
    ...     sb = torch.full((1, 16), 0.5, device=group.device)
    ...     out = ditron_ops.ag_gemm_scaled(a, b, sa, sb, group, out_dtype=torch.float16)
    ...     return out[:, 0].tolist()
    >>> ditron_ops.launch(body, 2)[0]
    [16.0, 16.0, 32.0, 32.0]
    """
    group, name = call_group(group)
    key = call_key("ag_gemm_scaled", a, b, scale_a, scale_b, bias, out_dtype, impl, shard_sizes)
    sizes = memo(group, key, lambda: _validate(group, a, b, scale_a, scale_b, bias, out_dtype,
                                               impl, shard_sizes))
    if direct(a, b, scale_a, scale_b, bias):
        return _ag_gemm_scaled_impl(a, b, scale_a, scale_b, bias, name, sizes, out_dtype, impl)
    return torch.ops.ditron.ag_gemm_scaled(a, b, scale_a, scale_b, bias, name, sizes, out_dtype,
                                           impl)


def _validate(group: Group, a, b, scale_a, scale_b, bias, out_dtype, impl, shard_sizes):
    """The call's checks (typed errors naming the argument); the shard sizes."""
    op = "ag_gemm_scaled"
    mode = _check_operands(op, group, a, b, scale_a, scale_b, out_dtype, impl, "K")
    _check_bias(op, group, bias, b, out_dtype)
    sizes = [a.shape[0]] * group.world_size if shard_sizes is None else check_sizes(
        op, "shard_sizes", shard_sizes, group)
    if shard_sizes is not None and sizes[group.rank] != a.shape[0]:
        raise ValueError(f"ditron.{op}: shard_sizes[{group.rank}] = {sizes[group.rank]} but a has "
                         f"{a.shape[0]} rows on rank {group.rank}")
    agree(group, op, (("K", a.shape[1]), ("N", b.shape[1]), ("mode", mode),
                      ("out_dtype", out_dtype), ("shard_sizes", tuple(sizes)), ("impl", impl)))
    return sizes


def pack_rows(a: torch.Tensor, scale_a: torch.Tensor, mode: str, group: Group) -> torch.Tensor:
    """This rank's rows as the gather moves them: ``[M_r, pitch / 4]`` fp32 words holding
    ``packed_row``'s bytes (fp8 values, then the rows' scales), by ``_pad.RowPacker`` (one
    launch, bound in ``group``'s plans per layout)."""
    layout = packed_row(a.shape[1], mode)
    rows = a.shape[0]
    if rows == 0 or layout.k == 0 or a.stride(1) != 1:  # (nothing to move, or strided rows)
        packed = torch.empty((rows, layout.pitch // 4), dtype=torch.float32, device=a.device)
        packed.view(torch.uint8)[:, :layout.k] = a.view(torch.uint8)
        lo = layout.scale_offset // 4
        packed[:, lo:lo + layout.scales] = scale_a.reshape(-1, 1) if mode == "tensor" else scale_a
        return packed
    from . import _pad  # (Triton: imported on first use)
    strides = (0, 0) if mode == "tensor" else scale_a.stride()  # (tensor-wise: any shape)
    key = ("pack_rows", tensor_key(a), tensor_key(scale_a), strides, layout)
    packer = group.plans.get(key, lambda previous=None: _pad.RowPacker(
        a, scale_a, *strides, layout.scale_offset // 4, layout.scales, layout.pitch))
    return packer(a, scale_a)


def k_major(b: torch.Tensor) -> torch.Tensor:
    """``b [K, N]`` as the fp8 MMA reads it, ``w.t()`` of a row-major ``w [N, K]`` with rows on
    16 bytes (a TMA descriptor's rule): ``b`` itself, else a copy made per call (K not a
    multiple of 16, or an unaligned view)."""
    w = b.t()
    if w.stride(1) == 1 and w.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0:
        return b
    buf = torch.empty((w.shape[0], _round16(w.shape[1])), dtype=b.dtype, device=b.device)
    buf = buf[:, :w.shape[1]]
    buf.copy_(w)
    return buf.t()


def _b_scales(scale_b: torch.Tensor, mode: str) -> tuple[torch.Tensor, int]:
    """``scale_b`` and the kernel's stride for it: 0 (tensor-wise), 1 between columns
    (row-wise ``[1, N]``), a block row's length (block-wise)."""
    if mode == "tensor":
        return scale_b.reshape(1), 0
    return scale_b, 1 if mode == "row" else scale_b.shape[1]


def _run(a, b, scale_a, scale_b, bias, group_name, shard_sizes, out_dtype, impl):
    group = resolve_group(group_name)
    mode = scale_mode("ag_gemm_scaled", a, b, scale_a, scale_b)
    m, k, n = sum(shard_sizes), a.shape[1], b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    layout = packed_row(k, mode)
    packed = pack_rows(a, scale_a, mode, group)
    b = k_major(b)
    sb, sb_row = _b_scales(scale_b, mode)
    if use_fused(group, impl, m, n, k):
        from . import _ag_launch
        scaled = _ag_launch.ScaledRows(k, MODES[mode], layout.scale_offset // 4, sb_row)
        _ag_launch.fused(group, packed, b, bias, out, shard_sizes, None, own_out=True,
                         scaled=scaled, scale_b=sb)
        return out
    full = gather_rows(packed, group, shard_sizes)
    a8 = full.view(torch.uint8)[:, :k].view(FP8)
    lo = layout.scale_offset // 4
    sa = full[:, lo:lo + layout.scales]
    return scaled_matmul(a8, b, sa, full.stride(0), sb, sb_row, MODES[mode], bias, out)


_PLANS = threading.local()
"""One plan cache per thread (virtual ranks are threads)."""


def scaled_matmul(a8: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sa_row: int,
                  sb: torch.Tensor, sb_row: int, mode: int, bias: Optional[torch.Tensor],
                  out: torch.Tensor, tiles: tuple = (), deterministic: bool = False,
                  core: str = "auto") -> torch.Tensor:
    """``out = (a8 * sa) @ (b * sb) (+ bias)`` on the portable core (no waits): ``a8 [M, K]`` fp8
    with 16-byte aligned rows, ``b`` column-major fp8, ``sa`` one scale per row (``sa_row``
    floats apart) or per 1x128 block, ``sb`` as ``_b_scales`` gives it; ``mode`` the kernel's
    ``SCALE``. ``deterministic``: the batch-invariant tiles (the reducing ops' unfused
    deterministic partials). ``tiles``: ``((field, value), ...)`` replacing the rule's
    ``TileConfig`` fields (benches comparing tiles). ``core``: ``"auto"`` (the default mode,
    no ``tiles``, where the fp8 WS core takes the product: the portable plan and each WS config
    serving ``mode`` timed once per plan, the fastest kept, a WS plan only under ``TUNE_MARGIN``
    of the portable one, as ``matmul``'s) or ``"tl"`` (the portable core). Plans cached per
    thread and layout."""
    if core not in ("auto", "tl"):
        raise ValueError(f"scaled_matmul: core {core!r} not in ('auto', 'tl')")
    cache = getattr(_PLANS, "cache", None)
    if cache is None:
        cache = _PLANS.cache = PlanCache(None)
    key = _plan_key(a8, b, sa, sa_row, sb, sb_row, mode, bias, out, tiles, deterministic, core)

    def build():
        from triton.tools.tensor_descriptor import TensorDescriptor

        from ..runtime import compiler
        from . import _ws_scaled as ws_scaled
        from ._core import (CoreGemm, Scales, _dummies, build_ws, program_budget,
                            scaled_config, select_config)
        from ._tune import TUNE_CORES, prefer_ws, time_alternating
        m = a8.shape[0]
        budget = program_budget(a8.device, None)
        cfg = select_config(m, b.shape[1], budget, a8.device, deterministic=deterministic)
        cfg = dataclasses.replace(scaled_config(cfg, mode, m, b.shape[1], budget, deterministic),
                                  **dict(tiles))
        a_desc = TensorDescriptor(a8, list(a8.shape), list(a8.stride()), [cfg.block_m, cfg.block_k])
        sig, offsets, claim, record = _dummies(a8.device)
        with compiler.batch("scaled_matmul"):
            portable = _Portable(CoreGemm(
                a_desc, b, out, bias, group=None, wait=False, sig=sig, offsets=offsets,
                claim=claim, record=record, m=m, cfg=cfg, a_varies=True,
                scales=Scales(mode, sa, sb, sa_row, sb_row)))
        if (deterministic or tiles or core != "auto" or not TUNE_CORES
                or ws_scaled.refusal(a8, b, out, bias)):
            return portable
        plans = []
        for c in ws_scaled.configs_for(mode):  # (a Gluon found broken on one: no more tries)
            if ws_scaled.refusal(a8, b, out, bias) is None:
                plans.append(build_ws("scaled_matmul", lambda c=c: ws_scaled.WsScaledGemm(
                    a8, b, out, bias, sa, sb, sa_row, sb_row, mode, config=c)))
        plans = [p for p in plans if p is not None]
        if not plans:
            return portable
        times = time_alternating([lambda: portable.run(a8, b, out, bias, sa, sb)]
                                 + [lambda p=p: p.run(a8, b, out, bias, sa, sb) for p in plans],
                                 out.device)
        best = min(range(len(plans)), key=lambda i: times[1 + i])
        return plans[best] if prefer_ws(times[0], times[1 + best]) else portable
    return cache.get(key, build).run(a8, b, out, bias, sa, sb)


class _Portable:
    """``scaled_matmul``'s plan on the portable core (``run`` as ``WsScaledGemm``'s)."""

    def __init__(self, core):
        self.core, self.name = core, "tl"

    def run(self, a8, b, out, bias, scale_a, scale_b):
        return self.core.run(a8, b, out, bias, scale_a=scale_a, scale_b=scale_b)


def _plan_key(a8, b, sa, sa_row, sb, sb_row, mode, bias, out, tiles, deterministic,
              core) -> tuple:
    return ("scaled_matmul", mode, sa_row, sb_row, tensor_key(a8), tensor_key(b), tensor_key(sa),
            tensor_key(sb), tensor_key(bias), tensor_key(out), tiles, deterministic, core)


def scaled_core(a8, b, sa, sa_row, sb, sb_row, mode, bias, out) -> str:
    """The core ``scaled_matmul`` runs these operands on in the default mode: ``"tl"`` or the
    WS plan's ``"ws:<config>"`` (the plan built by a call here when missing; benches, tests)."""
    scaled_matmul(a8, b, sa, sa_row, sb, sb_row, mode, bias, out)
    key = _plan_key(a8, b, sa, sa_row, sb, sb_row, mode, bias, out, (), False, "auto")
    return _PLANS.cache._plans[key].name


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """The fp8 ops' variants (``runtime.precompile``), when ``dtypes`` holds ``float8_e4m3fn``:
    per fp8 form and scale mode of each tile configuration the rule can pick (``scaled_forms``)
    and output dtype (the fp16 / bf16 among ``dtypes``, else bf16, the ops' default):
    ``scaled_matmul`` (out in that dtype and in fp32, the reducing ops' unfused partials;
    either C store), the row packer, the ``ag_gemm_scaled`` consumer, push call and pull
    producer, the reduce-scatter / broadcast GEMMs; on sm_90 the fp8 WS core's forms (plain,
    waiting consumer and pushing producer where their switches choose them). The unfused
    paths' collectives are the collectives family's (fp32)."""
    if FP8 not in dtypes:
        return
    from triton.tools.tensor_descriptor import TensorDescriptor

    from . import _ag_launch, _rs_launch
    from ._core import CoreGemm, Scales, _dummies, rule_configs, scaled_forms
    outs = [d for d in OUT_DTYPES if d in dtypes] or [torch.bfloat16]
    sig, offsets, claim, record = _dummies(device)
    a8 = torch.zeros(64, 128, dtype=FP8, device=device)
    a_desc_of = {}
    b = a8.clone().t()  # K-major, as k_major gives it
    one = torch.ones(64, device=device)
    for cfg, mode in dict.fromkeys(f for c in rule_configs(device) for f in scaled_forms(c)):
        a_desc = a_desc_of.setdefault(cfg.block_m, TensorDescriptor(
            a8, [64, 128], [128, 1], [cfg.block_m, SCALE_BLOCK]))
        for out_dtype in outs:
            bias = torch.zeros(64, dtype=out_dtype, device=device)  # (fp32 out: rank 0's partial)
            for dtype, with_bias, c_tma in ((d, bi, c) for d, bi in ((out_dtype, False),
                                                                    (torch.float32, False),
                                                                    (torch.float32, True))
                                            for c in (False, True)):
                out = torch.empty(64, 64 if c_tma else 65, dtype=dtype, device=device)[:, :64]
                CoreGemm(a_desc, b, out, bias if with_bias else None, group=None, wait=False,
                         sig=sig, offsets=offsets, claim=claim, record=record, m=64, cfg=cfg,
                         a_varies=True, scales=Scales(mode, one, one, 1, 1))
            _ag_launch.precompile_scaled(device, out_dtype, cfg, mode)
            _rs_launch.precompile_scaled(device, out_dtype, cfg, mode)
    from ._pad import RowPacker
    for k in (128, 120):  # the row packer, 16-byte vectors and bytes
        RowPacker(a8[:, :k], one[:1], 0, 0, 128 // 4, 1, 256)
    from . import _ws_scaled
    if _ws_scaled.core_refusal(device) is None:  # (sm_90: the fp8 WS forms scaled_matmul times)
        _ws_scaled.precompile_scaled_ws(device, outs,
                                        wait=_ag_launch.SCALED_CONSUMER_CORE == "ws",
                                        push=_rs_launch.SCALED_PRODUCER_CORE == "ws")


register_precompile("gemm_scaled", _precompile,
                    ("ag_gemm_scaled", "gemm_rs_scaled", "gemm_ar_scaled"))


def _ag_gemm_scaled_impl(a, b, scale_a, scale_b, bias, group_name, shard_sizes, out_dtype, impl):
    return _run(a, b, scale_a, scale_b, bias, group_name, shard_sizes, out_dtype, impl)


def _ag_gemm_scaled_fake(a, b, scale_a, scale_b, bias, group_name, shard_sizes, out_dtype, impl):
    return a.new_empty((sum(shard_sizes), b.shape[1]), dtype=out_dtype)


define_op("ag_gemm_scaled(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, "
          "str group_name, SymInt[] shard_sizes, ScalarType out_dtype, str impl) -> Tensor",
          _ag_gemm_scaled_impl, _ag_gemm_scaled_fake)


def _aligned_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` with rows a TMA descriptor reads (unit column stride, 16-byte row pitch and base),
    else a copy padded so (per call)."""
    if a.stride(1) == 1 and a.stride(0) % 16 == 0 and a.data_ptr() % 16 == 0:
        return a
    buf = torch.empty((a.shape[0], _round16(a.shape[1])), dtype=a.dtype, device=a.device)
    buf = buf[:, :a.shape[1]]
    buf.copy_(a)
    return buf


def _operands(a, b, scale_a, scale_b, mode: str):
    """The kernel's operands of one rank's partial: ``(a, b, Scales)`` with aligned fp8 rows,
    a K-major ``b`` and the scales' strides; a rank with an empty slice of K gets one zero
    block (it still runs the fused kernel its peers run) with unit row scales."""
    from ._core import Scales
    if a.shape[1] == 0:
        m, n = a.shape[0], b.shape[1]
        a = torch.zeros((m, 16), dtype=FP8, device=a.device)
        b = torch.zeros((n, 16), dtype=FP8, device=b.device).t()
        return a, b, Scales(1, torch.zeros(max(m, 1), device=a.device),
                            torch.zeros(max(n, 1), device=a.device), 1, 1)
    a, b = _aligned_rows(a), k_major(b)
    sb, sb_row = _b_scales(scale_b, mode)
    sa = scale_a.reshape(1) if mode == "tensor" else scale_a
    sa_row = 0 if mode == "tensor" else scale_a.shape[1]
    return a, b, Scales(MODES[mode], sa, sb, sa_row, sb_row)


def _check_bias(op: str, group: Group, bias, b, out_dtype) -> None:
    """``bias`` absent, or ``[N]`` of ``out_dtype`` on ``group``'s device."""
    if bias is not None:
        check_tensor(op, "bias", bias, group, (out_dtype,), min_dim=1)
        if tuple(bias.shape) != (b.shape[1],):
            raise ValueError(f"ditron.{op}: bias must be [N] = [{b.shape[1]}], got {tuple(bias.shape)}")


def _validate_reduce(op: str, group: Group, a, b, scale_a, scale_b, bias, out_dtype,
                     impl) -> str:
    """``gemm_rs_scaled`` / ``gemm_ar_scaled``'s per-rank checks; the scale mode."""
    mode = _check_operands(op, group, a, b, scale_a, scale_b, out_dtype, impl, "K_r")
    _check_bias(op, group, bias, b, out_dtype)
    return mode


def _check_operands(op: str, group: Group, a, b, scale_a, scale_b, out_dtype, impl,
                    k: str) -> str:
    """Every fp8 op's checks of ``a``, ``b``, their scales, ``out_dtype`` and ``impl`` (``k``:
    the name of the shared dimension in messages); the scale mode."""
    check_tensor(op, "a", a, group, (FP8,), min_dim=2)
    check_tensor(op, "b", b, group, (FP8,), min_dim=2)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"ditron.{op}: a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"ditron.{op}: a is [M, {k}] = {tuple(a.shape)} but b is [{k}, N] = "
                         f"{tuple(b.shape)} ({k} must match)")
    if a.shape[1] > int(k == "K_r") and a.stride(1) != 1:  # (one column of K_r: any stride, copied)
        raise ValueError(f"ditron.{op}: a must have unit column stride, got strides {a.stride()}")
    if b.shape[0] > 1 and b.shape[1] > 1 and b.stride(0) != 1:
        raise ValueError(f"ditron.{op}: b must be column-major [{k}, N] (w.t() of a row-major "
                         f"[N, {k}] weight), as torch._scaled_mm takes it; got strides {b.stride()}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        check_tensor(op, name, s, group, (torch.float32,))
        if not s.is_contiguous():
            raise ValueError(f"ditron.{op}: {name} must be contiguous, got strides {s.stride()}")
    mode = scale_mode(op, a, b, scale_a, scale_b)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"ditron.{op}: out_dtype must be torch.bfloat16 or torch.float16, got "
                        f"{out_dtype}")
    if impl not in IMPLS:
        raise ValueError(f"ditron.{op}: impl must be one of {IMPLS}, got {impl!r}")
    return mode


def gemm_rs_scaled(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, group: Optional[Group] = None, *,
                   bias: Optional[torch.Tensor] = None,
                   out_dtype: torch.dtype = torch.bfloat16, deterministic: Optional[bool] = None,
                   impl: str = "auto",
                   shard_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """fp8 GEMM of row-parallel shards, reduce-scattered: this rank's rows of
    ``Σ_r (a_r * scale_a_r) @ (b_r * scale_b_r)``.

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K_r]`` ``float8_e4m3fn`` (this rank's slice of the reduction dimension).
    b : torch.Tensor
        ``[K_r, N]`` ``float8_e4m3fn``, column-major (``w.t()`` of a row-major ``[N, K_r]``).
    scale_a, scale_b : torch.Tensor
        This rank's fp32 scales, contiguous, as ``ag_gemm_scaled`` takes them with ``K_r`` for
        K: tensor-wise, row-wise (``[M, 1]``, ``[1, N]``) or block-wise (``[M, ceil(K_r/128)]``,
        ``[ceil(K_r/128), ceil(N/128)]``).
    bias : torch.Tensor, optional
        ``[N]`` of ``out_dtype``, the same on every rank (given on all or none), added once, in
        fp32: rank 0's partial carries it, so a row is ``(p_0 + bias) + p_1 + ...``.
    group, deterministic, impl, shard_sizes
        As ``gemm_rs``. The partials stay fp32 and are summed in rank order, rounded once to
        ``out_dtype`` (deterministic: the same bits run to run).
    out_dtype : torch.dtype
        ``torch.bfloat16`` (default) or ``torch.float16``.

    Returns
    -------
    torch.Tensor
        ``[shard_sizes[rank], N]`` of ``out_dtype``.

    Constraints
    -----------
    Collective, as ``gemm_rs``: the same M, N, scale mode, ``out_dtype``, flags and presence of
    ``bias`` on every rank. No autograd.
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate():
        mode = _validate_reduce("gemm_rs_scaled", group, a, b, scale_a, scale_b, bias, out_dtype,
                                impl)
        rows = split_sizes(a.shape[0], group.world_size) if shard_sizes is None else check_sizes(
            "gemm_rs_scaled", "shard_sizes", shard_sizes, group)
        if sum(rows) != a.shape[0]:
            raise ValueError(f"ditron.gemm_rs_scaled: shard_sizes {rows} must sum to M = {a.shape[0]}")
        agree(group, "gemm_rs_scaled", (("M", a.shape[0]), ("N", b.shape[1]), ("mode", mode),
                                        ("out_dtype", out_dtype), ("shard_sizes", tuple(rows)),
                                        ("impl", impl), ("deterministic", flag),
                                        ("bias", bias is not None)))
        return rows
    rows = memo(group, call_key("gemm_rs_scaled", a, b, scale_a, scale_b, bias, out_dtype, impl,
                                shard_sizes, flag), validate)
    name = name_for_rows(name, group, rows)
    if direct(a, b, scale_a, scale_b, bias):
        return _gemm_rs_scaled_impl(a, b, scale_a, scale_b, bias, name, rows, out_dtype, flag,
                                    impl)
    return torch.ops.ditron.gemm_rs_scaled(a, b, scale_a, scale_b, bias, name, rows, out_dtype,
                                           flag, impl)


def gemm_ar_scaled(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, group: Optional[Group] = None, *,
                   bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, deterministic: Optional[bool] = None,
                   impl: str = "auto", algorithm: str = "auto") -> torch.Tensor:
    """fp8 GEMM of row-parallel shards, all-reduced: ``Σ_r (a_r * scale_a_r) @ (b_r * scale_b_r)``
    on every rank, ``[M, N]`` of ``out_dtype``. Parameters as ``gemm_rs_scaled``; ``algorithm``
    as ``gemm_ar``'s.

    Constraints
    -----------
    As ``gemm_rs_scaled``.
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate():
        mode = _validate_reduce("gemm_ar_scaled", group, a, b, scale_a, scale_b, bias, out_dtype,
                                impl)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"ditron.gemm_ar_scaled: algorithm must be one of {ALGORITHMS}, got "
                             f"{algorithm!r}")
        agree(group, "gemm_ar_scaled", (("M", a.shape[0]), ("N", b.shape[1]), ("mode", mode),
                                        ("out_dtype", out_dtype), ("impl", impl),
                                        ("algorithm", algorithm), ("deterministic", flag),
                                        ("bias", bias is not None)))
        return True
    memo(group, call_key("gemm_ar_scaled", a, b, scale_a, scale_b, bias, out_dtype, impl,
                         algorithm, flag), validate)
    if direct(a, b, scale_a, scale_b, bias):
        return _gemm_ar_scaled_impl(a, b, scale_a, scale_b, bias, name, out_dtype, flag, impl,
                                    algorithm)
    return torch.ops.ditron.gemm_ar_scaled(a, b, scale_a, scale_b, bias, name, out_dtype, flag,
                                           impl, algorithm)


def _partial_fp32(a, b, scales, bias, rank: int, deterministic: bool) -> torch.Tensor:
    """This rank's scaled product in fp32 (the unfused paths), ``+ bias`` at rank 0 only (the
    fused kernels' rule: ``_rs_kernels._plus_bias``); batch-invariant tiles when
    ``deterministic``."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    return scaled_matmul(a, b, scales.a, scales.a_row, scales.b, scales.b_row, scales.mode,
                         bias if rank == 0 else None, out, deterministic=deterministic)


def _gemm_rs_scaled_impl(a, b, scale_a, scale_b, bias, group_name, shard_sizes, out_dtype,
                         deterministic, impl):
    from . import _rs_launch
    group = resolve_group(group_name)
    rows = list(shard_sizes)
    out = torch.empty((rows[group.rank], b.shape[1]), dtype=out_dtype, device=a.device)
    if a.shape[0] == 0 or b.shape[1] == 0:
        return out
    mode = scale_mode("gemm_rs_scaled", a, b, scale_a, scale_b)
    a, b, scales = _operands(a, b, scale_a, scale_b, mode)
    if _fused_wanted(group, impl, deterministic, "gemm_rs", 2 * a.shape[0] * a.shape[1] * b.shape[1]):
        return _rs_launch.fused(group, a, b, out, rows, broadcast=False, op="gemm_rs",
                                deterministic=deterministic, scales=scales, bias=bias)
    partial = _partial_fp32(a, b, scales, bias, group.rank, deterministic)
    return reduce_rows(partial, group, rows, out, deterministic)


def _gemm_ar_scaled_impl(a, b, scale_a, scale_b, bias, group_name, out_dtype, deterministic, impl,
                         algorithm):
    from . import _rs_launch
    group = resolve_group(group_name)
    m, n = a.shape[0], b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    mode = scale_mode("gemm_ar_scaled", a, b, scale_a, scale_b)
    a, b, scales = _operands(a, b, scale_a, scale_b, mode)
    if _fused_wanted(group, impl, deterministic, "gemm_ar", 2 * m * a.shape[1] * n):
        if algorithm == "auto":
            algorithm = "one_shot" if m * n * 4 <= ONE_SHOT_MAX_BYTES else "two_shot"
        if algorithm == "one_shot":
            return _rs_launch.fused(group, a, b, out, [m] * group.world_size, broadcast=True,
                                    op="gemm_ar", deterministic=deterministic, scales=scales,
                                    bias=bias)
        rows = split_sizes(m, group.world_size)
        mine = torch.empty((rows[group.rank], n), dtype=out_dtype, device=a.device)
        mine = _rs_launch.fused(group, a, b, mine, rows, broadcast=False, op="gemm_ar",
                                deterministic=deterministic, scales=scales, bias=bias)
        return gather_rows(mine, group, rows, out=out)
    return sum_all(_partial_fp32(a, b, scales, bias, group.rank, deterministic), group, out,
                   deterministic)


def _gemm_rs_scaled_fake(a, b, scale_a, scale_b, bias, group_name, shard_sizes, out_dtype,
                         deterministic, impl):
    rank = resolve_group(group_name).rank
    return a.new_empty((shard_sizes[rank], b.shape[1]), dtype=out_dtype)


def _gemm_ar_scaled_fake(a, b, scale_a, scale_b, bias, group_name, out_dtype, deterministic, impl,
                         algorithm):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


define_op("gemm_rs_scaled(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, "
          "str group_name, SymInt[] shard_sizes, ScalarType out_dtype, bool deterministic, "
          "str impl) -> Tensor",
          _gemm_rs_scaled_impl, _gemm_rs_scaled_fake)
define_op("gemm_ar_scaled(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias, "
          "str group_name, ScalarType out_dtype, bool deterministic, str impl, "
          "str algorithm) -> Tensor",
          _gemm_ar_scaled_impl, _gemm_ar_scaled_fake)
