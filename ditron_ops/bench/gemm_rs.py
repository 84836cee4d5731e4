"""Bench ``gemm_rs``: deterministic cost, the batch-invariant GEMM vs cuBLAS, fused overhead.

Cases (one run, one GPU)::

    invariant   our batch-invariant GEMM (``matmul(deterministic=True)``: the deterministic
                path's core with the rule's tiles for the shape; fp32 products as the fused
                kernels make them) vs cuBLAS (bf16 out) for M in {1, 16, 64, 128, 1024, 8192}
                on the GEMM-RS local shapes [M, N/8] @ [N/8, K]; ``config`` names the tiles.
                ``invariant-fp32out`` (GPU): the same times against cuBLAS writing fp32 too
                (``torch.mm(out_dtype=)``), the part of the gap that is not the fp32 C bytes;
                ``det_cost``: its time over the default mode's ``matmul`` (bf16 out), paired;
                ``invariant-bf16out``: the batch-invariant GEMM writing the input dtype (what
                deterministic ``ag_gemm`` and ``matmul`` run) vs cuBLAS, paired in the same
                rounds (``--only invariant``: these rows alone)
    present     gemm_rs fused at W=1 (start barrier, count out, flags, reduction in the epilogue)
                vs our plain GEMM of the same shape: the fused path's own overhead

    det         deterministic (fused, rank ordered) vs default (impl=auto: all_gather-free
                baseline matmul + reduce_scatter / all_reduce) on the virtual world, W ranks
    ar          gemm_ar one-shot vs two-shot on the virtual world, M sweep with 256 and 512 added
                (the auto rule ``ONE_SHOT_MAX_BYTES``)
    producer    (``--only producer``: these rows alone) default-mode gemm_rs and gemm_ar
                (one-shot) fused with the WS producer vs the portable kernels
                (``_rs_launch.PRODUCER_CORE`` "ws" vs "tl"), W=1 and the virtual worlds, M in
                {2048, 8192}; ``vs_plain`` (W=1): the WS path over the plain ``matmul``

Every case times CUDA-graph replays, ours and the baseline in turns (``paired_graph_times``):
device time, since eager calls at small M, and all calls of a virtual world whose ranks are
threads of one process, are bound by Python and launch cost (the ``ag_gemm`` host row).
"""
from __future__ import annotations


import torch

from ..gemm.gemm_rs import gemm_ar, gemm_rs
from ..gemm._core import matmul, program_budget
from ..gemm._core_configs import select_split
from ..runtime.virtual import launch
from .harness import BenchConfig, Result, geo_mean_row, paired_graph_times, register
from .shapes import DEFAULT_M, DEFAULT_WORLD_SIZE, LAYER_CONFIGS

_MS = (1, 16, 64, 128, 1024, 8192)
"""M of the ``invariant`` rows: decode sizes (issue 20's targets at 1, 16 and 64) to prefill."""


def _shapes(quick: bool) -> dict[tuple[int, int], str]:
    """Distinct GEMM-RS local (K_r = N/8, N_out = K) pairs with their models."""
    out: dict[tuple[int, int], str] = {}
    for name, s in LAYER_CONFIGS.items():
        key = (s.n // DEFAULT_WORLD_SIZE, s.k)
        out[key] = f"{out[key]},{name}" if key in out else name
        if quick:
            break
    return out


def _inputs(m, k, n, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=device)
    return a, w.t()


def _single(group, cfg: BenchConfig, out: list[Result]) -> None:
    """The one-rank cases: the batch-invariant GEMM vs cuBLAS, then ``present``."""
    invariant(group, cfg, out)
    present(group, cfg, out)


def invariant(group, cfg: BenchConfig, out: list[Result]) -> None:
    """``invariant`` rows (module docstring), their geo-mean rows; ``--only invariant`` runs
    these alone."""
    inv, inv32, inv16 = [], [], []
    for (k, n), models in _shapes(cfg.quick).items():
        for m in ((8, 64) if cfg.quick else _MS):
            a, b = _inputs(m, k, n, cfg.dtype, group.device)
            f32 = torch.empty(m, n, dtype=torch.float32, device=group.device)
            fns = {"ours": lambda: matmul(a, b, out=f32, deterministic=True),
                   "cublas": lambda: a @ b,
                   "default": lambda: matmul(a, b, deterministic=False),
                   "ours16": lambda: matmul(a, b, deterministic=True)}
            if group.device.type == "cuda":  # (``mm.dtype`` has no CPU kernel)
                fns["cublas32"] = lambda: torch.mm(a, b, out_dtype=torch.float32)
            times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
            t_ours, t_cublas = times["ours"], times["cublas"]
            tiles, _ = select_split(m, n, k, program_budget(group.device, None), group.device,
                                    deterministic=True, out_bytes=4)
            fields = dict(shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=models,
                          extra={"config": tiles.name,
                                 "det_cost": round(t_ours / times["default"], 3)})
            r = Result("gemm_rs", f"invariant M={m}", 1, cfg.dtype_name, "batch-invariant GEMM (fp32 out)",
                       t_ours, "cuBLAS a @ b", t_cublas, **fields)
            inv.append(r)
            out.append(r)
            if "cublas32" in times:
                inv32.append(Result("gemm_rs", f"invariant-fp32out M={m}", 1, cfg.dtype_name,
                                    "batch-invariant GEMM (fp32 out)", t_ours,
                                    "cuBLAS mm(out_dtype=fp32)", times["cublas32"], **fields))
                out.append(inv32[-1])
            tiles16, _ = select_split(m, n, k, program_budget(group.device, None), group.device,
                                      deterministic=True, out_bytes=2)
            inv16.append(Result("gemm_rs", f"invariant-bf16out M={m}", 1, cfg.dtype_name,
                                f"batch-invariant GEMM ({cfg.dtype_name} out)", times["ours16"],
                                "cuBLAS a @ b", t_cublas,
                                **dict(fields, extra={"config": tiles16.name})))
            out.append(inv16[-1])
    out.append(geo_mean_row(inv, "invariant"))
    if inv32:
        out.append(geo_mean_row(inv32, "invariant-fp32out"))
    out.append(geo_mean_row(inv16, "invariant-bf16out"))


PRESENT_ROUNDS_FACTOR = 3
"""``present`` times ``cfg.rounds`` x this many passes: its overheads are 0.5-3% differences
between kernels of 0.15-2.5 ms, and with 10 passes one shape's median moved by up to 2 points
between runs of the same code (benchmarks/NOTES.md, gemm_rs / gemm_ar)."""


def present(group, cfg: BenchConfig, out: list[Result]) -> None:
    """``present``: gemm_rs fused at W=1 (deterministic) vs our plain GEMM, per shape, and the
    geo-mean row. A second graph of the same plain
    GEMM, timed in the same turns, gives the measurement's own noise (``noise_pct``)."""
    rows = []
    for (k, n), models in _shapes(cfg.quick).items():
        m = 64 if cfg.quick else DEFAULT_M
        a, b = _inputs(m, k, n, cfg.dtype, group.device)
        times = paired_graph_times(group, {
            "plain": lambda: matmul(a, b, deterministic=True),  # (the fused call's tiles)
            "fused": lambda: gemm_rs(a, b, group, deterministic=True, impl="fused"),
            "plain again": lambda: matmul(a, b, deterministic=True)},
            rounds=cfg.rounds * PRESENT_ROUNDS_FACTOR, target_ms=cfg.target_ms)
        t_plain, t_fused = times["plain"], times["fused"]
        r = Result("gemm_rs", "present W=1", 1, cfg.dtype_name, "gemm_rs fused", t_fused,
                   "our plain GEMM", t_plain, shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=models,
                   extra={"overhead_pct": round(100 * (t_fused / t_plain - 1), 2),
                          "noise_pct": round(100 * (times["plain again"] / t_plain - 1), 2)})
        rows.append(r)
        out.append(r)
    out.append(geo_mean_row(rows, "present W=1"))


def _on_core(core: str, fn):
    """``fn()`` with this thread's producer core ``core`` (``_rs_launch.using_producer_core``;
    part of the plan key: each setting keeps its own plan)."""
    from ..gemm import _rs_launch
    with _rs_launch.using_producer_core(core):
        return fn()


def producer(group, cfg: BenchConfig, out: list[Result]) -> None:
    """``producer`` rows of this rank's world (module docstring)."""
    rows = []
    w = group.world_size
    for (k, n), models in _shapes(cfg.quick).items():
        for m in ((64,) if cfg.quick else (2048, DEFAULT_M)):
            a, b = _inputs(m, k, n, cfg.dtype, group.device, seed=group.rank)
            for name, op in (("gemm_rs", gemm_rs), ("gemm_ar", gemm_ar)):
                kw = dict(impl="fused", deterministic=False)
                if name == "gemm_ar":
                    kw["algorithm"] = "one_shot"
                fns = {core: (lambda core=core: _on_core(core, lambda: op(a, b, group, **kw)))
                       for core in ("tl", "ws")}
                if w == 1:
                    fns["plain"] = lambda: matmul(a, b, deterministic=False)
                times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
                fns["ws"]()  # (its plan the most recent: did the WS core take the product?)
                plan = next(reversed(group.plans._plans.values()))
                extra = {"ws_chosen": getattr(plan, "ws_gemm", None) is not None}
                if w == 1:
                    extra["vs_plain"] = round(times["plain"] / times["ws"], 3)
                r = Result("gemm_rs", f"producer {name} M={m}", w, cfg.dtype_name,
                           f"{name} fused, WS producer", times["ws"],
                           f"{name} fused, portable", times["tl"], shape=f"{m}x{n}x{k}", m=m,
                           n=n, k=k, model=models, extra=extra)
                rows.append(r)
                if group.rank == 0:  # (a run cut short still shows its rows)
                    print(f"producer W={w} {name} {r.shape}: tl/ws {r.ratio:.3f} {extra}",
                          flush=True)
    if group.rank == 0:
        out.extend(rows)
        out.append(geo_mean_row(rows, f"producer W={w}"))


def _virtual(cfg: BenchConfig, out: list[Result], world: int) -> None:
    (k, n), models = next(iter(_shapes(True).items()))  # LLaMA-7B GEMM-RS: [M, 1376] @ [1376, 4096]

    def body(group):
        rows = []
        for m in ((64,) if cfg.quick else (128, 256, 512, 1024, 8192)):
            a, b = _inputs(m, k, n, cfg.dtype, group.device, seed=group.rank)
            for name, op in (("gemm_rs", gemm_rs), ("gemm_ar", gemm_ar)) if m not in (256, 512) else ():
                times = paired_graph_times(group, {
                    "det": lambda: op(a, b, group, deterministic=True),
                    "default": lambda: op(a, b, group)}, rounds=cfg.rounds, target_ms=cfg.target_ms)
                t_det, t_def = times["det"], times["default"]
                rows.append(Result("gemm_rs", f"det {name} M={m}", world, cfg.dtype_name,
                                   f"{name} deterministic", t_det, f"{name} default (baseline)", t_def,
                                   shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=models,
                                   extra={"det_cost": round(t_det / t_def, 3)}))
            times = paired_graph_times(group, {
                alg: (lambda alg=alg: gemm_ar(a, b, group, deterministic=True, algorithm=alg))
                for alg in ("one_shot", "two_shot")}, rounds=cfg.rounds, target_ms=cfg.target_ms)
            t1, t2 = times["one_shot"], times["two_shot"]
            rows.append(Result("gemm_rs", f"ar one-shot M={m}", world, cfg.dtype_name, "gemm_ar one_shot",
                               t1, "gemm_ar two_shot", t2, shape=f"{m}x{n}x{k}", m=m, n=n, k=k,
                               model=models, extra={"product_bytes": m * n * 4}))
        return rows

    out.extend(launch(body, world, cfg.device)[0])


@register("gemm_rs", help="gemm_rs/gemm_ar: batch-invariant GEMM vs cuBLAS, fused overhead, "
                          "deterministic cost, one- vs two-shot", world_sizes=(4,), quick_world_sizes=(2,))
def run(cfg: BenchConfig) -> list[Result]:
    if cfg.device.type != "cuda":
        raise SystemExit("ditron.bench gemm_rs: needs a CUDA GPU (TMA GEMM)")
    out: list[Result] = []
    if "producer" in cfg.only:
        for world in dict.fromkeys((1, ) + tuple(cfg.world_sizes)):
            launch(lambda g: producer(g, cfg, out), world, cfg.device)
        return out
    if "invariant" in cfg.only:
        launch(lambda g: invariant(g, cfg, out), 1, cfg.device)
        return out
    launch(lambda g: _single(g, cfg, out), 1, cfg.device)
    for world in cfg.world_sizes:
        _virtual(cfg, out, world)
    return out
