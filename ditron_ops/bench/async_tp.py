"""``python -m ditron_ops.bench async_tp``: a compiled tensor-parallel block with and without the
``ditron_ops.compile`` pass.

The block is written with functional collectives (what DTensor's sequence parallelism emits):
``all_gather -> mm (w1) -> gelu -> mm (w2) -> reduce_scatter``, LLaMA-3.1-8B-like widths split
over W ranks. Both variants are ``torch.compile``'d with inductor; the time is per call (max over
ranks), and ``extra`` holds the number of collectives the pass rewrote.

Where it runs: under ``torchrun`` (one process per GPU: W = the job's size, nvshmem when
nvshmem4py imports), or alone as W = 1 (a one-rank process group, nvshmem at one PE when
available). Virtual worlds (W ranks as threads of one process) have no torch process group, so
the pass cannot map their functional collectives: ``--world-sizes`` is ignored. At W = 1 nothing
is communicated: the row shows the rewrite's host and GEMM-path cost, not an overlap gain; the
gain needs W > 1 GPUs.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from .harness import BenchConfig, Result, register

SHAPES = ((2048, 4096, 14336), (8192, 4096, 14336))
"""(tokens M, hidden K, FFN width N) before the split over ranks (LLaMA-3.1-8B MLP)."""
QUICK = ((64, 64, 128),)


def _group(device: torch.device):
    """This process's ditron group and process group (made here when none exists)."""
    import torch.distributed as dist

    from ..runtime import nvshmem_backend
    from ..runtime.torch_backend import TorchGroup

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{store}", rank=0, world_size=1)
    if device.type == "cuda" and nvshmem_backend.nvshmem_available():
        return nvshmem_backend.init_nvshmem(), dist.group.WORLD
    return TorchGroup(dist.group.WORLD, device=device), dist.group.WORLD


def _time(fn, args, rounds: int, target_ms: float, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn(*args)
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(target_ms / 1e3 / one))
    best = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        sync()
        best.append((time.perf_counter() - t0) / iters * 1e6)
    best.sort()
    return best[len(best) // 2]


@register("async_tp", help="compiled TP block (all_gather->mm->mm->reduce_scatter) with vs "
          "without the ditron_ops.compile pass (torchrun, or W = 1)",
          world_sizes=(1,), quick_world_sizes=(1,))
def run(cfg: BenchConfig) -> list[Result]:
    """Measure every shape once per process; every rank measures, rank 0's rows are written."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import ditron_ops.compile as dc
    from ditron_ops.compile import passes

    group, pg = _group(cfg.device)
    w = group.world_size
    results = []
    for m, k, n in (QUICK if cfg.quick else SHAPES):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(m // w, k, generator=gen).to(cfg.device, cfg.dtype)
        w1 = (torch.randn(k, n // w, generator=gen) / k ** 0.5).to(cfg.device, cfg.dtype)
        w2 = (torch.randn(n // w, k, generator=gen) / n ** 0.5).to(cfg.device, cfg.dtype)

        def block(x, w1, w2):
            h = torch.nn.functional.gelu(funcol.all_gather_tensor(x, 0, pg) @ w1)
            return funcol.reduce_scatter_tensor(h @ w2, "sum", 0, pg)

        with torch.no_grad():
            torch._dynamo.reset()
            dc.disable()
            plain = torch.compile(block)
            base_us = _time(plain, (x, w1, w2), cfg.rounds, cfg.target_ms, cfg.device)
            torch._dynamo.reset()
            start = len(passes._reports)
            # a TorchGroup (no NVSHMEM) has no symmetric memory: the pass leaves it by default,
            # opted in here so its row shows what the reference path costs
            with dc.enable(allow_reference=True):
                fused = torch.compile(block)
                fused(x, w1, w2)
            rewritten = sum(e.rewritten for r in passes._reports[start:] for e in r.entries)
            ours_us = _time(fused, (x, w1, w2), cfg.rounds, cfg.target_ms, cfg.device)
            err = (fused(x, w1, w2).float() - plain(x, w1, w2).float()).abs().max().item()
        if dist.is_initialized() and w > 1:
            on = cfg.device if dist.get_backend() == "nccl" else torch.device("cpu")
            times = torch.tensor([ours_us, base_us], dtype=torch.float64, device=on)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            ours_us, base_us = times.tolist()
        results.append(Result("async_tp", f"M{m}", w, cfg.dtype_name, f"compiled+pass ({group.backend})",
                              ours_us, "compiled", base_us, shape=f"{m}x{k}x{n}", m=m, n=n // w, k=k,
                              extra={"rewritten": rewritten, "max_abs_diff": err}))
        print(f"async_tp M={m} K={k} N={n} W={w} {group.backend}: pass {ours_us:.1f} us, "
              f"plain {base_us:.1f} us, rewritten {rewritten}, max diff {err:.3g}", flush=True)
    return results
