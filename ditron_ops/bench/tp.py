"""Multi-GPU benches (one process per GPU under ``torchrun``; issue: multi-GPU validation).

    torchrun --nproc-per-node 8 -m ditron_ops.bench tp            # ours, nvshmem backend
    torchrun --nproc-per-node 8 -m ditron_ops.bench tp_symm_mem   # PyTorch's fused ops

Cases, per model layer at M = 8192 tokens and an M sweep (LLaMA-3.1-8B), tensor-parallel over
the W processes (``shapes`` docstring)::

    ag_gemm   A[M/W, K] -> A[M, K] @ B[K, N/W]      gemm_rs   A[M, N/W] @ B[N/W, K] -> C[M/W, K]
    gemm_ar   A[M, N/W] @ B[N/W, K] -> C[M, K] (all-reduced)

``tp`` times ours (``impl="fused"`` and ``impl="auto"``) against the sequential baseline run in
the same process: the NCCL collective (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``all_reduce``), then cuBLAS. It also times the GEMM alone and the collective alone, for the
overlap efficiency ``(T_gemm + T_comm - T_fused) / min(T_gemm, T_comm)``, and flash_decode at
B in {1, 64} with 128k keys per rank (scaling: compare the CSVs of runs at different W).
``--only`` (comma list of ag_gemm, gemm_rs, gemm_ar, flash_decode) narrows a run, e.g.
to flash_decode for the one-GPU point of its scaling. ``tp_symm_mem`` times
``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` against the
same baseline, in a process without NVSHMEM (PyTorch and nvshmem4py must not both initialise
it). NVLink multicast is off (``NO_MULTICAST``). Every time is device time from CUDA-graph
replays measured in turns (``--timing eager`` times eager calls instead).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..gemm.ag_gemm import ag_gemm
from ..attention.flash_decode import flash_decode
from ..gemm.gemm_rs import gemm_ar, gemm_rs
from ..runtime.torchrun import started_by_torchrun, torchrun_group
from .harness import BenchConfig, Result, paired_graph_times, register, time_spmd
from .shapes import DEFAULT_M, LAYER_CONFIGS, get_model

_SWEEP_MODEL, _SWEEP_M = "LLaMA-3.1-8B", (128, 512, 2048)


def _cases(cfg: BenchConfig, world: int) -> list[tuple[str, int, int, int]]:
    """``(model, M, N/W, K)``: every distinct model layer at M=8192, then the M sweep."""
    if cfg.quick:
        return [("tiny", 8 * world, 16, 32)]
    layers = {(s.n, s.k): name for name, s in reversed(LAYER_CONFIGS.items())}
    out = [(name, DEFAULT_M, n // world, k) for (n, k), name in reversed(layers.items())]
    s = get_model(_SWEEP_MODEL)
    return out + [(s.name, m, s.n // world, s.k) for m in _SWEEP_M]


def _randn(*shape, cfg: BenchConfig, device, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.25).to(dtype=cfg.dtype, device=device)


def _problems(group, cfg: BenchConfig, m: int, n: int, k: int) -> dict:
    """Per op: ``((a, b), collective alone, GEMM alone, the sequential baseline)``: NCCL and
    cuBLAS, the GEMM after the all-gather or before the reduction."""
    w, dev = group.world_size, group.device
    a_ag = _randn(m // w, k, cfg=cfg, device=dev, seed=group.rank)
    b_ag = _randn(n, k, cfg=cfg, device=dev, seed=100 + group.rank).t()  # a Linear weight, no copy
    gathered = a_ag.new_empty((m, k))
    a_rs = _randn(m, n, cfg=cfg, device=dev, seed=200 + group.rank)
    b_rs = _randn(k, n, cfg=cfg, device=dev, seed=300 + group.rank).t()
    prod, shard = a_rs.new_empty((m, k)), a_rs.new_empty((m // w, k))
    gather = lambda: dist.all_gather_into_tensor(gathered, a_ag)  # noqa: E731
    gemm_ag = lambda: torch.matmul(gathered, b_ag)  # noqa: E731
    gemm_rs_ = lambda: torch.matmul(a_rs, b_rs, out=prod)  # noqa: E731
    scatter = lambda: dist.reduce_scatter_tensor(shard, prod)  # noqa: E731
    reduce = lambda: dist.all_reduce(prod)  # noqa: E731
    return {
        "ag_gemm": ((a_ag, b_ag), gather, gemm_ag, lambda: (gather(), gemm_ag())),
        "gemm_rs": ((a_rs, b_rs), scatter, gemm_rs_, lambda: (gemm_rs_(), scatter())),
        "gemm_ar": ((a_rs, b_rs), reduce, gemm_rs_, lambda: (gemm_rs_(), reduce())),
    }


def _timing(cfg: BenchConfig) -> str:
    """``"graph"`` on a GPU unless ``--timing eager``, else ``"eager"``."""
    return "graph" if cfg.device.type == "cuda" and cfg.timing == "graph" else "eager"


def _measure(group, cfg: BenchConfig, fns: dict[str, Callable]) -> dict[str, float]:
    """Device µs per call of each function: CUDA-graph replays timed in turns
    (``paired_graph_times``), or eager calls (``time_spmd``; see ``_timing``)."""
    if _timing(cfg) == "graph":
        return paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
    return {name: time_spmd(group, fn, rounds=cfg.rounds, target_ms=cfg.target_ms)
            for name, fn in fns.items()}


def _gemm_rows(group, cfg: BenchConfig, bench: str, ours: dict[str, Callable],
               label: str) -> list[Result]:
    """One row per (op, case): ``ours[op](a, b, impl)`` vs the sequential NCCL + cuBLAS pair,
    all timed in one paired block (plus the GEMM alone and the collective alone).

    Extras: ``overlap_eff = (T_gemm + T_comm - T_fused) / min(T_gemm, T_comm)`` and ``bound =
    (T_gemm + T_comm) / max(T_gemm, T_comm)``, the most any overlap can gain over the sequential
    pair (perfect overlap, GEMM as fast as cuBLAS)."""
    rows = []
    timing = _timing(cfg)
    for model, m, n, k in _cases(cfg, group.world_size):
        for op, ((a, b), comm, gemm, seq) in _problems(group, cfg, m, n, k).items():
            if op not in ours:
                continue
            fns = {"comm": comm, "gemm": gemm, "seq": seq,
                   "fused": lambda: ours[op](a, b, "fused")}
            if label == "ours":
                fns["auto"] = lambda: ours[op](a, b, "auto")
            t = _measure(group, cfg, fns)
            t_comm, t_gemm = t["comm"], t["gemm"]
            extra = {"gemm_us": round(t_gemm, 1), "comm_us": round(t_comm, 1),
                     "overlap_eff": round((t_gemm + t_comm - t["fused"]) / min(t_gemm, t_comm), 3),
                     "bound": round((t_gemm + t_comm) / max(t_gemm, t_comm), 3), "timing": timing}
            if "auto" in t:
                extra.update(auto_us=round(t["auto"], 1), auto_ratio=round(t["seq"] / t["auto"], 3))
            rows.append(Result(bench, f"{op} {model} M={m}", group.world_size, cfg.dtype_name,
                               f"{op} {label}", t["fused"], "NCCL + cuBLAS (sequential)", t["seq"],
                               shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=model, extra=extra))
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()  # the graphs' pools: the largest cases need the room
    return rows


def _flash_decode_rows(group, cfg: BenchConfig, bench: str) -> list[Result]:
    """flash_decode with 128k keys per rank at B in {1, 64} vs SDPA over the local shard alone."""
    rows = []
    kv, hq, hkv, d = (256, 8, 2, 64) if cfg.quick else (131072, 32, 8, 128)
    dtype = cfg.dtype if group.device.type == "cuda" else torch.float32
    for b in ((1,) if cfg.quick else (1, 64)):
        q = torch.randn(b, hq, d, dtype=dtype, device=group.device)
        k = torch.randn(b, kv, hkv, d, dtype=dtype, device=group.device)
        v = torch.randn_like(k)
        lens = torch.full((b,), kv, dtype=torch.int32, device=group.device)
        qs, ks, vs = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
        times = _measure(group, cfg, {
            "ours": lambda: flash_decode(q, k, v, lens, group),
            "local": lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs,
                                                                             enable_gqa=True)})
        t, t_local = times["ours"], times["local"]
        rows.append(Result(bench, f"flash_decode B={b} KV/rank={kv}", group.world_size,
                           cfg.dtype_name, "flash_decode", t, "SDPA on the local shard", t_local,
                           shape=f"{b}x{kv}x{hq}/{hkv}x{d}", m=b, n=kv, k=d,
                           extra={"kv_total": kv * group.world_size}))
    return rows


def _require_torchrun(name: str) -> None:
    if not started_by_torchrun():
        raise SystemExit(f"ditron.bench {name}: run it under torchrun, one process per GPU: "
                         f"torchrun --nproc-per-node N -m ditron_ops.bench {name}")


@register("tp", help="multi-GPU (torchrun): ag_gemm/gemm_rs/gemm_ar vs NCCL + cuBLAS, overlap, "
                     "flash_decode", world_sizes=(0,), quick_world_sizes=(0,))
def run(cfg: BenchConfig) -> list[Result]:
    _require_torchrun("tp")
    with torchrun_group() as group:
        ours = {"ag_gemm": lambda a, b, impl: ag_gemm(a, b, group, impl=impl),
                "gemm_rs": lambda a, b, impl: gemm_rs(a, b, group, impl=impl),
                "gemm_ar": lambda a, b, impl: gemm_ar(a, b, group, impl=impl)}
        only = cfg.only
        ours = {op: fn for op, fn in ours.items() if not only or op in only}
        rows = _gemm_rows(group, cfg, "tp", ours, "ours") if ours else []
        if not only or "flash_decode" in only:
            rows += _flash_decode_rows(group, cfg, "tp")
        return rows


@register("tp_symm_mem", help="multi-GPU (torchrun): PyTorch symm_mem fused ag/rs matmuls vs "
                              "NCCL + cuBLAS", world_sizes=(0,), quick_world_sizes=(0,))
def run_symm_mem(cfg: BenchConfig) -> list[Result]:
    _require_torchrun("tp_symm_mem")
    if not torch.cuda.is_available():
        raise SystemExit("ditron.bench tp_symm_mem: needs CUDA GPUs (PyTorch symmetric memory)")
    from torch.distributed import _symmetric_memory as symm_mem

    with torchrun_group(backend="torch") as group:
        name = dist.group.WORLD.group_name
        symm_mem.enable_symm_mem_for_group(name)
        ours = {"ag_gemm": lambda a, b, impl: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, name),
                "gemm_rs": lambda a, b, impl: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b, "sum", 0, name)}
        return _gemm_rows(group, cfg, "tp_symm_mem", ours, "torch symm_mem")
