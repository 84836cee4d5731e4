"""Host side of the WS core's fp8 form (``_ws_scaled_kernels``): its configs and the scale modes
each serves, the refusal and ``WsScaledGemm``, the bound plan ``scaled.scaled_matmul`` times
against the portable core's and, waiting (``consumer_config``), the ``ag_gemm_scaled``
consumer's.

Imports on a Triton without Gluon (``refusal`` then refuses).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from ._ws_kernels import HAVE_GLUON, MAXNREG
from ._ws_launch import SKINNY_M, _sm_count, _stand_in, core_refusal
from ._ws_scaled_kernels import ws_scaled_kernel

if HAVE_GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
else:
    gl = GluonDescriptor = None

BLOCK_K = 128
"""K per step: one fp8 128-byte swizzled row of a box, one scale block."""
SMEM_BYTES = 232448 - 2048
"""The H100/H200 per-block shared memory, less the barriers and the compiler's scratch."""
MAX_STAGES = 8


@dataclasses.dataclass(frozen=True)
class ScaledConfig:
    """Tile ``block_m x block_n`` on two 4-warp consumers: ``split``, each taking 64 rows of
    every tile (``block_m`` 128) in 128-column halves (``block_n`` 128 or 256), else ping-pong
    (``block_m`` 64, ``block_n`` 128), each taking alternate tiles (both mainloops at once over
    an interleaved ring). ``modes``: the kernel ``SCALE`` values it serves. ``epi_bufs``: C
    staging tiles per consumer (2: a part's TMA store drains while the next part is staged,
    where 1 waits for it). ``promote``: K steps of 128 per promotion into the fp32 sum (2: two
    steps' wgmmas chained into one product, half the waits and adds; ``SCALE`` 1 only, as
    block scales change every step)."""
    block_m: int
    block_n: int
    split: bool
    modes: tuple
    epi_bufs: int = 1
    promote: int = 1


SCALED_CONFIGS = {
    "split128x256p2e2": ScaledConfig(128, 256, True, (1, ), 2, 2),
    "split128x128p2e2": ScaledConfig(128, 128, True, (1, ), 2, 2),
    "split128x128e2": ScaledConfig(128, 128, True, (2, ), 2),
    "pp64x128": ScaledConfig(64, 128, False, (2, )),
}
"""The configs ``scaled_matmul`` times per plan, those serving its mode (``configs_for``;
``precompile`` binds them): none wins everywhere. A warpgroup's share of a tile is 64 x 128
(64 x 256 in two halves): the sum(s) and a product live (``_ws_scaled_kernels`` module
docstring). Tensor / row scales: the two split tiles with a promotion every 256 of K (``p2``)
and double-buffered C staging (``e2``), each faster than its single forms on most model shards;
128 wide beats 256 wide on few-tile shapes and loses on full waves. Block scales (no ``p2``:
their scales change every step): the 128-wide split (the 256-wide one spills there) and the
ping-pong, which wins a few 256-row shapes. Figures and command: benchmarks/NOTES.md, fp8."""


def configs_for(mode: int) -> tuple:
    """``SCALED_CONFIGS`` serving scale ``mode`` (the kernel's ``SCALE``)."""
    return tuple(c for c in SCALED_CONFIGS if mode in SCALED_CONFIGS[c].modes)


def epi_n(out_bytes: int) -> int:
    """Columns of one staged C store: 64 of a 2-byte C, 32 of fp32 (a 128-byte swizzled row)."""
    return 128 // out_bytes


def stages(cfg: ScaledConfig, out_bytes: int, push: bool = False) -> int:
    """Ring depth: as many A/B boxes as fit beside the two consumers' 64-row C staging tiles
    (``epi_bufs`` each; none in a pushing producer), at most ``MAX_STAGES``."""
    staging = 0 if push else 2 * cfg.epi_bufs * 64 * epi_n(out_bytes) * out_bytes
    per_stage = (cfg.block_m + cfg.block_n) * BLOCK_K
    return min(MAX_STAGES, (SMEM_BYTES - staging) // per_stage)


def refusal(a8, b, out, bias) -> Optional[str]:
    """Why the fp8 WS core does not take ``out = (a8 * sa) @ (b * sb) (+ bias)`` (None: it
    does): sm_90 with Gluon (``_ws_launch.core_refusal``) and ``operand_refusal``."""
    return core_refusal(a8.device) or operand_refusal(a8, b, out, bias)


def operand_refusal(a8, b, out, bias) -> Optional[str]:
    """``refusal``'s part that reads dtypes, shapes, strides and addresses: e4m3 operands, M
    above ``SKINNY_M``, K and N not 0 (a consumer would wait for a K step no loader fills),
    operands TMA reads and writes as they are (``a8`` and the weight ``b.t()`` with unit column
    strides, 16-byte row pitches and bases; ``out`` likewise, None: no C, a pushing
    producer's); ``bias`` contiguous."""
    import torch
    if a8.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return "operands not float8_e4m3fn"
    if a8.shape[0] <= SKINNY_M:
        return f"M <= {SKINNY_M}"
    if a8.shape[1] == 0 or b.shape[1] == 0:
        return "K or N is 0"
    for name, t in (("a", a8), ("b.t()", b.t()), ("out", out)):
        if t is not None and (t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16
                              or t.data_ptr() % 16):
            return f"{name}: TMA needs unit column strides and 16-byte rows"
    if bias is not None and not bias.is_contiguous():
        return "bias not contiguous"
    return None


def _desc(t, block):
    dtype = {1: gl.float8e4nv, 2: gl.bfloat16 if str(t.dtype).endswith("bfloat16")
             else gl.float16, 4: gl.float32}[t.element_size()]
    return GluonDescriptor.from_tensor(t, list(block),
                                       gl.NVMMASharedLayout.get_default_for(list(block), dtype))


def scaled_operands(a8, b, out, bias, sa, sb, sa_row: int, sb_row: int, mode: int,
                    cfg: ScaledConfig, sms: int, wait=None, push=None):
    """``(grid, args, meta)`` of ``ws_scaled_kernel`` (no launch); ``wait``: the ag_gemm
    consumer's ``(sig, offsets, claim, record, rank, world_size, timeout_us, op_id)`` (the
    kernel's ``WAIT``; a split config); ``push``: the gemm_rs / gemm_ar producer's ``(slots,
    peers, offsets, slot_rows, rank, world_size, broadcast)`` (the kernel's ``PUSH``, a split
    config; ``out`` gives only the device: no C is written, the product is ``a8``'s rows by
    ``b``'s columns); else neither."""
    import torch

    from ._core import _dummies
    m, n = a8.shape[0], b.shape[1]  # (a producer's out holds only this rank's rows)
    if push is not None:
        if wait is not None or not cfg.split:
            raise ValueError(f"ws scaled: a pushing producer is split and does not wait: {cfg}")
        out = _stand_in(out.device, torch.float32, 64, epi_n(4))
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if mode not in cfg.modes:  # (the p2 forms have no block-scale form)
        raise ValueError(f"ws scaled: {cfg} does not serve SCALE {mode}")
    args = (_desc(a8, (cfg.block_m, BLOCK_K)), _desc(b.t(), (128, BLOCK_K)),
            _desc(out, (64, epi_n(out.element_size()))),
            bias if bias is not None else out, sa, sb, sa_row, sb_row, m, n, a8.shape[1])
    if wait is not None and not cfg.split:
        raise ValueError(f"ws scaled: a waiting consumer is split, not {cfg}")
    sig, offsets, claim, record = _dummies(out.device)
    if wait is not None:
        args += tuple(wait) + (sig, sig, 0)
    elif push is not None:
        slots, peers, offsets, slot_rows, rank, world_size, _ = push
        args += (sig, offsets, claim, record, rank, world_size, 0, 0, slots, peers, slot_rows)
    else:
        args += (sig, offsets, claim, record, 0, 1, 0, 0, sig, sig, 0)
    meta = dict(SCALE=mode, HAS_BIAS=bias is not None, GROUP_M=8,
                STAGES=stages(cfg, out.element_size(), push is not None), SPLIT=cfg.split,
                HALVES=cfg.block_n // 128, EPI_BUFS=cfg.epi_bufs, PROMOTE=cfg.promote,
                WAIT=wait is not None, PUSH=0 if push is None else 2 if push[6] else 1,
                num_warps=4, maxnreg=MAXNREG)
    return (max(1, min(tiles, sms)), ), args, meta


class WsScaledGemm:
    """The fp8 product's plan on the WS core in ``config`` (one of ``SCALED_CONFIGS`` serving
    ``mode``), its kernel bound once (``runtime.launcher.BoundKernel``; descriptors made once
    per address); ``run`` launches it with the call's tensors. ``wait``: the ag_gemm consumer
    (``scaled_operands``; ``a8`` the gathered rows, ``sa`` their scales). ``push``: the
    gemm_rs / gemm_ar producer (``scaled_operands``; fp32 sums of ``a8``'s rows go to the
    slots, ``out`` is not written)."""

    def __init__(self, a8, b, out, bias, sa, sb, sa_row: int, sb_row: int, mode: int,
                 config: str, sms: Optional[int] = None, wait=None, push=None):
        from ..runtime.launcher import BoundKernel
        if config not in SCALED_CONFIGS:
            raise ValueError(f"ws scaled: config {config!r} not in {tuple(SCALED_CONFIGS)}")
        why = operand_refusal(a8, b, None if push is not None else out, bias)
        if why is not None:
            raise RuntimeError(f"ws scaled: {why}")
        if sms is None:
            dev = out.device.index if out.device.index is not None else 0
            sms = _sm_count(dev)
        self.config = config
        self.name = "ws:" + self.config
        grid, args, meta = scaled_operands(a8, b, out, bias, sa, sb, sa_row, sb_row, mode,
                                           SCALED_CONFIGS[self.config], sms, wait, push)
        # per call: A, B, C, bias (C again without one), the scales; a pushing launch: no C,
        # a bias only where it has one
        self._push = push is not None
        vary = (("a_desc", "b_desc") + (() if self._push else ("c_desc", ))
                + (("bias_ptr", ) if bias is not None or not self._push else ())
                + ("sa_ptr", "sb_ptr"))
        self.kernel = BoundKernel(ws_scaled_kernel, grid, args, meta, vary=vary,
                                  device=out.device)

    def run(self, a8, b, out, bias, scale_a, scale_b):
        if self._push:
            self.kernel.launch(a8, b.t(), *(() if bias is None else (bias, )), scale_a, scale_b)
        else:
            self.kernel.launch(a8, b.t(), out, bias if bias is not None else out, scale_a,
                               scale_b)
        return out


def precompile_scaled_ws(device, out_dtypes, sms: int = 132, wait=False, push=False) -> None:
    """Bind every form ``WsScaledGemm`` can take (config, scale mode, C dtype, bias) for the 2-byte
    ``out_dtypes`` (a bias of C's dtype or none) and fp32 (the reducing ops' partials: no bias,
    or a 2-byte one), of ``SCALED_CONFIGS`` (what ``scaled_matmul`` times);
    ``wait``: also the ag_gemm consumer's (``consumer_config``'s, C in ``out_dtypes`` with and
    without bias); ``push``: also the gemm_rs / gemm_ar producer's (``consumer_config``'s,
    scattering and broadcasting, a bias of ``out_dtypes`` or none). Nothing is launched
    (``scaled._precompile`` inside its ``compiler.batch``; ``tools/sm90_compile.py`` on a CPU
    device)."""
    import torch

    from ._core import _dummies
    a8 = torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device=device)
    b = torch.zeros(128, 256, dtype=torch.float8_e4m3fn, device=device).t()
    one = torch.ones(128, device=device)
    forms = [(dtype, bias_dtype) for dtype in out_dtypes for bias_dtype in (None, dtype)]
    # fp32 C: the reducing ops' unfused partials, rank 0's with the op's 2-byte bias
    plain = forms + [(torch.float32, bias_dtype) for bias_dtype in (None, ) + tuple(out_dtypes)]
    binds = [(name, mode, form, None, None) for name, form in itertools.product(
        SCALED_CONFIGS, plain) for mode in SCALED_CONFIGS[name].modes]
    sig, offsets, _, _ = _dummies(device)
    if wait:
        waits = _dummies(device) + (0, 2, 10**6, 0)
        binds += [(name, mode, form, waits, None) for mode, name in CONSUMER_FORMS
                  for form in forms]
    if push:
        slots = torch.zeros(1 << 16, dtype=torch.float32, device=device)
        binds += [(name, mode, (torch.float32, bias_dtype), None,
                   (slots, sig, offsets, 64, 0, 2, broadcast))
                  for mode, name in CONSUMER_FORMS for bias_dtype in (None, ) + tuple(out_dtypes)
                  for broadcast in (False, True)]
    for name, mode, (dtype, bias_dtype), waits, pushes in binds:
        out = torch.empty(64, 128, dtype=dtype, device=device)
        bias = None if bias_dtype is None else torch.zeros(128, dtype=bias_dtype, device=device)
        WsScaledGemm(a8, b, out, bias, one, one, 1, 1, mode, name, sms=sms, wait=waits,
                     push=pushes)


NARROW_TILE_COST = 1.07
"""Time of a 128x128 tile in halves of a 128x256 one (a wave of the narrow tiles costs
``NARROW_TILE_COST / 2`` of a wide wave): fit on the two tensor / row configs' plain runs over
the model shards (fit and misses: benchmarks/NOTES.md, fp8)."""


CONSUMER_FORMS = ((1, "split128x256p2e2"), (1, "split128x128p2e2"), (2, "split128x128e2"))
"""Every ``(scale mode, config)`` ``consumer_config`` gives (``precompile``'s waiting and
pushing forms)."""


def consumer_config(mode: int, m: int, n: int, sms: int) -> str:
    """The ag_gemm consumer's config for scale ``mode`` over ``m`` gathered rows, ``n`` columns
    and ``sms`` programs, and the gemm_rs / gemm_ar producer's over its ``m`` rows (a waiting
    kernel cannot be timed alone, nor one writing into peers' slots, so a rule, rank-local:
    each rank's consumer only waits for flags, and each rank's producer writes whole rows of
    fp32 sums whatever its tiles): block scales ``split128x128e2`` (the 256-wide
    split spills there); tensor / row scales the tile of fewer waves, ``split128x256p2e2``'s
    ``ceil(tiles / sms)`` against ``split128x128p2e2``'s times ``NARROW_TILE_COST / 2`` (a few
    256-wide tiles or a near-empty last wave of them: narrow up to 1.7x faster, e.g.
    1280x1152x3584, 971x4608x512; else wide)."""
    if mode != 1:
        return "split128x128e2"
    rows = -(-m // 128)
    wide = -(-rows * -(-n // 256) // sms)
    narrow = -(-rows * -(-n // 128) // sms) * NARROW_TILE_COST / 2
    return "split128x128p2e2" if narrow < wide else "split128x256p2e2"
