"""Where a split-K call's time goes (GPU): the split GEMM launch alone, the reduce launch
alone, and both, against the unsplit rule and cuBLAS, on the sweep's few-tile, long-K shapes.

Why: the split model's fixed cost and partial traffic are fitted to these runs; the launches
timed apart say which kernel a cost is in (results: benchmarks/NOTES.md, "Split-K: the
reduce").

Usage (on the GPU machine): ``python benchmarks/probes/splitk_probe.py --csv out.csv``
"""
from __future__ import annotations

import argparse
import sys

import torch

from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm._core import _MatmulPlan, _ab_values, matmul
from ditron_ops.gemm._core_configs import GPU_CANDIDATES
from ditron_ops.runtime.virtual import launch
from invariant_configs import write_csv  # (this folder: the script's)

SHAPES = ((4808, 272, 14080), (6520, 384, 11520), (1112, 960, 8640), (800, 768, 10760),
          (712, 896, 9288), (1480, 1792, 10432), (168, 15432, 9664), (1496, 768, 7320),
          (368, 2304, 8312), (176, 6272, 4624), (3616, 256, 7872), (200, 4736, 4504),
          (1392, 704, 15808), (1960, 368, 11264), (592, 5248, 3200), (3408, 1248, 7440),
          (2704, 2560, 5824), (15904, 464, 2456), (14040, 384, 3264), (928, 4992, 952),
          (8248, 544, 1424), (3200, 6728, 2952), (2928, 984, 1600), (8192, 1376, 4096),
          (8192, 3696, 8192))
"""The 48-shape sweep's shapes with fewer 128x256 tiles than 132 SMs (or barely more) and a
K of 50 steps or more (benchmarks/results/gemm_sweep-bf16-cuda.csv)."""
SPLITS = (2, 3, 4, 6)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default=None)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rows = []

    def body(group):
        dev = group.device
        budget = torch.cuda.get_device_properties(dev).multi_processor_count
        warm_gpu(dev)
        for m, n, k in SHAPES:
            g = torch.Generator(device=dev).manual_seed(m + n + k)
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=g)
            fns = {"cublas": lambda: a @ b, "rule": lambda: matmul(a, b)}
            meta = {}
            for cand in GPU_CANDIDATES:
                cfg = cand.cfg
                tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
                out1 = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                fns[f"{cand.name}/S1"] = (lambda o=out1, c=cfg: matmul(a, b, out=o, cfg=c))
                meta[f"{cand.name}/S1"] = (cand.name, 1, tiles, "full")
                for s in SPLITS:
                    if tiles * s > 2 * budget or -(-k // 64) < 4 * s or tiles >= budget:
                        continue
                    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                    plan = _MatmulPlan(a, b, None, out, cfg, False, s)
                    core = plan.core
                    base = f"{cand.name}/S{s}"
                    fns[base] = (lambda pl=plan, o=out: pl.run(a, b, None, o))
                    fns[base + "/gemm"] = (lambda c=core: c.gemm.launch(
                        *_ab_values(a, b, c._a_varies, c._b_pad)))
                    fns[base + "/reduce"] = (lambda c=core, o=out: c.reduce.launch(o, o))
                    for key in ("", "/gemm", "/reduce"):
                        meta[base + key] = (cand.name, s, tiles, key[1:] or "split")
            times = paired_graph_times(group, fns, rounds=args.rounds, target_ms=6.0)
            ref = times["cublas"]
            line = [f"{m}x{n}x{k}: cublas {ref:.1f} rule {times['rule']:.1f}"]
            for name, (cfg_name, s, tiles, part) in meta.items():
                rows.append(dict(m=m, n=n, k=k, config=cfg_name, split=s, tiles=tiles,
                                 part=part, us=round(times[name], 2),
                                 cublas_us=round(ref, 2), rule_us=round(times["rule"], 2)))
                if part in ("full", "split", "gemm", "reduce"):
                    line.append(f"{cfg_name[:7]}/S{s}/{part}={times[name]:.1f}")
            print("\n  ".join(line), flush=True)
            del a, b
            torch.cuda.empty_cache()
        return True

    launch(body, 1)
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
