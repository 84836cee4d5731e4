"""Whether the grouped tile order's ``GROUP_M`` holds back the many-wave sweep shapes (GPU):
the 128x256/s4/tail tiles with ``group_m`` in ``GROUPS`` on the sweep's shapes of two waves or
more and the model shapes, paired with cuBLAS.

Why: shapes of 5-38 waves with long rows of tiles (4232x7976x10392: 34 x 32 tiles) ran at
0.80-0.87x cuBLAS where the model shapes run at 0.98x; a group of 8 tile rows spans a whole
wave's columns there, which may cost L2 reuse (benchmarks/NOTES.md, GEMM core).

Result (2026-12-03): benchmarks/NOTES.md, "GROUP_M on the many-wave shapes".

``--fresh N``: the rule (``_core_configs.long_k_order``, fitted to the shapes above) checked off
them: the first N shapes of ``FRESH_SEEDS`` where the rule orders the tiles in groups of
``LONG_K_GROUP_M``, its plan against the same plan built with the order rule off (groups of 8),
paired with cuBLAS; the gain column is the second's time over the first's.

Usage (on the GPU machine): ``python tools/group_probe.py --csv out.csv [--fresh 20]``
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from ditron_ops.bench.gemm_sweep import _inputs, _model_shapes, sweep_shapes
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import GPU_CONFIGS, _MatmulPlan, matmul
from ditron_ops.gemm._core_configs import GPU_CONFIG
from ditron_ops.runtime.virtual import launch
from invariant_configs import write_csv  # (tools/ is the script's folder)

GROUPS = (4, 8, 16, 32)
FRESH_SEEDS = range(601, 640)
"""Seeds of ``--fresh`` shapes (the rule was fitted to the sweep's seed and the model shapes)."""


def fresh_shapes(count: int) -> list[tuple[int, int, int]]:
    """The first ``count`` shapes of ``FRESH_SEEDS`` where the rule picks groups of
    ``LONG_K_GROUP_M`` on an H200 (132 SMs)."""
    out = []
    for seed in FRESH_SEEDS:
        for m, n, k in sweep_shapes(seed=seed):
            c, _ = rules.select_split(m, n, k, 132, torch.device("cuda"), deterministic=False,
                                      lined=k % 64 == 0)
            if c.cfg.group_m == rules.LONG_K_GROUP_M and (m, n, k) not in out:
                out.append((m, n, k))
            if len(out) == count:
                return out
    return out


def check_fresh(group, count: int, rows: list) -> None:
    """``--fresh``: the rule's plan against the same plan with ``long_k_order`` off."""
    for m, n, k in fresh_shapes(count):
        a, b = _inputs(group, m, n, k, torch.bfloat16)
        out = a.new_empty(m, n)
        rule = _MatmulPlan(a, b, None, out, None, False)
        steps = rules.LONG_K_STEPS
        rules.LONG_K_STEPS = 1 << 30
        try:
            g8 = _MatmulPlan(a, b, None, out, None, False)
        finally:
            rules.LONG_K_STEPS = steps
        times = paired_graph_times(group, {
            "cublas": lambda: torch.matmul(a, b),
            "rule": lambda: rule.run(a, b, None, out),
            "g8": lambda: g8.run(a, b, None, out)}, rounds=5, target_ms=6.0)
        row = dict(m=m, n=n, k=k, rule=rule.name, rule_x=round(times["cublas"] / times["rule"], 4),
                   g8_x=round(times["cublas"] / times["g8"], 4),
                   gain=round(times["g8"] / times["rule"], 4))
        rows.append(row)
        print(row, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default=None)
    p.add_argument("--fresh", type=int, default=0, help="check the rule on N fresh shapes")
    args = p.parse_args()
    rows = []
    base = GPU_CONFIGS[GPU_CONFIG]

    def body(group):
        warm_gpu(group.device)
        if args.fresh:
            check_fresh(group, args.fresh, rows)
            return True
        shapes = [s for s in sweep_shapes()
                  if -(-s[0] // 128) * -(-s[1] // 256) >= 2 * 132] + list(_model_shapes())
        for m, n, k in shapes:
            a, b = _inputs(group, m, n, k, torch.bfloat16)
            fns = {"cublas": lambda: torch.matmul(a, b)}
            for g in GROUPS:
                cfg = dataclasses.replace(base, group_m=g)
                fns[f"g{g}"] = lambda cfg=cfg: matmul(a, b, cfg=cfg)
            times = paired_graph_times(group, fns, rounds=3, target_ms=6.0)
            row = dict(m=m, n=n, k=k, **{f"g{g}": round(times["cublas"] / times[f"g{g}"], 4)
                                         for g in GROUPS})
            rows.append(row)
            print(row, flush=True)
        return True

    launch(body, 1)
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
