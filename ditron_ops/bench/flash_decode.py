"""Bench ``flash_decode``: the local split-KV decode (W=1) vs SDPA and the copy bandwidth.

For B in {1, 8, 64}, KV in {4k, 32k, 128k}, Hq/Hkv in {32/8, 64/8}, D = 128 (one rank, so the
merge sees one partial per head)::

    ours       flash_decode(q, k, v, lens, deterministic=...) on a one-rank virtual world
    baseline   torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    hbm        achieved bytes (K and V read once) / time, and as a fraction of the measured
               device-to-device copy bandwidth (a ``copy_`` of 1 GiB)

Both are timed replaying CUDA graphs (decode loops run in graphs: device time only; SDPA and both
modes in turns, ``paired_graph_times``) and eagerly
(``eager_*`` columns: includes Python and launch overhead, which dominates small problems).
Rows for deterministic=True and False give the deterministic cost.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.flash_decode import flash_decode
from ..runtime.virtual import launch
from .harness import BenchConfig, Result, paired_graph_times, register, time_spmd


def _copy_bandwidth(group, cfg: BenchConfig) -> float:
    n = (1 << 20) if cfg.quick else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=group.device)
    dst = torch.empty_like(src)
    t = time_spmd(group, lambda: dst.copy_(src), rounds=cfg.rounds, target_ms=cfg.target_ms)
    return 2 * n / t / 1e3  # GB/s (read + write)


def _run(group, cfg: BenchConfig) -> list[Result]:
    rows = []
    copy_gbs = _copy_bandwidth(group, cfg)
    cases = [(1, 256, 32, 8)] if cfg.quick else [
        (b, kv, hq, 8) for b in (1, 8, 64) for kv in (4096, 32768, 131072) for hq in (32, 64)]
    d = 128
    for b, kv, hq, hkv in cases:
        if b * kv * hkv * d * 2 * 2 > 40 << 30:  # keep K+V under 40 GiB
            continue
        q = torch.randn(b, hq, d, dtype=cfg.dtype, device=group.device)
        k = torch.randn(b, kv, hkv, d, dtype=cfg.dtype, device=group.device)
        v = torch.randn_like(k)
        lens = torch.full((b,), kv, dtype=torch.int32, device=group.device)
        qs, ks, vs = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)  # SDPA: [B, H, S, D]
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)  # noqa: E731
        ours = {det: (lambda det=det: flash_decode(q, k, v, lens, group, deterministic=det))
                for det in (True, False)}
        graph = paired_graph_times(group, {"sdpa": sdpa, True: ours[True], False: ours[False]},
                                   rounds=cfg.rounds, target_ms=cfg.target_ms)
        t_sdpa = graph["sdpa"]
        e_sdpa = time_spmd(group, sdpa, rounds=cfg.rounds, target_ms=cfg.target_ms)
        nbytes = 2 * k.numel() * k.element_size()
        for det in (True, False):
            t = graph[det]
            e = time_spmd(group, ours[det], rounds=cfg.rounds, target_ms=cfg.target_ms)
            gbs = nbytes / t / 1e3
            rows.append(Result("flash_decode", f"B={b} KV={kv} {hq}/{hkv}", 1, cfg.dtype_name,
                               f"flash_decode det={det}", t, "SDPA enable_gqa", t_sdpa,
                               shape=f"{b}x{kv}x{hq}/{hkv}x{d}", m=b, n=kv, k=d, nbytes=nbytes,
                               extra={"GB_s": round(gbs, 1), "frac_copy_bw": round(gbs / copy_gbs, 3),
                                      "copy_GB_s": round(copy_gbs, 1), "eager_us": round(e, 1),
                                      "eager_base_us": round(e_sdpa, 1),
                                      "eager_ratio": round(e_sdpa / e, 3)}))
    return rows


@register("flash_decode", help="flash_decode split-KV (W=1) vs SDPA, HBM bandwidth, deterministic cost",
          world_sizes=(1,), quick_world_sizes=(1,))
def run(cfg: BenchConfig) -> list[Result]:
    return launch(lambda g: _run(g, cfg), 1, cfg.device)[0]
