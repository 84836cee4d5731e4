"""Where ``ag_gemm_scaled`` / ``gemm_rs_scaled`` spend their time at one rank (fused path):
the packing of rows, each producer, the reducing op (default, and its producer on each core),
against the scaled core GEMM alone.

    python benchmarks/probes/fp8_fused_parts.py [--shapes 753x4096x7168,...]

Paired CUDA-graph replay (``harness.paired_graph_times``), one line per (shape, mode, part):
microseconds and the core's time over the part's.
"""
from __future__ import annotations

import argparse

import torch

from ditron_ops.bench.fp8 import _inputs, _ours
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.gemm import _ag_launch, _rs_launch
from ditron_ops.gemm.scaled import ag_gemm_scaled, gemm_rs_scaled, pack_rows, packed_row
from ditron_ops.runtime.virtual import launch

SHAPES = "753x4096x7168,1280x1152x3584,4096x4096x4096,2048x14336x4096"


def _torch_pack(a, sa, mode):
    """The packing before ``pack_rows_kernel``: two torch copies into the strided rows."""
    layout = packed_row(a.shape[1], mode)
    packed = torch.empty((a.shape[0], layout.pitch // 4), dtype=torch.float32, device=a.device)
    packed.view(torch.uint8)[:, :layout.k] = a.view(torch.uint8)
    lo = layout.scale_offset // 4
    packed[:, lo:lo + layout.scales] = sa.reshape(-1, 1) if mode == "tensor" else sa
    return packed


def _body(group, shapes, modes):
    lines = []
    for m, n, k in shapes:
        for mode in modes:
            a, b, sa, sb = _inputs(m, n, k, mode, group.device)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=group.device)

            def fused(producer):
                def call():
                    _ag_launch.PRODUCER = producer
                    return ag_gemm_scaled(a, b, sa, sb, group, out_dtype=out.dtype, impl="fused")
                return call

            def rs_on(core):  # gemm_rs_scaled with its producer on one core
                def call():
                    with _rs_launch.using_producer_core(core):
                        return gemm_rs_scaled(a, b, sa, sb, group, out_dtype=out.dtype,
                                              impl="fused")
                return call

            fns = {"core": _ours(a, b, sa, sb, mode, out),
                   "baseline": lambda: ag_gemm_scaled(a, b, sa, sb, group, out_dtype=out.dtype,
                                                      impl="baseline"),
                   "pack": lambda: pack_rows(a, sa, mode, group),
                   "pack torch": lambda: _torch_pack(a, sa, mode),
                   "fused copy": fused("copy"), "fused pull": fused("pull"),
                   "fused push": fused("push"),
                   "gemm_rs fused": lambda: gemm_rs_scaled(a, b, sa, sb, group,
                                                           out_dtype=out.dtype, impl="fused"),
                   "gemm_rs ws": rs_on("ws"), "gemm_rs tl": rs_on("tl")}
            times = paired_graph_times(group, fns, rounds=5, target_ms=4)
            _ag_launch.PRODUCER = "auto"
            for name, t in times.items():
                lines.append(f"{m}x{n}x{k} {mode:6s} {name:14s} {t:9.2f} us  core/this "
                             f"{times['core'] / t:.3f}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--modes", default="tensor,block")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    warm_gpu(torch.device("cuda"))
    for line in launch(_body, 1, args=(shapes, args.modes.split(",")))[0]:
        print(line, flush=True)


if __name__ == "__main__":
    main()
