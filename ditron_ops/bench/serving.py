"""Bench ``serving``: the decode step's two serving ops against what an engine runs without them.

- paged ``flash_decode`` vs the contiguous op over the same keys, and SDPA over the whole
  sequence (``serving_decode``; rows ``case = "paged p<page> ..."``);
- ``all_reduce_rmsnorm`` vs our all_reduce + torch add + ``F.rms_norm`` (+ torch e4m3
  quantization), default and deterministic (``serving_norm``).

``--only decode`` / ``--only norm`` runs one part. Targets: paged >= 0.95x contiguous from page
16 up (every case >= 0.90x); fused norm <= 0.7x the composition's time at T <= 128 and never
slower above; deterministic <= 1.1x default.
"""
from __future__ import annotations

import dataclasses

import torch

from .harness import BenchConfig, Result, register
from .serving_decode import paged_rows
from .serving_norm import run as norm_rows

PARTS = {"decode": paged_rows, "norm": norm_rows}


@register("serving", help="paged flash_decode vs contiguous and SDPA; fused all_reduce + "
                          "residual + RMSNorm (+ e4m3) vs the composition",
          world_sizes=(2, 4, 8), quick_world_sizes=(2,))
def run(cfg: BenchConfig) -> list[Result]:
    parts = [p for p in PARTS if p in cfg.only] or list(PARTS)
    if cfg.device.type != "cuda" and cfg.dtype == torch.bfloat16:  # the interpreter's bf16
        cfg = dataclasses.replace(cfg, dtype=torch.float32, dtype_name="fp32")  # is not the GPU's
    rows: list[Result] = []
    for part in parts:
        rows += PARTS[part](cfg)
    return rows
