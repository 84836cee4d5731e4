"""Bench the paged ``flash_decode`` (serving decode): paged vs contiguous caches, and SDPA.

For page sizes {16, 64, 256}, B in {1, 16, 64}, KV in {8k, 32k, 128k} keys per sequence in total
over the W virtual ranks (each rank holds KV / W of them), Hq/Hkv = 32/8, D = 128::

    paged        flash_decode(q, k_pages, v_pages, lens, block_table=table) on every rank: the
                 rank's keys in pages shuffled over the cache (a serving cache is fragmented)
    contiguous   flash_decode(q, k, v, lens) over the same keys, [B, KV / W, Hkv, D] per rank
    sdpa         torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) on one GPU
                 over the whole sequence made contiguous ([B, KV, Hkv, D]), measured once per
                 (B, KV) in a one-rank world (random keys of those shapes: time does not depend
                 on the values)

Rows: ``impl`` = the paged call (both modes, ``det=``), ``baseline`` = the contiguous call in the
same mode (the design target is ratio >= 0.95 from page 16 up), extra columns ``sdpa_us`` and
``vs_sdpa`` (SDPA's time over the paged call's). Times: CUDA-graph replays, paged and contiguous
in turns (``paired_graph_times``), the max over the W ranks that share the one GPU (a virtual
world: the ranks' split-KV and merge kernels run concurrently, as W GPUs' would not; the figure
is the whole step's device time on one GPU). Cases whose one form of the cache exceeds
``MAX_CACHE_BYTES`` are left out (the bench holds two forms at once).

Not registered here: ``python -m ditron_ops.bench serving`` combines ``paged_rows`` with the
other serving benches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.flash_decode import flash_decode
from ..runtime.virtual import launch
from ..testing.checks import paged_cache
from .harness import BenchConfig, Result, graph_time_spmd, paired_graph_times

BENCH = "serving"
PAGES = (16, 64, 256)
BATCHES = (1, 16, 64)
KV_TOTALS = (8192, 32768, 131072)
HEADS = (32, 8, 128)
"""Hq, Hkv, D (Llama-3 8B/70B-style GQA)."""
MAX_CACHE_BYTES = 24 << 30
"""K + V of one form of the cache (keeps paged + contiguous + SDPA's copy within an H100)."""


def cases(cfg: BenchConfig) -> list[tuple[int, int, int]]:
    """``(B, KV total, page)`` of the run (quick: one tiny case)."""
    if cfg.quick:
        return [(1, 256, 16)]
    hkv, d = HEADS[1], HEADS[2]
    return [(b, kv, page) for b in BATCHES for kv in KV_TOTALS for page in PAGES
            if 2 * b * kv * hkv * d * 2 <= MAX_CACHE_BYTES]


def _sdpa_time(group, cfg: BenchConfig, b: int, kv: int) -> float:
    """µs of SDPA over the whole sequence of ``kv`` keys on one GPU (its tensors are freed on
    return, before the next case allocates)."""
    hq, hkv, d = HEADS
    q = torch.randn(b, hq, 1, d, dtype=cfg.dtype, device=group.device)
    k = torch.randn(b, kv, hkv, d, dtype=cfg.dtype, device=group.device)
    v = torch.randn_like(k)
    ks, vs = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D]
    return graph_time_spmd(group, lambda: F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True),
                           rounds=cfg.rounds, target_ms=cfg.target_ms)


def _sdpa_times(group, cfg: BenchConfig, shapes) -> dict:
    """``{(B, KV): µs}`` of SDPA (a one-rank world)."""
    return {(b, kv): _sdpa_time(group, cfg, b, kv) for b, kv in shapes}


def _rank_body(group, cfg: BenchConfig, run_cases, sdpa: dict) -> list[Result]:
    return [row for b, kv, page in run_cases for row in _case(group, cfg, b, kv, page, sdpa)]


def _case(group, cfg: BenchConfig, b: int, kv: int, page: int, sdpa: dict) -> list[Result]:
    """One case's rows (its caches are freed on return)."""
    hq, hkv, d = HEADS
    w, dev = group.world_size, group.device
    rows = []
    local = kv // w
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, d, generator=gen).to(dtype=cfg.dtype, device=dev)
    k = torch.randn(b, local, hkv, d, dtype=cfg.dtype, device=dev)
    v = torch.randn_like(k)
    lens = torch.full((b,), local, dtype=torch.int32, device=dev)
    kp, vp, table = paged_cache(k, v, page, torch.Generator().manual_seed(1 + group.rank))
    fns = {}
    for det in (False, True):
        fns[("paged", det)] = (lambda det=det: flash_decode(q, kp, vp, lens, group,
                                                             deterministic=det, block_table=table))
        fns[("contiguous", det)] = (lambda det=det: flash_decode(q, k, v, lens, group,
                                                                 deterministic=det))
    times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
    nbytes = 2 * b * kv * hkv * d * k.element_size()  # K and V of every rank, read once
    t_sdpa = sdpa.get((b, kv), float("nan"))
    for det in (False, True):
        t, base = times[("paged", det)], times[("contiguous", det)]
        rows.append(Result(BENCH, f"paged P={page} B={b} KV={kv}", w, cfg.dtype_name,
                           f"flash_decode paged det={det}", t, "flash_decode contiguous", base,
                           shape=f"{b}x{kv}x{hq}/{hkv}x{d}", m=b, n=kv, k=d, nbytes=nbytes,
                           extra={"page": page, "GB_s": round(nbytes / t / 1e3, 1),
                                  "sdpa_us": round(t_sdpa, 2),
                                  "vs_sdpa": round(t_sdpa / t, 3),
                                  "contiguous_vs_sdpa": round(t_sdpa / base, 3)}))
    return rows


def paged_rows(cfg: BenchConfig) -> list[Result]:
    """Every case on every world size of ``cfg`` (W = 1 included if asked): rank 0's rows."""
    run_cases = cases(cfg)
    shapes = list(dict.fromkeys((b, kv) for b, kv, _ in run_cases))
    sdpa = launch(lambda g: _sdpa_times(g, cfg, shapes), 1, cfg.device)[0]
    rows: list[Result] = []
    for world in cfg.world_sizes:
        rows += launch(_rank_body, world, cfg.device, args=(cfg, run_cases, sdpa))[0]
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
