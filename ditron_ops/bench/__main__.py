"""Command line: ``python -m ditron_ops.bench {list | plot CSV... | <bench>} [options]``.

Examples::

    python -m ditron_ops.bench list
    python -m ditron_ops.bench plot benchmarks/results/ag_gemm-bf16-cuda.csv   # PNG from a CSV
    python -m ditron_ops.bench collectives --world-sizes 2,4,8 --dtype bf16
    python -m ditron_ops.bench overhead --quick --out /tmp/bench_out

Options of every bench: ``--world-sizes`` (comma list; default per bench), ``--dtype``
(bf16, fp16, fp32), ``--out`` (default ``benchmarks/results``), ``--quick`` (tiny sizes, few
repetitions: a CPU smoke run), ``--device`` (cuda or cpu; default cuda when a GPU is used),
``--rounds`` and ``--target-ms`` (timing).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import _env
from ..runtime.torchrun import select_local_device
from . import harness
from .harness import (DTYPES, IMPORT_ERRORS, BenchConfig, discover, finish, plot_ratios,
                      plot_title, read_csv, warm_gpu)


def default_device() -> torch.device:
    """``cuda`` when this process uses a GPU, else ``cpu`` (kernels in the Triton interpreter)."""
    if not _env.use_interpreter() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-sizes must be comma-separated ints, got {text!r}")
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes must be positive ints, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    """The parser: ``list`` plus one subcommand per registered bench."""
    benches = discover()
    parser = argparse.ArgumentParser(prog="python -m ditron_ops.bench",
                                     description="ditron_ops benchmarks (CSV + PNG + table).")
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{list," +
                                ",".join(benches) + "}")
    sub.add_parser("list", help="list the registered benches")
    plot = sub.add_parser("plot", help="(re)draw the PNG of bench CSVs, next to each CSV")
    plot.add_argument("csv", type=Path, nargs="+")
    for name, bench in benches.items():
        p = sub.add_parser(name, help=bench.help, description=bench.help)
        p.add_argument("--world-sizes", type=_world_sizes, default=None,
                       help=f"comma list of virtual world sizes (default "
                            f"{','.join(map(str, bench.world_sizes))}; --quick: "
                            f"{','.join(map(str, bench.quick_world_sizes))})")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
        p.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                       help="output folder for the CSV and PNG (default benchmarks/results)")
        p.add_argument("--quick", action="store_true",
                       help="tiny sizes and few repetitions (CPU-friendly smoke run)")
        p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                       help="default: cuda when this process uses a GPU, else cpu (interpreter)")
        p.add_argument("--rounds", type=int, default=None,
                       help="timed rounds per measurement, median reported (default 10; quick 3)")
        p.add_argument("--target-ms", type=float, default=None,
                       help="duration of one timed round (default 25 ms; quick 1 ms)")
        p.add_argument("--only", default="",
                       help="comma list narrowing the bench's cases where it offers that "
                            "(tp: ag_gemm,gemm_rs,gemm_ar,flash_decode)")
        p.add_argument("--timing", choices=("graph", "eager"), default="graph",
                       help="multi-GPU benches: time CUDA-graph replays (default) or eager calls")
        p.add_argument("--lowp-partials", action="store_true",
                       help="experimental: gemm_rs/gemm_ar partials in the input dtype")
        p.add_argument("--commit", default=None,
                       help="commit to record in the CSV (default: git of the source tree)")
    return parser


def _config(args: argparse.Namespace) -> BenchConfig:
    bench = discover()[args.bench]
    device = default_device() if args.device is None else torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = args.world_sizes or (bench.quick_world_sizes if args.quick else bench.world_sizes)
    return BenchConfig(world_sizes=sizes, dtype=DTYPES[args.dtype], dtype_name=args.dtype,
                       quick=args.quick, device=device, out_dir=args.out,
                       rounds=args.rounds or (3 if args.quick else 10),
                       target_ms=args.target_ms or (1.0 if args.quick else 25.0),
                       only=tuple(s for s in args.only.split(",") if s), timing=args.timing,
                       lowp_partials=args.lowp_partials)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = build_parser().parse_args(argv)
    from .. import _env

    _env.prepare_cuda_for_virtual_ranks()  # before CUDA starts (see its docstring)
    select_local_device()  # under torchrun: this process's GPU before anything touches CUDA
    benches = discover()
    if args.bench == "list":
        width = max(map(len, benches), default=4)
        for name, bench in benches.items():
            print(f"{name.ljust(width)}  {bench.help}")
        for module, err in IMPORT_ERRORS.items():
            print(f"{module.ljust(width)}  (failed to import: {err})")
        return 0
    if args.bench == "plot":
        for path in args.csv:
            results, machine = read_csv(path)
            if not results:
                print(f"{path}: no rows", file=sys.stderr)
                return 1
            first = results[0]
            title = plot_title(first.bench, first.dtype, machine.get("device_name", "?"), results)
            print(plot_ratios(results, path.with_suffix(".png"), title, machine) or "matplotlib missing")
        return 0
    cfg = _config(args)
    if args.commit:
        harness.COMMIT = args.commit
    if cfg.lowp_partials:  # before any group's warm-up, which compiles the variants in use
        from ..gemm import _rs_launch

        _rs_launch.LOWP_PARTIALS = True
    if cfg.device.type == "cpu" and not cfg.quick:
        print("note: CPU run without --quick; the Triton interpreter makes full sizes very slow",
              file=sys.stderr)
    warm_gpu(cfg.device)
    results = benches[args.bench].fn(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun benches: every rank measures, rank 0 writes
        finish(args.bench, results, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
