"""Bench ``overhead``: host cost of one eager collective call on a tiny tensor.

For each collective at W = 1 and W = 2 (virtual ranks), on every rank::

    sync | barrier | t0 | N x op(x) | sync | t1        per call = (t1 - t0) / N

with ``x`` of 1 KiB, so the device work is negligible and the time is the Python wrapper,
validation, the ``torch.ops.ditron`` dispatch, the output allocation and the kernel launch. Two
references bracket it:

* baseline: ``torch.empty_like(x)`` + ``copy_`` (one allocation and one launch, the floor of any
  op that returns a new tensor);
* ``graph_us`` (CUDA only): the same op captured in a CUDA graph and replayed N times, i.e. the op
  with the host path removed. ``host_overhead_us = eager - graph`` estimates what the host adds.

With W = 2 the ranks are threads of one process and share the GIL, so the eager numbers include
that contention (as they would for any virtual-world user).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..collectives import all_gather, all_reduce, reduce_scatter
from .harness import BenchConfig, Result, host_time_spmd, register, rows_over_worlds

BASELINE = "torch.empty_like + copy_"
ROWS, COLS = 8, 32  # fp32: 1 KiB; rows >= 8 so reduce_scatter has a row for every rank up to W=8

_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "all_gather": lambda x: all_gather(x),
    "reduce_scatter": lambda x: reduce_scatter(x),
    "all_reduce/one_shot": lambda x: all_reduce(x, algorithm="one_shot"),
    "all_reduce/two_shot": lambda x: all_reduce(x, algorithm="two_shot"),
}


def _empty_copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    out.copy_(x)
    return out


def _graph_time(group, op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                iters: int, rounds: int) -> Optional[float]:
    """Host time per replay of a CUDA graph holding one ``op(x)`` (None off CUDA). Collective."""
    if group.device.type != "cuda":
        return None
    op(x)  # workspace allocated outside capture
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=group.stream, capture_error_mode="thread_local"):
        op(x)
    group.barrier()
    return host_time_spmd(group, graph.replay, iters=iters, rounds=rounds)


def _rank_body(group, cfg: BenchConfig, iters: int) -> list[Result]:
    gen = torch.Generator(device=group.device).manual_seed(7 + group.rank)
    x = torch.randn((ROWS, COLS), generator=gen, device=group.device,
                    dtype=torch.float32).to(cfg.dtype)
    nbytes = x.numel() * x.element_size()
    rounds = cfg.rounds
    base_us = host_time_spmd(group, lambda: _empty_copy(x), iters=iters, rounds=rounds)
    rows: list[Result] = []
    for name, op in _OPS.items():
        eager_us = host_time_spmd(group, lambda: op(x), iters=iters, rounds=rounds)
        graph_us = _graph_time(group, op, x, iters, rounds)
        if group.rank != 0:
            continue
        extra = {"iters": iters,
                 "graph_us": graph_us if graph_us is not None else "n/a (cpu)",
                 "host_overhead_us": eager_us - graph_us if graph_us is not None else "n/a (cpu)"}
        rows.append(Result(
            bench="overhead", case=f"{nbytes}B", world_size=group.world_size, dtype=cfg.dtype_name,
            impl=name, time_us=eager_us, baseline=BASELINE, baseline_us=base_us,
            shape=f"{ROWS}x{COLS}", m=ROWS, k=COLS, nbytes=nbytes, extra=extra))
    return rows


@register("overhead", help="host overhead per eager call on a tiny tensor vs torch.empty+copy_ "
                           "and vs CUDA-graph replay", world_sizes=(1, 2), quick_world_sizes=(1, 2))
def run(cfg: BenchConfig) -> list[Result]:
    """Measure per-call host time of every collective at each world size of ``cfg``.

    Parameters
    ----------
    cfg : BenchConfig

    Returns
    -------
    list of Result
        One row per (world size, op): ``time_us`` eager per call, ``baseline_us`` empty+copy per
        call, extras ``graph_us`` and ``host_overhead_us`` (CUDA only) and ``iters``.
        ``ratio = baseline / eager`` (below 1: how many times an empty+copy the op costs).
    """
    if cfg.device.type == "cuda":
        iters = 20 if cfg.quick else 200
    else:
        iters = 2 if cfg.quick else 10  # the Triton interpreter is slow per launch
    return rows_over_worlds(cfg, _rank_body, cfg, iters)
