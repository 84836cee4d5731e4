"""Bench ``collectives``: all_gather, reduce_scatter, all_reduce (one-shot, two-shot) vs torch.

Every case is one global message ``[rows, cols]`` (the same for every world size W)::

    all_gather      in [rows/W, cols] per rank -> out [rows, cols]
    reduce_scatter  in [rows, cols] per rank   -> out [rows/W, cols]
    all_reduce      in [rows, cols] per rank   -> out [rows, cols]

Cases are latency-bound sizes (4 KiB .. 1 MiB, 64 columns) and one bandwidth-bound case per
model hidden size K of ``shapes.LAYER_CONFIGS``: ``M = 8192`` rows x ``K`` columns, the activation
that AG-GEMM gathers and GEMM-RS reduce-scatters.

Ours and the baseline run in the same virtual world (W threads on one device). The baseline is
``ditron_ops.reference``: a host exchange of tensor handles, then torch copies / fp32 sums.
torch.distributed (NCCL) cannot put several ranks on one GPU, so it is not the baseline here;
the multi-process comparison against NCCL belongs to the multi-GPU benches.

Bandwidths follow nccl-tests: ``algbw = S / t`` with ``S`` the gathered/reduced tensor size,
``busbw = algbw * (W-1)/W`` (all_gather, reduce_scatter) or ``* 2(W-1)/W`` (all_reduce). At
W = 1 nothing crosses ranks and busbw is 0. On one GPU every "link" is HBM, so busbw here
measures the kernels' memory efficiency, not NVLink.

One-shot all_reduce stages W copies of the whole message per rank, so it runs only up to
``ONE_SHOT_MAX_BYTES`` (64 MiB); above that two-shot is the algorithm that matters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import reference
from ..collectives import all_gather, all_reduce, reduce_scatter
from .harness import BenchConfig, Result, register, rows_over_worlds, time_spmd
from .shapes import DEFAULT_M, hidden_sizes

BASELINE = "torch reference (virtual world)"
SMALL_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
SMALL_COLS = 64
QUICK_SMALL_BYTES = (4 << 10, 16 << 10)
ONE_SHOT_MAX_BYTES = 64 << 20
QUICK_M, QUICK_K = 4, 4096  # the LLaMA-7B / Mistral-7B hidden size with 4 tokens


@dataclass(frozen=True)
class Case:
    """One global message ``[rows, cols]``.

    Attributes
    ----------
    name : str
        Label in the table and the PNG.
    rows, cols : int
    model : str
        Models with this hidden size (empty for the latency cases).
    """

    name: str
    rows: int
    cols: int
    model: str = ""


def _size_label(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


def cases(dtype: torch.dtype, quick: bool) -> list[Case]:
    """The message cases for ``dtype`` (tiny ones when ``quick``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    small = QUICK_SMALL_BYTES if quick else SMALL_BYTES
    out = [Case(_size_label(b), max(1, b // (SMALL_COLS * elem)), SMALL_COLS) for b in small]
    if quick:
        out.append(Case(f"M{QUICK_M}xK{QUICK_K}", QUICK_M, QUICK_K, "LLaMA-7B,Mistral-7B"))
    else:
        out += [Case(f"M{DEFAULT_M}xK{k}", DEFAULT_M, k, ",".join(models))
                for k, models in hidden_sizes().items()]
    return out


@dataclass(frozen=True)
class _Op:
    name: str
    ours: Callable[[torch.Tensor], torch.Tensor]
    base: Callable[[torch.Tensor, object], torch.Tensor]
    bus_factor: Callable[[int], float]
    shard_input: bool  # all_gather takes this rank's rows only
    max_bytes: Optional[int] = None  # skip larger messages


def _ops() -> list[_Op]:
    half = lambda w: (w - 1) / w  # noqa: E731
    return [
        _Op("all_gather", lambda x: all_gather(x), lambda x, g: reference.all_gather(x, g), half, True),
        _Op("reduce_scatter", lambda x: reduce_scatter(x), lambda x, g: reference.reduce_scatter(x, g),
            half, False),
        _Op("all_reduce/one_shot", lambda x: all_reduce(x, algorithm="one_shot"),
            lambda x, g: reference.all_reduce(x, g), lambda w: 2 * half(w), False, ONE_SHOT_MAX_BYTES),
        _Op("all_reduce/two_shot", lambda x: all_reduce(x, algorithm="two_shot"),
            lambda x, g: reference.all_reduce(x, g), lambda w: 2 * half(w), False),
    ]


def _max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def _rank_body(group, cfg: BenchConfig, case_list: list[Case]) -> list[Result]:
    """SPMD body: every case x op, ours then baseline; rank 0 returns the rows."""
    w, dtype = group.world_size, cfg.dtype
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=group.device).manual_seed(1234 + group.rank)
    rows_out: list[Result] = []
    for case in case_list:
        rows = max(w, case.rows // w * w)  # even shards for all_gather
        full = torch.randn((rows, case.cols), generator=gen, device=group.device,
                           dtype=torch.float32).to(dtype)
        shard = full[: rows // w].contiguous()
        nbytes = rows * case.cols * elem
        for op in _ops():
            if op.max_bytes is not None and nbytes > op.max_bytes:
                continue
            x = shard if op.shard_input else full
            ours = lambda: op.ours(x)  # noqa: E731
            base = lambda: op.base(x, group)  # noqa: E731
            err = _max_abs_err(ours(), base())
            t_ours = time_spmd(group, ours, rounds=cfg.rounds, target_ms=cfg.target_ms)
            t_base = time_spmd(group, base, rounds=cfg.rounds, target_ms=cfg.target_ms)
            err = max(group.all_gather_object(err))
            if group.rank != 0:
                continue
            algbw = nbytes / (t_ours * 1e-6) / 1e9
            base_algbw = nbytes / (t_base * 1e-6) / 1e9
            factor = op.bus_factor(w)
            rows_out.append(Result(
                bench="collectives", case=case.name, world_size=w, dtype=cfg.dtype_name,
                impl=op.name, time_us=t_ours, baseline=BASELINE, baseline_us=t_base,
                shape=f"{rows}x{case.cols}", m=rows, k=case.cols, nbytes=nbytes, model=case.model,
                extra={"algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                       "base_busbw_GBps": base_algbw * factor, "max_abs_err": err}))
        del full, shard
    return rows_out


@register("collectives", help="all_gather / reduce_scatter / all_reduce (one_shot, two_shot) "
                              "vs the torch reference on the same virtual world; bus bandwidth")
def run(cfg: BenchConfig) -> list[Result]:
    """Run every case at every world size of ``cfg``; returns the rows of rank 0.

    Parameters
    ----------
    cfg : BenchConfig

    Returns
    -------
    list of Result
        One row per (world size, case, op): ``impl`` is the op (``all_reduce/one_shot`` ...),
        extras ``algbw_GBps``, ``busbw_GBps``, ``base_busbw_GBps`` and ``max_abs_err`` (ours vs
        the reference, max over ranks; a sanity check, the tests check exactness).
    """
    return rows_over_worlds(cfg, _rank_body, cfg, cases(cfg.dtype, cfg.quick))
