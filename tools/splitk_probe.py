"""Where a split-K call's time goes (GPU): the split GEMM launch alone, the reduce launch
alone, and both, against the unsplit rule and cuBLAS, on the sweep's few-tile, long-K shapes;
plus reduce kernels of other block shapes (``REDUCES``; empty now that the committed reduce is
the fastest measured, 8x128 with every slice's load at once).

Why: split-K had measured a 10 us fixed cost and 1.1 TB/s of partial traffic; this probe found
it in the reduce launch (17-56 us, a runtime slice loop over unspecialized strides), since
replaced (benchmarks/NOTES.md, "Split-K: the reduce"). Its CSV feeds the split model's fit.

Usage (on the GPU machine): ``python tools/splitk_probe.py --csv out.csv``
"""
from __future__ import annotations

import argparse
import csv
import sys

import torch
import triton
import triton.language as tl

from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm._core import _MatmulPlan, _ab_values, matmul
from ditron_ops.gemm._core_configs import GPU_CANDIDATES
from ditron_ops.runtime.virtual import launch

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
REDUCES = ()
"""(BLOCK_R, BLOCK_C, warps) of unrolled reduce variants to time beside the committed one (the run
at 9e7a4c0 timed (32, 128, 4), (8, 128, 4), (16, 256, 4), (4, 256, 2): 8x128 fastest)."""


@triton.jit
def unrolled_reduce(p_ptr, c_ptr, M, N, slice_stride, stride_pm, stride_cm,
                    SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_C)
    rm = (pid // blocks_n) * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = (pid % blocks_n) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        acc += tl.load(ptrs + s * slice_stride, mask=mask, other=0.0)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=mask)


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
                    rows_p, cols = core.parts.shape[0] // core.slices, core.parts.shape[1]
                    for br, bc, w in REDUCES:
                        grid = (-(-m // br) * -(-n // bc),)
                        name = f"{base}/ureduce{br}x{bc}w{w}"
                        fns[name] = (lambda c=core, o=out, br=br, bc=bc, w=w, grid=grid,
                                     rp=rows_p, cols=cols: unrolled_reduce[grid](
                            c.parts, o, m, n, rp * cols, cols, o.stride(0), SLICES=c.slices,
                            BLOCK_R=br, BLOCK_C=bc, num_warps=w))
                        meta[name] = (cand.name, s, tiles, f"ureduce{br}x{bc}w{w}")
            times = paired_graph_times(group, fns, rounds=args.rounds, target_ms=6.0)
            ref = times["cublas"]
            line = [f"{m}x{n}x{k}: cublas {ref:.1f} rule {times['rule']:.1f}"]
            for name, (cfg_name, s, tiles, part) in meta.items():
                rows.append(dict(m=m, n=n, k=k, config=cfg_name, split=s, tiles=tiles,
                                 part=part, us=round(times[name], 2),
                                 cublas_us=round(ref, 2), rule_us=round(times["rule"], 2)))
                if part in ("full", "split", "gemm", "reduce"):
                    line.append(f"{cfg_name[:7]}/S{s}/{part}={times[name]:.1f}")
            best_u = min((times[nm], nm) for nm, v in meta.items() if v[3].startswith("ureduce"))\
                if any(v[3].startswith("ureduce") for v in meta.values()) else None
            if best_u:
                line.append(f"best ureduce {best_u[1]}={best_u[0]:.1f}")
            print("\n  ".join(line), flush=True)
            del a, b
            torch.cuda.empty_cache()
        return True

    launch(body, 1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
