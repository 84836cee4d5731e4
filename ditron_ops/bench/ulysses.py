"""Bench ``ulysses``: the local flash-attention forward vs SDPA, and the fused op vs the unfused
compositions, on a virtual world (W ranks on one GPU). Every time is a paired CUDA-graph replay.

``local`` rows (one rank, the whole GPU), for each W of ``--world-sizes`` read as the heads a
rank keeps after the split, ``Hq / W`` query and ``Hkv / W`` KV heads of 32/8, B = 1,
S in {8k, 32k} (the whole sequence), D = 128, causal and not::

    ours       local_attention(q, k, v) with each tile configuration of ``GPU_CONFIGS``
    baseline   scaled_dot_product_attention(q, k, v, enable_gqa=True), flash backend
    TFLOP/s    4 B Hq S^2 D (half of it causal) / time; target >= 0.90x SDPA

``fused`` rows (W > 1 virtual ranks), the op on q ``[1, S/W, 32, 128]``, k, v ``[1, S/W, 8,
128]`` (sequence chunks)::

    ours       ulysses_attention(q, k, v)
    unfused    ditron all_to_all (heads out) x3 -> SDPA flash -> all_to_all back
    torch      DeepSpeed-Ulysses style: permute (rearrange + contiguous) -> all_to_all_single
               -> permute, for q, k and v -> SDPA flash -> permute -> all_to_all_single ->
               permute (all_to_all_single is ditron's, dims 0/0, in a virtual world; NCCL's
               under torchrun)
    target     unfused / ours >= 1.0 (stretch 1.15)

``--quick`` runs tiny shapes, causal only (fp32 in the interpreter on CPU, where bf16 arithmetic
is wrong).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from ..attention import ulysses as api
from ..collectives import all_to_all
from ..runtime.virtual import launch
from .harness import BenchConfig, Result, paired_graph_times, register

HEADS = (32, 8)
HEAD_DIM = 128
SEQS = (8192, 32768)
QUICK = dict(heads=(4, 2), head_dim=64, seqs=(32,))


def _shapes(cfg: BenchConfig) -> tuple:
    if cfg.quick:
        return QUICK["heads"], QUICK["head_dim"], QUICK["seqs"]
    return HEADS, HEAD_DIM, SEQS


def _causal(cfg: BenchConfig) -> tuple[bool, ...]:
    return (True,) if cfg.quick else (False, True)


def _dtype(cfg: BenchConfig) -> tuple[torch.dtype, str]:
    if cfg.device.type != "cuda" and cfg.dtype == torch.bfloat16:
        return torch.float32, "fp32"
    return cfg.dtype, cfg.dtype_name


def flash_sdpa(q, k, v, causal: bool, scale: float):
    """SDPA pinned to the flash backend on the GPU (any backend in the interpreter's world)."""
    ctx = contextlib.nullcontext()
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


def _tflops(b: int, hq: int, s: int, d: int, causal: bool, us: float) -> float:
    flops = 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)
    return flops / (us * 1e-6) / 1e12


def _local_rows(group, cfg: BenchConfig, world: int) -> list[Result]:
    """``local`` rows for the heads of one rank of a ``world``-way split."""
    (hq, hkv), d, seqs = _shapes(cfg)
    hq, hkv = hq // world, max(1, hkv // world)
    dtype, dtype_name = _dtype(cfg)
    configs = list(api.GPU_CONFIGS) if cfg.device.type == "cuda" else [None]
    rows = []
    for s in seqs:
        gen = torch.Generator(device="cpu").manual_seed(s)
        q, k, v = (torch.randn(1, h, s, d, generator=gen).to(dtype=dtype, device=group.device)
                   for h in (hq, hkv, hkv))
        scale = d ** -0.5
        for causal in _causal(cfg):
            fns = {"sdpa": lambda c=causal: flash_sdpa(q, k, v, c, scale)}
            for name in configs:
                fns[name] = (lambda c=causal, n=name: api.local_attention(
                    q, k, v, causal=c, softmax_scale=scale, config=n))
            want = fns["sdpa"]().float()
            errs = {name: (fns[name]().float() - want).abs().max().item() for name in configs}
            times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
            base = times["sdpa"]
            for name in configs:
                label = name or "interpreter"
                rows.append(Result(
                    "ulysses", f"local S={s} {'causal' if causal else 'full'}", world, dtype_name,
                    f"local {label}" + (" (default)" if name == api.GPU_CONFIG else ""),
                    times[name], "SDPA flash", base, shape=f"1x{hq}/{hkv}x{s}x{d}", m=s, n=s, k=d,
                    extra={"TFLOPs": round(_tflops(1, hq, s, d, causal, times[name]), 1),
                           "base_TFLOPs": round(_tflops(1, hq, s, d, causal, base), 1),
                           "max_abs_err": errs[name]}))
    return rows


def all_to_all_single(x: torch.Tensor, group) -> torch.Tensor:
    """``x [W, ...]``: block d to rank d, blocks received stacked in rank order (NCCL's
    ``all_to_all_single`` on process groups, ditron's exchange in a virtual world)."""
    if getattr(group, "pg", None) is not None:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group.pg)
        return out
    return all_to_all(x, 0, 0, group)


def torch_style(q, k, v, group, causal: bool, scale: float) -> torch.Tensor:
    """DeepSpeed-Ulysses / yunchang: a permute around every all_to_all_single, q, k and v apart."""
    w = group.world_size

    def to_heads(x):  # [B, S_r, H, D] -> [B, H / W, S, D]
        send = rearrange(x, "b s (w h) d -> w b s h d", w=w).contiguous()
        return rearrange(all_to_all_single(send, group), "w b s h d -> b h (w s) d").contiguous()

    o = flash_sdpa(to_heads(q), to_heads(api.kv_for_ranks(k, w)),
                   to_heads(api.kv_for_ranks(v, w)), causal, scale)
    send = rearrange(o, "b h (w s) d -> w b s h d", w=w).contiguous()
    return rearrange(all_to_all_single(send, group), "w b s h d -> b s (w h) d").contiguous()


def _fused_rows(group, cfg: BenchConfig) -> list[Result]:
    """``fused`` rows on this virtual world (every rank runs it; rank 0's rows count)."""
    (hq, hkv), d, seqs = _shapes(cfg)
    w = group.world_size
    dtype, dtype_name = _dtype(cfg)
    rows = []
    for s in seqs:
        gen = torch.Generator(device="cpu").manual_seed(s + group.rank)
        q, k, v = (torch.randn(1, s // w, h, d, generator=gen).to(dtype=dtype, device=group.device)
                   for h in (hq, hkv, hkv))
        scale = d ** -0.5
        for causal in _causal(cfg):
            fns = {
                "fused": lambda c=causal: api.ulysses_attention(q, k, v, group, causal=c,
                                                                softmax_scale=scale),
                "unfused": lambda c=causal: api.unfused_attention(q, k, v, group, c, scale,
                                                                  attend=flash_sdpa),
                "torch": lambda c=causal: torch_style(q, k, v, group, c, scale),
            }
            err = (fns["fused"]().float() - fns["unfused"]().float()).abs().max()
            err = max(group.all_gather_object(err.item()))
            times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
            case = f"fused S={s} {'causal' if causal else 'full'}"
            for base, label in (("unfused", "ditron all_to_all + SDPA flash"),
                                ("torch", "permute + all_to_all_single + SDPA flash")):
                rows.append(Result(
                    "ulysses", case, w, dtype_name, f"ulysses_attention vs {base}",
                    times["fused"], label, times[base], shape=f"1x{s}x{hq}/{hkv}x{d}", m=s, n=s,
                    k=d, extra={"TFLOPs": round(_tflops(1, hq, s, d, causal, times["fused"]), 1),
                                "base_TFLOPs": round(_tflops(1, hq, s, d, causal, times[base]), 1),
                                "max_abs_err": err}))
    return rows if group.rank == 0 else []


@register("ulysses", help="ulysses_attention (fused) vs all_to_all + SDPA compositions on a "
                          "virtual world; local flash-attention forward vs SDPA flash (TFLOP/s)",
          world_sizes=(1, 2, 4, 8), quick_world_sizes=(1, 2))
def run(cfg: BenchConfig) -> list[Result]:
    """``local`` rows for every W of ``cfg`` (heads of a W-way split, on one rank), then
    ``fused`` rows for every W > 1 (a virtual world of W ranks)."""
    rows: list[Result] = []
    for world in cfg.world_sizes:
        rows += launch(lambda g, world=world: _local_rows(g, cfg, world), 1, cfg.device)[0]
    for world in cfg.world_sizes:
        if world > 1:
            rows += launch(lambda g: _fused_rows(g, cfg), world, cfg.device)[0]
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows
