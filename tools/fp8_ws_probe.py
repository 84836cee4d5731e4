"""Quick GPU probe of the fp8 WS core (``gemm/_ws_scaled.py``) on a few model shards: each config
serving the scale mode against the portable core and ``torch._scaled_mm`` (row-wise) or bf16
cuBLAS (block-wise), and each config's largest difference from the portable core's product
(relative to its scale)::

    python tools/fp8_ws_probe.py [--shapes 2048x4096x4096,...]

Times: ``triton.testing.do_bench`` medians (CUDA graphs not used: a probe, not the bench; the
figures of record are ``python -m ditron_ops.bench fp8 --only tensor,row,block,ws``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = "2048x4096x4096,777x1536x2176,4096x7168x2048,8192x8192x3584,1000x14336x4096"


def main() -> None:
    import torch
    import triton.testing

    from ditron_ops.gemm import _ws_scaled, scaled

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    args = ap.parse_args()
    fp8 = torch.float8_e4m3fn
    dev = torch.device("cuda")
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        gen = torch.Generator().manual_seed(m + n + k)
        a = (torch.randn(m, k, generator=gen) * 4).to(fp8).to(dev)
        b = (torch.randn(n, k, generator=gen) * 4).to(fp8).to(dev).t()
        for mode in ("row", "block"):
            kb, nb = -(-k // 128), -(-n // 128)
            shapes = {"row": ((m, 1), (1, n)), "block": ((m, kb), (kb, nb))}[mode]
            sa, sb = (torch.rand(*s, generator=gen).add(0.5).to(dev) for s in shapes)
            sbk, sb_row = scaled._b_scales(sb, mode)
            sa_row = sa.shape[1]
            kind = scaled.MODES[mode]
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            ref = torch.empty_like(out)
            fns = {"tl": lambda: scaled.scaled_matmul(a, b, sa, sa_row, sbk, sb_row, kind, None,
                                                      ref, core="tl")}
            fns["tl"]()
            if mode == "row":
                fns["base"] = lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
            else:
                a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
                fns["base"] = lambda: torch.matmul(a16, b16)
            errs = {}
            names = _ws_scaled.configs_for(kind)
            for name in names:
                g = _ws_scaled.WsScaledGemm(a, b, out, None, sa, sbk, sa_row, sb_row, kind,
                                            name)
                out.fill_(float("nan"))
                g.run(a, b, out, None, sa, sbk)
                torch.cuda.synchronize()
                errs[name] = ((out.float() - ref.float()).abs().max()
                              / ref.float().abs().max()).item()
                fns[name] = lambda g=g: g.run(a, b, out, None, sa, sbk)
            t = {name: triton.testing.do_bench(fn, warmup=5, rep=40) for name, fn in fns.items()}
            base = "_scaled_mm" if mode == "row" else "bf16 cuBLAS"
            line = " ".join(f"{name} {t['base'] / t[name]:.3f} (err {errs[name]:.1e})"
                            for name in names)
            print(f"{shape} {mode}: x {base}: tl {t['base'] / t['tl']:.3f}  {line}", flush=True)


if __name__ == "__main__":
    main()
