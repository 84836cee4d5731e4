"""Data for issue 20's batch-invariant GEMM at M >= 1024 (GPU): fp32-out products (deterministic
mode's) with two programs per SM against the one-program tiles, and whether their rows are
bitwise those of the 128x256 tiles.

Why: deterministic mode writes fp32 C, twice cuBLAS's bf16 bytes, and its one-program-per-SM
kernel stores each tile behind no other tile's MMAs; two resident programs per SM
(``ctas_per_sm = 2``, ``_core_configs.short_k``) hide one's store under the other's K loop.
Rows: the six models' GEMM-RS products (``bench gemm_rs``'s shapes) at M in ``MS`` and the
sweep's short-K shapes (``tests/test_gemm_core_rule.py``'s ``SHORT_K_MEASURED``), each tiling
timed in one paired graph run with cuBLAS bf16 out and cuBLAS fp32 out.

Its result decides ``short_k``'s 2-byte C condition (benchmarks/NOTES.md, GEMM core).

Usage (on the GPU machine): ``python benchmarks/probes/invariant_pairs.py --csv out.csv``
"""
from __future__ import annotations

import argparse
import sys

import torch

from ditron_ops.bench.gemm_rs import _inputs, _shapes
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm._core import matmul
from ditron_ops.gemm._core_configs import GPU_CONFIG, GPU_CONFIGS, SHORT_K_CANDIDATE
from ditron_ops.runtime.virtual import launch
from invariant_configs import finish  # (this folder: the script's)

CANDIDATES = {
    "128x256/s4/tail": GPU_CONFIGS[GPU_CONFIG],  # (fp32 C: 3 stages)
    "128x128/w4/o2": SHORT_K_CANDIDATE.cfg,  # (fp32 C: 2 stages a program)
}
MS = (1024, 8192)
SWEEP = ((2840, 5376, 576), (5408, 3936, 768), (15912, 8904, 1152), (5176, 7032, 1472),
         (5128, 1792, 1408), (2912, 3072, 1536))
"""The sweep shapes where the bf16 pairs ran faster (``short_k`` takes them)."""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default=None)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    rows = []

    def one(group, m, n, k, model):
        a, b = _inputs(m, k, n, torch.bfloat16, group.device)
        outs = {name: torch.empty(m, n, device=group.device) for name in CANDIDATES}
        fns = {name: (lambda name=name, c=c: matmul(a, b, out=outs[name], cfg=c))
               for name, c in CANDIDATES.items()}
        fns["cublas"] = lambda: a @ b
        fns["cublas32"] = lambda: torch.mm(a, b, out_dtype=torch.float32)
        times = paired_graph_times(group, fns, rounds=args.rounds, target_ms=8.0)
        ref = outs["128x256/s4/tail"]
        for name in CANDIDATES:
            rows.append(dict(m=m, n=n, k=k, model=model, config=name, us=round(times[name], 2),
                             ratio=round(times["cublas"] / times[name], 4),
                             ratio32=round(times["cublas32"] / times[name], 4),
                             bitwise=bool(torch.equal(outs[name], ref))))
        print(f"{m:6d}x{n}x{k} {model[:14]:14s} "
              + " ".join(f"{r['config']}={r['ratio']:.3f}/{r['ratio32']:.3f}{'' if r['bitwise'] else '!'}"
                         for r in rows[-len(CANDIDATES):]), flush=True)

    def body(group):
        warm_gpu(group.device)
        for (k, n), models in _shapes(False).items():
            for m in MS:
                one(group, m, n, k, models)
        for m, n, k in SWEEP:
            one(group, m, n, k, "sweep")
        return True

    launch(body, 1)
    print("ratio: x cuBLAS bf16 out, ratio32: x cuBLAS fp32 out")
    return finish(rows, args.csv, "the 128x256 rows")


if __name__ == "__main__":
    sys.exit(main())
