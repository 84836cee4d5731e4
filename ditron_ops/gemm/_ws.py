"""Experimental: ``ws_matmul``, the plain GEMM through ``_ws_kernels.ws_gemm_kernel`` (Triton's
Hopper warp specialization), and the variants ``bench gemm_sweep --only ws`` measures.

No production path imports this module: ``matmul``'s rule never picks these variants (NOT
MEASURED; benchmarks/NOTES.md, GEMM core, Warp-specialized variants). A plan per call key
holds the fitted stages, the grid, padded copies of operands no TMA descriptor can read, and
the kernel's global scratch (its in-kernel descriptors, 512 bytes per program), handed to
Triton through a launch-scoped allocator so that nothing is allocated during graph capture.
"""
from __future__ import annotations

import contextvars
import dataclasses
import threading
from typing import Optional

import torch
from triton.runtime import _allocation

from ..runtime.plan import PlanCache, tensor_key
from ._core import _padded_copy, _shared_memory_limit, _tma_ok, program_budget
from ._core_configs import TileConfig
from ._ws_kernels import ws_gemm_kernel

if not isinstance(getattr(_allocation, "_allocator", None), contextvars.ContextVar):
    raise ImportError("ditron_ops.gemm._ws needs triton's context-scoped allocator "
                      "(triton.runtime._allocation._allocator, a ContextVar since 3.5)")


@dataclasses.dataclass(frozen=True)
class WsVariant:
    """A tile configuration of ``ws_gemm_kernel`` and whether its tile loop is warp specialized.

    ``cfg.num_warps`` is what Triton is asked for: 4 with ``warp_specialize`` (Triton's Hopper
    pass needs 4 and runs 12: a producer and two consumer warp groups); ``split_tail`` is
    ignored (whole tiles only).
    """
    cfg: TileConfig
    warp_specialize: bool = True


WS_VARIANTS = {
    "ws/128x256x64/s3": WsVariant(TileConfig(128, 256, 64, 8, 4, 3)),
    "ws/256x128x64/s3": WsVariant(TileConfig(256, 128, 64, 8, 4, 3)),
    "ws/128x128x64/s5": WsVariant(TileConfig(128, 128, 64, 8, 4, 5)),
    "ws/128x128x64/s6": WsVariant(TileConfig(128, 128, 64, 8, 4, 6)),
    "nows/128x256x64/s3": WsVariant(TileConfig(128, 256, 64, 8, 8, 3), warp_specialize=False),
}
"""What ``--only ws`` measures: the most stages each tile fits beside its full-tile C block
(bf16 C; 128x256 at 4 stages would need 262 KB), and ``nows/``, the same kernel without warp
specialization at 8 warps, the control that separates warp specialization from this kernel's
other differences (in-kernel descriptors, no half-width epilogue, no split tail)."""


def ws_stages(cfg: TileConfig, in_bytes: int, out_bytes: int, limit: int) -> TileConfig:
    """``cfg`` with as many of its stages as fit ``limit`` bytes of shared memory: per stage an A
    and a B block, plus the whole ``[block_m, block_n]`` C block and 1 KB (compiled: 128x256 s3
    bf16 213,464 bytes, estimated 214,016). At least 2 stages: ``ValueError`` where those do not
    fit (fp32 C of 256 x 128 tiles)."""
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * in_bytes
    fixed = cfg.block_m * cfg.block_n * out_bytes + 1024
    stages = min(cfg.num_stages, (limit - fixed) // stage)
    if stages < 2:
        raise ValueError(f"ws_matmul: {cfg} does not fit {limit} bytes of shared memory with "
                         f"{out_bytes}-byte C")
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


def kernel_args(a: torch.Tensor, b_src: torch.Tensor, c: torch.Tensor, k: int, b_kn: bool,
                v: WsVariant) -> tuple[tuple, dict]:
    """``ws_gemm_kernel``'s arguments: ``a [M, K]``, ``b_src`` (``B [K, N]`` when ``b_kn``, else
    ``B^T [N, K]``), ``c [M, N]``, each with unit column stride and 16-byte aligned rows."""
    cfg = v.cfg
    n = b_src.shape[1] if b_kn else b_src.shape[0]
    args = (a, b_src, c, a.shape[0], n, k, a.stride(0), b_src.stride(0), c.stride(0))
    return args, dict(B_KN=b_kn, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m, WARP_SPECIALIZE=v.warp_specialize,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)


class _WsPlan:
    """``ws_matmul`` of one key: the variant with its stages fitted to the device, the grid
    (one program per tile up to the SMs), padded copies where a descriptor cannot read an
    operand as it is, and the kernel's global scratch (made on the first launch)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, v: WsVariant):
        device = out.device
        if device.type == "cuda":
            limit = _shared_memory_limit(device.index if device.index is not None else 0)
            v = dataclasses.replace(v, cfg=ws_stages(v.cfg, a.element_size(),
                                                      out.element_size(), limit))
        self.variant, self.device = v, device
        m, n = out.shape
        self.a_pad = None if _tma_ok(a) else _padded_copy(a)
        self.b_kn = _tma_ok(b) or not _tma_ok(b.t())
        self.b_pad = None if _tma_ok(b) or _tma_ok(b.t()) else _padded_copy(b)
        self.c_tmp = None if _tma_ok(out) else _padded_copy(out)
        tiles = -(-m // v.cfg.block_m) * -(-n // v.cfg.block_n)
        self.grid = (max(1, min(tiles, program_budget(device, None))),)
        self._scratch: Optional[torch.Tensor] = None

    def _allocate(self, size: int, alignment: int, stream) -> torch.Tensor:
        """Triton's allocator for the launch: the plan's scratch (a new one only if it grows)."""
        assert alignment <= 256, alignment  # torch's CUDA allocations are 512-byte aligned
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._scratch

    def run(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.a_pad is not None:
            a = self.a_pad.copy_(a)
        if self.b_pad is not None:
            b = self.b_pad.copy_(b)
        b_src = b if self.b_kn else b.t()
        c = out if self.c_tmp is None else self.c_tmp
        args, kwargs = kernel_args(a, b_src, c, a.shape[1], self.b_kn, self.variant)
        token = _allocation._allocator.set(self._allocate)
        try:
            ws_gemm_kernel[self.grid](*args, **kwargs)
        finally:
            _allocation._allocator.reset(token)
        if self.c_tmp is not None:
            out.copy_(self.c_tmp)
        return out


_PLANS = threading.local()
"""One plan cache per thread: a plan owns padded copies and the kernel's descriptor scratch,
which virtual ranks (threads) must not share."""


def ws_matmul(a: torch.Tensor, b: torch.Tensor, variant="ws/128x256x64/s3",
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` through ``ws_gemm_kernel`` (experiment; benches and tests only).

    Parameters
    ----------
    a, b : torch.Tensor
        ``a [M, K]``, ``b [K, N]`` (any strides; ``w.t()`` without a copy), one dtype: fp16 /
        bf16 on the GPU (fp32 too in the interpreter).
    variant : str or WsVariant
        A name of ``WS_VARIANTS`` or a variant (tests: small tiles in the interpreter).
    out : torch.Tensor, optional
        ``[M, N]``, any strides and float dtype; default a new tensor of ``a``'s dtype.

    Returns
    -------
    torch.Tensor
        ``out``. Raises ``ValueError`` where the variant's 2 stages and C block do not fit.
    """
    v = WS_VARIANTS[variant] if isinstance(variant, str) else variant
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"ws_matmul: needs a [M, K] and b [K, N], got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"ws_matmul: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device or (out is not None and out.device != a.device):
        raise ValueError("ws_matmul: a, b and out must be on one device")
    out = a.new_empty((a.shape[0], b.shape[1])) if out is None else out
    if tuple(out.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(f"ws_matmul: out must be {(a.shape[0], b.shape[1])}, got {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    key = ("ws_matmul", a.device, v, tensor_key(a), tensor_key(b), tensor_key(out))
    cache = getattr(_PLANS, "cache", None)
    if cache is None:
        cache = _PLANS.cache = PlanCache(None)
    return cache.get(key, lambda: _WsPlan(a, b, out, v)).run(a, b, out)
