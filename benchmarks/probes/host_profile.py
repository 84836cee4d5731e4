"""Where an eager call's host time goes (run on a GPU machine, one rank): per op, the calls of
``bench.overhead`` timed, then profiled with cProfile; the top functions by own time.

    PYTHONPATH=. python benchmarks/probes/host_profile.py [calls=500] [top=14] [ops=ag_gemm/fused,...]
"""
import cProfile
import pstats
import sys
import time

from ditron_ops import _env

_env.prepare_cuda_for_virtual_ranks()
import torch  # noqa: E402

import ditron_ops  # noqa: E402
from ditron_ops.bench.overhead import _ops  # noqa: E402

args = dict(a.split("=", 1) for a in sys.argv[1:])
CALLS, TOP = int(args.get("calls", 500)), int(args.get("top", 14))
ONLY = [s for s in args.get("ops", "").split(",") if s]


def body(group):
    ops = _ops(group, torch.bfloat16 if group.device.type == "cuda" else torch.float32)
    for name, op in ops.items():
        if ONLY and name not in ONLY:
            continue
        for _ in range(20):
            op()
        group.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            op()
        group.synchronize()
        per_call = (time.perf_counter() - t0) / CALLS * 1e6
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            op()
        prof.disable()
        group.synchronize()
        print(f"\n=== {name}: {per_call:.1f} us per eager call (unprofiled)", flush=True)
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:TOP]
        for (path, line, fn), (cc, nc, tt, ct, _) in rows:
            where = f"{path.rsplit('/', 2)[-2:] if '/' in path else path}:{line}"
            print(f"  {tt / CALLS * 1e6:7.2f} us own {ct / CALLS * 1e6:7.2f} us cum "
                  f"{nc / CALLS:5.1f}x  {fn}  {where}", flush=True)


ditron_ops.launch(body, 1)
