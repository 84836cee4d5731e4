"""Whether the sliced tail holds on shapes it was not fitted to (GPU): shapes drawn by
``gemm_sweep``'s rule from other seeds, kept where the rule slices a tail, timed as the rule
runs them and with the choice it would make without the sliced tail (``TAIL_MARGIN`` 0), both
paired with cuBLAS; each checked against the fp32 product.

Why: ``TAIL_LAUNCH_US``, ``TAIL_MARGIN`` and 128x128's ``tail_efficiency`` were fitted to the
sweep's own shapes (``bench gemm_sweep --only tail``); a rule must hold off them.

Result (2026-12-03): benchmarks/NOTES.md, "Sliced tail".

Usage (on the GPU machine): ``python benchmarks/probes/tail_check.py --count 24 --csv out.csv``, or
``--shapes 2384x1152x12360,...`` for given shapes with the forced tilings beside.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from ditron_ops.bench import gemm_sweep
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, program_budget
from ditron_ops.runtime.virtual import launch
from invariant_configs import print_gains, write_csv  # (this folder: the script's)

SEEDS = range(101, 140)
"""Seeds of the drawn shapes (the sweep's own is ``gemm_sweep.SEED`` = 20)."""


def without_tail(m: int, n: int, k: int, programs: int, device: torch.device):
    """``select_split``'s choice with no sliced tail: ``(candidate, slices)``."""
    margin, rules.TAIL_MARGIN = rules.TAIL_MARGIN, 0.0
    try:
        return rules.select_split(m, n, k, programs, device, deterministic=False)
    finally:
        rules.TAIL_MARGIN = margin


def shapes(count: int, programs: int, device: torch.device) -> list[tuple[int, int, int]]:
    """Up to ``count`` shapes from ``SEEDS`` (not the sweep's) whose rule slices a tail."""
    out = []
    for seed in SEEDS:
        for s in gemm_sweep.sweep_shapes(seed=seed):
            cand, _ = rules.select_split(*s, programs, device, deterministic=False)
            if cand.cfg.tail_slices and s not in out:
                out.append(s)
            if len(out) == count:
                return out
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--shapes", default="", help="MxNxK,... instead of drawn ones, each also "
                   "timed with 128x256 and 128x128 tiles unsplit and with their tails in "
                   "2, 3, 4, 6, 8 slices (columns named by configuration)")
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    given = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    rows = []

    def body(group):
        warm_gpu(group.device)
        budget = program_budget(group.device, None)
        for m, n, k in given or shapes(args.count, budget, group.device):
            a, b = gemm_sweep._inputs(group, m, n, k, torch.bfloat16)
            rule, _ = rules.select_split(m, n, k, budget, group.device, deterministic=False)
            alt, split = without_tail(m, n, k, budget, group.device)
            ref = a.float() @ b.float()
            err = ((matmul(a, b, deterministic=False).float() - ref).abs().max()
                   / ref.abs().max()).item()
            fns = {"cublas": lambda: torch.matmul(a, b),
                   "rule": lambda: matmul(a, b, deterministic=False),
                   "without": lambda: matmul(a, b, cfg=alt.cfg, split_k=split,
                                             deterministic=False)}
            forced = {}
            if given:
                for main in (rules.SLICED_TAIL_MAIN, rules.GPU_CANDIDATES[1]):
                    for s in (0, 2, 3, 4, 6, 8):
                        cfg = dataclasses.replace(main.cfg, tail_slices=s)
                        forced[f"{main.name}/kt{s}" if s else main.name] = (
                            lambda cfg=cfg: matmul(a, b, cfg=cfg, deterministic=False))
            times = paired_graph_times(group, {**fns, **forced}, rounds=5, target_ms=8.0)
            row = dict(m=m, n=n, k=k, rule=rule.name, without=f"{alt.name} S={split}",
                       rule_x=round(times["cublas"] / times["rule"], 4),
                       without_x=round(times["cublas"] / times["without"], 4),
                       gain=round(times["without"] / times["rule"], 4), rel_err=f"{err:.1e}",
                       **{name: round(times["cublas"] / times[name], 4) for name in forced})
            rows.append(row)
            print(row, flush=True)
        print_gains("tail_check", [r["gain"] for r in rows])
        return True

    launch(body, 1)
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
