"""``matmul(core="auto")``'s choice between the portable and the warp-specialized core: both
plans timed once on the call's tensors when the plan is built (``_core._MatmulPlan``).

Neither core wins everywhere (benchmarks/NOTES.md, the warp-specialized core), so the plan of
one key keeps the faster; a repeated call times nothing. The choice rests on timing, so in the
default mode the bits of a product may differ between processes (deterministic mode never
tunes).
"""
from __future__ import annotations

import os

import torch

TUNE_CORES = os.environ.get("DITRON_GEMM_TUNE", "1") != "0"
"""``core="auto"`` times both cores where the WS core takes the product (``DITRON_GEMM_TUNE=0``:
the portable core only, nothing timed)."""
TUNE_MARGIN = 0.97
"""The WS plan replaces the portable one only below this fraction of its time (timing noise
of a few calls is about 1-2%: a choice on noise would flip between processes)."""
TUNE_SEGMENT_S, TUNE_ROUNDS = 200e-6, 4
"""``time_alternating``: GPU time per timed segment (its calls from a first estimate) and
segments per plan."""


def prefer_ws(t_tl: float, t_ws: float) -> bool:
    """Whether ``matmul(core="auto")`` keeps the WS plan given both plans' times."""
    return t_ws < TUNE_MARGIN * t_tl


def time_alternating(fns, device: torch.device) -> list[float]:
    """Per function its best segment's GPU time per call (seconds). One warm and one timed
    call each (the estimate), then ``TUNE_ROUNDS`` segments of each in turn, back to back on
    the current stream with CUDA events between them and one synchronize at the end: the
    host queues calls faster than the GPU runs them, so segments after the first see no
    launch gaps (a synchronize per segment times the launches too)."""
    stream = torch.cuda.current_stream(device)

    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    est = []
    for fn in fns:
        fn()
        start = event()
        fn()
        end = event()
        end.synchronize()
        est.append(start.elapsed_time(end) * 1e-3)
    calls = [max(2, min(64, int(TUNE_SEGMENT_S / max(t, 1e-6)) + 1)) for t in est]
    marks = [event()]
    for _ in range(TUNE_ROUNDS):
        for fn, n in zip(fns, calls):
            for _ in range(n):
                fn()
            marks.append(event())
    marks[-1].synchronize()
    best = [float("inf")] * len(fns)
    for seg in range(TUNE_ROUNDS * len(fns)):
        i = seg % len(fns)
        best[i] = min(best[i], marks[seg].elapsed_time(marks[seg + 1]) * 1e-3 / calls[i])
    return best
