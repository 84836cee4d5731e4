"""Serving bench, norm part: ``all_reduce_rmsnorm`` vs the composition it replaces.

For T in {1, 8, 32, 128, 512, 2048} tokens, H in {4096, 8192}, on virtual worlds (W ranks on one
GPU, default W in {2, 4, 8})::

    fused        all_reduce_rmsnorm(x, residual, weight, quant=...)            one launch
    composition  h = all_reduce(x)          (ours: rank-ordered, one/two-shot by size)
                 r = h + residual           (torch)
                 normed = F.rms_norm(r, (H,), weight, eps)
                 [amax = |normed|.amax(-1); scale = amax / 448;
                  codes = (normed / scale).clamp(±448).to(float8_e4m3fn)]   (torch fp8)

Rows per (W, T, H), all timed from CUDA-graph replays measured in turns
(``harness.paired_graph_times``; a decode step runs in a graph, so this is device time):

    impl "fused fp8"       baseline "composition fp8"       (per-token e4m3, default mode)
    impl "fused fp8 det"   baseline "composition fp8 det"   (deterministic=True both)
    impl "fused"           baseline "composition"           (no quantization)

``ratio`` is baseline / ours (above 1: fused is faster; the design targets are fused at most
0.7x the composition's time, i.e. ratio >= 1.43, at T <= 128 and never slower above). Extras:
``algorithm`` (what auto picked), ``one_shot_us`` / ``two_shot_us`` (fused fp8 forced to each
form: where the auto rule's crossover ``ONE_SHOT_MAX_BYTES`` should sit), ``det_cost`` (fused
deterministic / fused default time; target <= 1.1), ``max_err`` (fused normed vs the
composition's, a sanity check: the tests check the rounding contract).

Not registered as a bench of its own: ``python -m ditron_ops.bench serving`` runs ``run`` next
to the serving bench's other parts. On CPU (``--quick``) it runs tiny sizes in the interpreter,
in fp32 when bf16 is asked for (the interpreter rounds bf16 differently).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..collectives import all_reduce, all_reduce_rmsnorm
from ..collectives.all_reduce_rmsnorm import choose_algorithm
from .harness import BenchConfig, Result, paired_graph_times, rows_over_worlds

BENCH = "serving"
TOKENS = (1, 8, 32, 128, 512, 2048)
HIDDEN = (4096, 8192)
WORLD_SIZES = (2, 4, 8)
QUICK_TOKENS, QUICK_HIDDEN = (1, 5), (256,)
EPS = 1e-6
FP8_MAX = 448.0


def composition(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                quant: bool, deterministic: bool) -> tuple:
    """The unfused step: our all_reduce, torch add, ``F.rms_norm``, torch per-token e4m3."""
    h = all_reduce(x, deterministic=deterministic)
    r = h + residual
    normed = F.rms_norm(r, (x.shape[1],), weight, eps)
    if not quant:
        return normed, r
    scale = normed.float().abs().amax(-1, keepdim=True) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (normed.float() / safe).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return normed, r, codes, scale


def _dtype(cfg: BenchConfig) -> tuple[torch.dtype, str]:
    if cfg.device.type != "cuda" and cfg.dtype == torch.bfloat16:
        return torch.float32, "fp32"  # the interpreter's bf16 rounding is not the GPU's
    return cfg.dtype, cfg.dtype_name


def _rank_body(group, cfg: BenchConfig) -> list[Result]:
    """SPMD body: every (T, H), the six timed functions in turns; rank 0 returns the rows."""
    dtype, dtype_name = _dtype(cfg)
    tokens, hidden = (QUICK_TOKENS, QUICK_HIDDEN) if cfg.quick else (TOKENS, HIDDEN)
    w = group.world_size
    rows: list[Result] = []
    for h in hidden:
        gen = torch.Generator().manual_seed(7)
        weight = (torch.randn(h, generator=gen) * 0.1 + 1).to(group.device, dtype)
        for t in tokens:
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(100 + group.rank))
            x = x.to(group.device, dtype)
            residual = torch.randn(t, h, generator=gen).to(group.device, dtype)

            def fused(quant="fp8_e4m3", det=False, algorithm="auto"):
                return lambda: all_reduce_rmsnorm(x, residual, weight, EPS, quant=quant,
                                                  deterministic=det, algorithm=algorithm)

            def composed(quant=True, det=False):
                return lambda: composition(x, residual, weight, EPS, quant, det)

            fns = {"fused fp8": fused(), "fused fp8 det": fused(det=True),
                   "composition fp8": composed(), "composition fp8 det": composed(det=True),
                   "fused": fused(quant=None), "composition": composed(quant=False),
                   "one_shot": fused(algorithm="one_shot"), "two_shot": fused(algorithm="two_shot")}
            got, want = fns["fused fp8"](), fns["composition fp8"]()
            err = (got[0].float() - want[0].float()).abs().max().item()
            times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
            err = max(group.all_gather_object(err))
            if group.rank != 0:
                continue
            algorithm = choose_algorithm(x.numel() * x.element_size(), w)
            nbytes = x.numel() * x.element_size()
            for impl, base in (("fused fp8", "composition fp8"),
                               ("fused fp8 det", "composition fp8 det"), ("fused", "composition")):
                rows.append(Result(
                    bench=BENCH, case=f"norm T={t} H={h}", world_size=w, dtype=dtype_name,
                    impl=impl, time_us=times[impl], baseline=base, baseline_us=times[base],
                    shape=f"{t}x{h}", m=t, k=h, nbytes=nbytes,
                    extra={"algorithm": algorithm, "one_shot_us": times["one_shot"],
                           "two_shot_us": times["two_shot"],
                           "det_cost": times["fused fp8 det"] / times["fused fp8"],
                           "max_err": err}))
    return rows


def run(cfg: BenchConfig) -> list[Result]:
    """Every (W, T, H) of ``cfg`` (``cfg.world_sizes``; ``WORLD_SIZES`` is the intended set);
    the rows of rank 0 (see the module docstring)."""
    return rows_over_worlds(cfg, _rank_body, cfg)
