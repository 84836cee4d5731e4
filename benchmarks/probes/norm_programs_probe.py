"""``all_reduce_rmsnorm`` (no quant, default mode) at small T against our all_reduce and the
composition, with the programs per rank forced to each of ``--programs`` (0: the default
rule), W in ``--worlds``, on one GPU in virtual worlds: does the W = 8, H = 8192, T <= 8 time
come from the per-program arrivals?

    python benchmarks/probes/norm_programs_probe.py norm --worlds 2,4,8 --programs 0,1,2,4
    python benchmarks/probes/norm_programs_probe.py norm --programs 0 --kernels old.py,head
"""
from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F

from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.collectives import _norm_launch, all_reduce, all_reduce_rmsnorm
from ditron_ops.runtime.virtual import launch


def _norm_body(group, tokens, hidden):
    out = []
    for h in hidden:
        weight = torch.ones(h, dtype=torch.bfloat16, device=group.device)
        for t in tokens:
            x = torch.randn(t, h, dtype=torch.bfloat16, device=group.device)
            res = torch.randn(t, h, dtype=torch.bfloat16, device=group.device)

            def comp():
                r = all_reduce(x, group) + res
                return F.rms_norm(r, (h,), weight, 1e-6), r

            fns = {"fused": lambda: all_reduce_rmsnorm(x, res, weight, group=group),
                   "ar": lambda: all_reduce(x, group), "comp": comp}
            times = paired_graph_times(group, fns, rounds=5, target_ms=4)
            out.append((t, h, times["fused"], times["ar"], times["comp"]))
    return out


def _kernel(path: str):
    """``ar_rmsnorm_kernel`` of the package's ``_norm_kernels`` ("head") or of another copy of
    that file (e.g. ``git show 7b284ab:ditron_ops/collectives/_norm_kernels.py > old.py``),
    loaded as a module of ``ditron_ops.collectives`` so its relative imports resolve."""
    if path == "head":
        from ditron_ops.collectives._norm_kernels import ar_rmsnorm_kernel
        return ar_rmsnorm_kernel
    spec = importlib.util.spec_from_file_location("ditron_ops.collectives._norm_alt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ar_rmsnorm_kernel


def norm(args):
    default, kernels = _norm_launch.programs_per_rank, {k: _kernel(k) for k in args.kernels}
    for w in args.worlds:
        for p in args.programs:
            _norm_launch.programs_per_rank = default if p == 0 else (lambda g, p=p: p)
            for name, kernel in kernels.items():  # (a fresh world each: its own plans)
                _norm_launch.ar_rmsnorm_kernel = kernel
                rows = launch(_norm_body, w, args=((1, 8, 32), (4096, 8192)))[0]
                for t, h, fused, ar, comp in rows:
                    print(f"norm {name} W={w} P={p or 'rule'} T={t} H={h}: fused "
                          f"{fused:.2f} us, all_reduce {ar:.2f}, composition {comp:.2f}, "
                          f"comp/fused {comp / fused:.3f}", flush=True)
    _norm_launch.programs_per_rank = default
    _norm_launch.ar_rmsnorm_kernel = kernels.get("head", _norm_launch.ar_rmsnorm_kernel)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("norm",))
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--programs", default="0,1,2,4")
    ap.add_argument("--kernels", default="head", help="comma-separated: head, or paths of "
                    "other copies of _norm_kernels.py, each timed in turn")
    args = ap.parse_args()
    args.worlds = [int(x) for x in args.worlds.split(",")]
    args.programs = [int(x) for x in args.programs.split(",")]
    args.kernels = args.kernels.split(",")
    warm_gpu(torch.device("cuda"))
    norm(args)


if __name__ == "__main__":
    main()
