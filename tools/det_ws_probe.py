"""Can the WS core serve deterministic mode? (issue 39, deliverable 1's last form; GPU, sm_90).

Two questions, on the ``gemm_sweep`` deterministic set's model shards:

1. Bits: per shard, the rows of the WS core's deterministic plan (one fixed config, data
   parallel: ``_ws_configs.plan(deterministic=True)``) at every M of ``DETERMINISTIC_M`` (and
   M 3, 17, 255, 1000) against the rows of the portable core's deterministic ``matmul`` (the
   skinny tiles at small M). Equal everywhere: a ``matmul`` may take the WS core above the
   skinny tiles' M and stay batch invariant across both cores.
2. Speed: paired graph replay of cuBLAS, the portable core's deterministic plan and the WS
   deterministic plan at M >= 256 (cuBLAS time / ours: > 1 is ours faster).

    PYTHONPATH=. python tools/det_ws_probe.py
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch

    from ditron_ops.runtime.virtual import launch
    launch(_probe, 1, torch.device("cuda", 0))
    return 0


def _probe(group) -> None:
    import torch

    from ditron_ops.bench.gemm_sweep import DETERMINISTIC_M, deterministic_shapes
    from ditron_ops.bench.harness import paired_graph_times
    from ditron_ops.gemm import _core, _ws_configs, _ws_launch

    dev = group.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shards = sorted({(n, k) for (_, n, k) in deterministic_shapes()})
    ms = sorted(set(DETERMINISTIC_M) | {3, 17, 255, 1000})
    bad, ratios_tl, ratios_ws = 0, {}, {}

    def ws_det(a, b):
        m, k = a.shape
        p = _ws_configs.plan(m, b.shape[1], k, 2, 2, sms, deterministic=True)
        return _ws_launch.ws_matmul(a, b, plan_=p)

    for n, k in shards:
        gen = torch.Generator().manual_seed(n * 3 + k)
        a_all = (torch.randn(max(ms), k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(dev)
        w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(torch.bfloat16).to(dev)
        b = w.t()
        full = _core.matmul(a_all, b, deterministic=True)
        mism = []
        for m in ms:
            a = a_all[:m].clone()
            tl_rows = _core.matmul(a, b, deterministic=True)
            ws_rows = ws_det(a, b)
            if not torch.equal(tl_rows, full[:m]):
                mism.append(f"tl@{m}")
            if not torch.equal(ws_rows, full[:m]):
                diff = (ws_rows.float() - full[:m].float()).abs().max().item()
                mism.append(f"ws@{m}({diff:.2e})")
        bad += bool(mism)
        print(f"bits {n}x{k}: " + ("equal at every M" if not mism else "DIFFER " + " ".join(mism)),
              flush=True)
        for m in (256, 1024, 8192):
            a = a_all[:m].clone()
            t = paired_graph_times(group, {"cublas": lambda: torch.matmul(a, b),
                                           "tl": lambda: _core.matmul(a, b, deterministic=True),
                                           "ws": lambda: ws_det(a, b)},
                                   rounds=3, target_ms=5)
            ratios_tl[(m, n, k)] = t["cublas"] / t["tl"]
            ratios_ws[(m, n, k)] = t["cublas"] / t["ws"]
            print(f"speed {m}x{n}x{k}: tl {ratios_tl[(m, n, k)]:.3f} ws "
                  f"{ratios_ws[(m, n, k)]:.3f}", flush=True)
    for name, r in (("tl", ratios_tl), ("ws", ratios_ws)):
        for lo, hi in ((256, 256), (1024, 8192)):
            sel = [v for (m, _, _), v in r.items() if lo <= m <= hi]
            geo = math.exp(sum(map(math.log, sel)) / len(sel))
            print(f"geo-mean {name} M {lo}-{hi}: {geo:.3f} (worst {min(sel):.3f})", flush=True)
    print(f"shards whose bits differ: {bad} of {len(shards)}")


if __name__ == "__main__":
    sys.exit(main())
