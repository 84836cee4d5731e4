"""Data for issue 20's batch-invariant GEMM at small M (GPU): candidate M-side tilings of the
fp32-out core GEMM (BLOCK_K = 64 and the wgmma reduction fixed, so a row's bits must not change)
against cuBLAS ``a @ b``, per model shape and M, and whether every candidate's rows are bitwise
those of the 128x256 tiling at M = 8192.

Usage (on the GPU machine): ``python benchmarks/probes/invariant_configs.py --csv out.csv``
"""
from __future__ import annotations

import argparse
import csv
import math
import sys

import torch

from ditron_ops.bench.gemm_rs import _inputs, _shapes
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm._core import GPU_CONFIGS, GPU_CONFIG, TileConfig, matmul
from ditron_ops.runtime.virtual import launch

CANDIDATES = {
    "current": GPU_CONFIGS[GPU_CONFIG],
    "64x64/s6": TileConfig(64, 64, 64, 8, 4, 6),
    "64x128/s6": TileConfig(64, 128, 64, 8, 4, 6),
    "64x256/s4": TileConfig(64, 256, 64, 8, 4, 4),
    # swapped operands (C^T = B^T A^T, skinny_gemm_kernel): M rows x N columns of C per tile
    "sw16x64/s8": TileConfig(16, 64, 64, 1, 4, 8, swap_ab=True),
    "sw16x64/s12": TileConfig(16, 64, 64, 1, 4, 12, swap_ab=True),
    "sw16x128/s8": TileConfig(16, 128, 64, 1, 4, 8, swap_ab=True),
    "sw32x64/s10": TileConfig(32, 64, 64, 1, 4, 10, swap_ab=True),
    "sw16x32/s12": TileConfig(16, 32, 64, 1, 4, 12, swap_ab=True),  # (mma v2, not wgmma)
}
"""The 64-row tilings the rule weighs at small M, and the swapped-operand ones (earlier runs
also had 64x32, 64x64/s8, 128x128 and 128x64: never the best at M <= 128)."""
MS = (1, 16, 32, 64, 128)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default=None)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    rows = []

    def body(group):
        warm_gpu(group.device)
        for (k, n), models in _shapes(False).items():
            a_big, b = _inputs(8192, k, n, torch.bfloat16, group.device)
            ref = matmul(a_big, b, out=torch.empty(8192, n, device=group.device), cfg=CANDIDATES["current"])
            for m in MS:
                a = a_big[:m].clone()
                outs = {name: torch.empty(m, n, device=group.device) for name in CANDIDATES}
                fns = {name: (lambda name=name, c=c: matmul(a, b, out=outs[name], cfg=c))
                       for name, c in CANDIDATES.items()}
                fns["cublas"] = lambda: a @ b
                times = paired_graph_times(group, fns, rounds=args.rounds, target_ms=10.0)
                for name in CANDIDATES:
                    same = bool(torch.equal(outs[name], ref[:m]))
                    rows.append(dict(k=k, n=n, m=m, model=models, config=name,
                                     ratio=round(times["cublas"] / times[name], 4),
                                     us=round(times[name], 2),
                                     cublas_us=round(times["cublas"], 2), bitwise=same))
                best = max((r for r in rows[-len(CANDIDATES):]), key=lambda r: r["ratio"])
                print(f"{m:5d}x{n}x{k} cuBLAS {times['cublas']:7.1f} us  "
                      + " ".join(f"{r['config']}={r['ratio']:.2f}{'' if r['bitwise'] else '!'}"
                                 for r in rows[-len(CANDIDATES):]) + f"  best {best['config']}",
                      flush=True)
        return True

    launch(body, 1)
    return finish(rows, args.csv, "the M=8192 rows")


def write_csv(rows: list[dict], path) -> None:
    """Write ``rows`` (dicts with the first row's keys) to the CSV at ``path``, if given."""
    if path:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def print_gains(tool: str, gains: list[float], of: str = "") -> None:
    """One line: how many ``gains`` (time before / after), their geo-mean, how many below 1."""
    if gains:
        print(f"{tool}: {len(gains)}{of} shapes, geo-mean gain "
              f"{math.exp(sum(map(math.log, gains)) / len(gains)):.3f}, "
              f"{sum(g < 1 for g in gains)} slower", flush=True)


def finish(rows: list[dict], path, reference: str) -> int:
    """``write_csv`` and count the rows not bitwise equal to ``reference`` (their ``bitwise``
    field)."""
    write_csv(rows, path)
    bad = [r for r in rows if not r["bitwise"]]
    print(f"{len(rows)} rows, {len(bad)} not bitwise equal to {reference}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
