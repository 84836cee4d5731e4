"""``matmul``'s precompile family (``runtime.precompile``): the portable core's variants only
the plain ``matmul`` runs (the fused ops' consumers are their own families')."""
from __future__ import annotations

import itertools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime.precompile import register_precompile
from ._core import (NARROW_CANDIDATES, SHORT_K_CANDIDATE, SKINNY_CANDIDATES, SLICED_TAIL_MAIN,
                    WIDE_CANDIDATES, CoreGemm, SkinnyGemm, SplitKGemm, StripGemm, _dummies,
                    rule_configs)
from ._pad import RowPad
from ._ws_launch import core_refusal as ws_core_refusal
from ._ws_launch import precompile_ws


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """``matmul``'s own variants (``runtime.precompile``; the unsplit persistent ones are the
    ``ag_gemm`` family's plain consumers): per tile configuration the rule can pick, fp16 and
    bf16, B ``[K, N]`` and ``[N, K]``, the split GEMM; the reduce into each dtype and fp32; on
    the GPU the tiles only it takes (``precompile_plain_only``) and, on sm_90, the WS core's
    forms (``precompile_ws``)."""
    wanted = [d for d in (torch.float16, torch.bfloat16) if d in dtypes]
    if device.type == "cuda":
        precompile_plain_only(device, dtypes)
        if ws_core_refusal(device) is None:
            precompile_ws(device, dtypes)
    for cfg, dtype in itertools.product(rule_configs(device), wanted):
        a = torch.ones(64, 256, dtype=dtype, device=device)
        a_desc = TensorDescriptor(a, [64, 256], [256, 1], [cfg.block_m, cfg.block_k])
        for b in (a.new_ones(256, 64), a.new_ones(64, 256).t()):
            for out_dtype in (dtype, torch.float32):
                out = torch.empty(64, 64, dtype=out_dtype, device=device)
                SplitKGemm(a_desc, b, out, None, m=64, cfg=cfg, split=2, a_varies=True)


def precompile_plain_only(device: torch.device, dtypes: tuple) -> None:
    """The tiles only the plain ``matmul`` takes on the GPU: ``SkinnyGemm`` per skinny
    candidate and the narrow candidates' ``CoreGemm`` (``_core_configs.narrow``), fp16 and
    bf16, B ``[K, N]`` and ``[N, K]``, out in the dtype and in fp32 (deterministic mode's
    products); ``SHORT_K_CANDIDATE``, the wide candidates' ``StripGemm`` and the sliced tail's
    unsplit launch (``SLICED_TAIL_MAIN``; out in the dtype only: ``short_k``, ``wide``,
    ``sliced_tail``; its split launches are ``_precompile``'s), and ``RowPad``'s copy.
    ``tools/sm90_compile.py`` calls it with a CPU device."""
    wanted = [d for d in (torch.float16, torch.bfloat16) if d in dtypes]
    sig, offsets, claim, record = _dummies(device)
    two_bytes = (SHORT_K_CANDIDATE, SLICED_TAIL_MAIN) + WIDE_CANDIDATES  # (2-byte C only)
    plain = SKINNY_CANDIDATES + NARROW_CANDIDATES + two_bytes
    for cand, dtype in itertools.product(plain, wanted):
        cfg = cand.cfg
        a = torch.ones(cfg.block_m, 256, dtype=dtype, device=device)
        a_desc = TensorDescriptor(a, list(a.shape), [256, 1], [cfg.block_m, cfg.block_k])
        for b in (a.new_ones(256, 64), a.new_ones(64, 256).t()):
            two_byte = cand in two_bytes
            for out_dtype in (dtype,) if two_byte else (dtype, torch.float32):
                out = torch.empty(cfg.block_m, 64, dtype=out_dtype, device=device)
                if cfg.swap_ab:
                    SkinnyGemm(a_desc, b, out, None, m=cfg.block_m, cfg=cfg, a_varies=True)
                elif cfg.strip:
                    StripGemm(a_desc, b, out, None, m=cfg.block_m, cfg=cfg, a_varies=True)
                else:
                    CoreGemm(a_desc, b, out, None, group=None, wait=False, sig=sig,
                             offsets=offsets, claim=claim, record=record, m=cfg.block_m,
                             cfg=cfg, a_varies=True)
    for dtype in wanted:
        RowPad(torch.ones(8, 264, dtype=dtype, device=device))


register_precompile("matmul", _precompile, ("matmul",))
