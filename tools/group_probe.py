"""Whether the grouped tile order's ``GROUP_M`` holds back the many-wave sweep shapes (GPU):
the 128x256/s4/tail tiles with ``group_m`` in ``GROUPS`` on the sweep's shapes of two waves or
more and the model shapes, paired with cuBLAS.

Why: shapes of 5-38 waves with long rows of tiles (4232x7976x10392: 34 x 32 tiles) ran at
0.80-0.87x cuBLAS where the model shapes run at 0.98x; a group of 8 tile rows spans a whole
wave's columns there, which may cost L2 reuse (benchmarks/NOTES.md, GEMM core).

Result (2026-12-03): benchmarks/NOTES.md, "GROUP_M on the many-wave shapes".

Usage (on the GPU machine): ``python tools/group_probe.py --csv out.csv``
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from ditron_ops.bench.gemm_sweep import _inputs, _model_shapes, sweep_shapes
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm._core import GPU_CONFIGS, matmul
from ditron_ops.gemm._core_configs import GPU_CONFIG
from ditron_ops.runtime.virtual import launch
from invariant_configs import write_csv  # (tools/ is the script's folder)

GROUPS = (4, 8, 16, 32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    rows = []
    base = GPU_CONFIGS[GPU_CONFIG]

    def body(group):
        warm_gpu(group.device)
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
