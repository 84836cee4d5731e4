"""What A's and B's row alignment costs the GEMM core (GPU): shapes whose K is 8 past a
multiple of 16 (bf16 rows of ``K x 2`` bytes then start 16 bytes off a 32-byte sector), timed
with the operands as they come and with their rows copied to a padded pitch, paired with cuBLAS
on both, and the copies themselves.

Why: the sweep's K-misaligned shapes trail (geo-mean x cuBLAS about 0.80 against 0.84), and the
forced-configuration data show 128x128 and 64x256 tiles 0.70-0.84x as fast as 128x256 there
against 0.98-1.06x with K on 16 (benchmarks/NOTES.md, GEMM core, "Operand row alignment").

Usage (GPU machine): ``python benchmarks/probes/align_probe.py --csv out.csv`` (``--shapes MxNxK,...``).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ditron_ops.bench import gemm_sweep
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import _MATMUL_PLANS, matmul, program_budget
from ditron_ops.gemm._pad import RowPad
from ditron_ops.runtime.virtual import launch
from invariant_configs import print_gains, write_csv  # (this folder: the script's)

SEEDS = range(301, 340)
"""Seeds of the drawn shapes beside the sweep's own (``gemm_sweep.SEED``)."""
FRESH_SEEDS = range(401, 440)
"""Seeds of ``--fresh`` shapes (``_core_configs.MISALIGNED_SLOWDOWN`` was fitted to the sweep's
and ``SEEDS``' shapes)."""


def misaligned(count: int, fresh: bool = False) -> list[tuple[int, int, int]]:
    """The sweep's shapes with ``K % 16 == 8``, then drawn ones of ``SEEDS``, ``count`` in all
    (``fresh``: drawn ones of ``FRESH_SEEDS`` only, shapes the constants were not fitted to)."""
    out = [] if fresh else [s for s in gemm_sweep.sweep_shapes() if s[2] % 16 == 8]
    for seed in FRESH_SEEDS if fresh else SEEDS:
        for s in gemm_sweep.sweep_shapes(seed=seed):
            if len(out) >= count:
                return out
            if s[2] % 16 == 8 and s not in out:
                out.append(s)
    return out


def _plan():
    """This thread's last ``matmul`` plan."""
    return next(reversed(_MATMUL_PLANS.cache._plans.values()))


def padded(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t [R, C]`` copied into rows of pitch ``C`` rounded up to ``multiple`` (a view)."""
    rows, cols = t.shape
    buf = t.new_zeros((rows, -(-cols // multiple) * multiple))[:, :cols]
    return buf.copy_(t)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--shapes", default="")
    p.add_argument("--fresh", action="store_true", help="shapes of FRESH_SEEDS only")
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    given = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    rows = []

    def body(group):
        warm_gpu(group.device)
        budget = program_budget(group.device, None)
        for m, n, k in given or misaligned(args.count, args.fresh):
            a, b = gemm_sweep._inputs(group, m, n, k, torch.bfloat16)
            w = b.t()
            a64, w64 = padded(a, 64), padded(w, 64)
            a16, w16 = padded(a, 16), padded(w, 16)
            b64, b16 = w64.t(), w16.t()
            old, split = rules.select_split(m, n, k, budget, group.device, deterministic=False)
            matmul(a, b, deterministic=False)
            plan = _plan()
            pads = "".join(x for x, c in (("A", plan.a_copy), ("B", plan.b_copy)) if c)
            pad_a, pad_b = RowPad(a), RowPad(w)
            fns = {
                "cublas": lambda: torch.matmul(a, b),
                "cublas_pad": lambda: torch.matmul(a64, b64),
                "rule": lambda: matmul(a, b, deterministic=False),
                "unpadded": lambda: matmul(a, b, cfg=old.cfg, split_k=split,
                                           deterministic=False),
                "rule_padA": lambda: matmul(a64, b, deterministic=False),
                "rule_padB": lambda: matmul(a, b64, deterministic=False),
                "rule_pad": lambda: matmul(a64, b64, deterministic=False),
                "rule_pad16": lambda: matmul(a16, b16, deterministic=False),
                "copyA": lambda: a64.copy_(a),
                "copyB": lambda: w64.copy_(w),
                "rowpadA": lambda: pad_a(a),
                "rowpadB": lambda: pad_b(w),
            }
            ref = (a.float() @ b.float())
            errs = {name: ((fns[name]().float() - ref).abs().max() / ref.abs().max()).item()
                    for name in ("rule", "unpadded", "rule_pad")}
            t = paired_graph_times(group, fns, rounds=5, target_ms=6.0)
            copies = ("copyA", "copyB", "rowpadA", "rowpadB")
            row = dict(m=m, n=n, k=k, rule=plan.name, pads=pads or "-",
                       unpadded=old.name, max_err=f"{max(errs.values()):.1e}",
                       gain=round(t["unpadded"] / t["rule"], 4),
                       **{f"{name}_x": round(t["cublas"] / t[name], 4)
                          for name in fns if name not in ("cublas",) + copies},
                       **{f"{name}_us": round(t[name], 2) for name in copies},
                       rule_us=round(t["rule"], 2), rule_pad_us=round(t["rule_pad"], 2))
            rows.append(row)
            print(row, flush=True)
        print_gains("align_probe, copied", [r["gain"] for r in rows if r["pads"] != "-"],
                    f" of {len(rows)}")
        return True

    launch(body, 1)
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
