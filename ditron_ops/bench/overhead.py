"""Bench ``overhead``: host cost of one eager call of every op on a tiny problem, against
``torch.matmul`` in the same run.

For each op at each world size (virtual ranks; W = 1 is the target case), on every rank,
``--rounds`` paired rounds of::

    matmul: warm-up | sync | barrier | t0 | N x matmul() | sync | t1     per call = (t1 - t0) / N
    op:     warm-up | sync | barrier | t0 | N x op()     | sync | t1

The problem is tiny (an ``[8 W, 64] @ [64, 64]`` GEMM, a 1 KiB collective, a one-step decode
over 64 keys), so the device work is a few µs and the time is the host path: the Python
wrapper, validation, the ``torch.ops.ditron`` dispatch, the plan lookup, output allocation and
the kernel launches. Columns:

* ``time_us``: eager host time per call; ``baseline_us``: ``torch.matmul`` of the GEMM's full
  ``[8 W, 64] @ [64, 64]`` product, timed the same way (the cost the fused GEMM ops replace);
* ``host_ratio_vs_matmul``: the median over rounds of each round's ``op / matmul`` (a round
  times ``torch.matmul`` and then the op; target: at most 2.0 at W=1); ``time_us`` and
  ``baseline_us`` are the medians of the rounds;
* ``graph_us`` (CUDA only): the same call captured in a CUDA graph and replayed, i.e. with the
  host path removed.

With W > 1 the ranks are threads of one process that share the GIL, and GPU virtual ranks meet
at a host barrier around every waiting kernel (``VirtualGroup.waiting_launch``), so their eager
numbers include that contention and the gate; there is no target there.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

from ..attention.flash_decode import flash_decode
from ..collectives import all_gather, all_reduce, reduce_scatter
from ..gemm.ag_gemm import ag_gemm
from ..gemm.gemm_rs import gemm_ar, gemm_rs
from . import harness
from .harness import BenchConfig, Result, host_time_spmd, register, rows_over_worlds

BASELINE = "torch.matmul [8W, 64] @ [64, 64]"
ROWS, K, N = 8, 64, 64  # per rank: a [ROWS, K]; collectives: x [ROWS, 32]


def _ops(group, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The measured calls of this rank (inputs made once)."""
    gen = torch.Generator(device="cpu").manual_seed(7 + group.rank)
    dev, w = group.device, group.world_size

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=dev)

    a, weight, a_rs = rand(ROWS, K), rand(N, K), rand(ROWS * w, K)
    b = weight.t()  # a Linear weight, used without a copy
    x, x_rs = rand(ROWS, 32), rand(ROWS * w, 32)
    q, cache = rand(1, 8, 64), rand(1, 64, 8, 64)
    lens = torch.full((1,), 64, dtype=torch.int32, device=dev)
    full = rand(ROWS * w, K)
    return {
        "torch.matmul": lambda: torch.matmul(full, b),
        "ag_gemm/fused": lambda: ag_gemm(a, b, impl="fused"),
        "ag_gemm/auto": lambda: ag_gemm(a, b),
        "gemm_rs/fused": lambda: gemm_rs(a_rs, b, impl="fused"),
        "gemm_ar/fused": lambda: gemm_ar(a_rs, b, impl="fused"),
        "gemm_ar/auto": lambda: gemm_ar(a_rs, b),
        "all_reduce": lambda: all_reduce(x),
        "all_reduce/two_shot": lambda: all_reduce(x, algorithm="two_shot"),
        "all_gather": lambda: all_gather(x),
        "reduce_scatter": lambda: reduce_scatter(x_rs),
        "flash_decode": lambda: flash_decode(q, cache, cache, lens),
    }


def _graph_time(group, op: Callable[[], object], iters: int, rounds: int) -> Optional[float]:
    """Host time per replay of a CUDA graph holding one ``op()`` (None off CUDA). Collective."""
    if group.device.type != "cuda":
        return None
    op()  # plans and workspaces built outside the capture
    group.synchronize()
    group.barrier()
    graph = torch.cuda.CUDAGraph()
    with harness.CAPTURE_LOCK:  # one rank at a time (a capture starts with a device sync)
        with torch.cuda.graph(graph, stream=group.stream, capture_error_mode="thread_local"):
            op()
    group.barrier()
    return host_time_spmd(group, graph.replay, iters=iters, rounds=rounds)


def _rank_body(group, cfg: BenchConfig, iters: int) -> list[Result]:
    ops = _ops(group, cfg.dtype)
    matmul = ops.pop("torch.matmul")
    rows: list[Result] = []
    for name, op in ops.items():
        # paired rounds (matmul, then the op): the host's speed drifts within a run, and a
        # drift then moves both sides of a round's ratio alike (benchmarks/NOTES.md)
        base_rounds, eager_rounds = [], []
        for _ in range(cfg.rounds):
            base_rounds.append(host_time_spmd(group, matmul, iters=iters, rounds=1, warmup=1))
            eager_rounds.append(host_time_spmd(group, op, iters=iters, rounds=1, warmup=1))
        graph_us = _graph_time(group, op, iters, cfg.rounds)
        if group.rank != 0:
            continue
        ratios = [e / b for e, b in zip(eager_rounds, base_rounds)]
        eager, base = statistics.median(eager_rounds), statistics.median(base_rounds)
        extra = {"iters": iters, "host_ratio_vs_matmul": round(statistics.median(ratios), 3),
                 "graph_us": graph_us if graph_us is not None else "n/a (cpu)"}
        rows.append(Result(
            bench="overhead", case=f"W={group.world_size}", world_size=group.world_size,
            dtype=cfg.dtype_name, impl=name, time_us=eager, baseline=BASELINE, baseline_us=base,
            shape=f"{ROWS}x{K}x{N}", m=ROWS, n=N, k=K, extra=extra))
    return rows


@register("overhead", help="host time per eager call of every op on a tiny problem vs "
                           "torch.matmul, and per CUDA-graph replay", world_sizes=(1, 4),
          quick_world_sizes=(1,))
def run(cfg: BenchConfig) -> list[Result]:
    """Measure per-call host time of every op at each world size of ``cfg``.

    Parameters
    ----------
    cfg : BenchConfig

    Returns
    -------
    list of Result
        One row per (world size, op): ``time_us`` eager host time per call, ``baseline_us``
        ``torch.matmul`` per call, extras ``host_ratio_vs_matmul``, ``graph_us`` (CUDA only)
        and ``iters``. ``ratio = baseline_us / time_us`` (medians of the rounds; the plots show
        it); ``host_ratio_vs_matmul`` is the median of the paired rounds' ``op / matmul``.
    """
    if cfg.device.type == "cuda":
        iters = 20 if cfg.quick else 300
    else:
        iters = 2 if cfg.quick else 10  # the Triton interpreter is slow per launch
    return rows_over_worlds(cfg, _rank_body, cfg, iters)
