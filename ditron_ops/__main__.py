"""``python -m ditron_ops``: detect the hardware, self-check every op, print a short table.

Default: a virtual world of 4 ranks on the GPU if there is one, else 2 ranks on the CPU with the
kernels in the Triton interpreter (plus the torch reference path they are compared with).

Under ``torchrun`` (``WORLD_SIZE > 1``) every process is one rank instead: on GPUs the nvshmem
backend (when nvshmem4py is installed, else the torch backend over NCCL), on CPUs the torch
backend over gloo; rank 0 prints the table::

    torchrun --nproc-per-node 8 -m ditron_ops

``python -m ditron_ops precompile [--ops OP ...] [--dtypes DT ...]`` compiles every kernel
variant of the ops into the Triton cache (``TRITON_CACHE_DIR``) ahead of time, for deployment
images and CI; without it each call compiles what it needs on first use.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from . import _env
from .runtime.torchrun import under_torchrun
from .runtime.virtual import launch
from .selfcheck import run_checks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["precompile"]:
        return _precompile(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m ditron_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="virtual ranks (default 4 GPU, 2 CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default bf16 on GPU, fp32 on CPU")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    if under_torchrun():
        return _distributed(args)
    _env.prepare_cuda_for_virtual_ranks()
    gpu = torch.cuda.is_available() and not _env.use_interpreter()
    device = "cuda" if gpu else "cpu"
    if args.dtype == "bf16" and not gpu:
        parser.error("--dtype bf16 needs a GPU (the Triton interpreter's bf16 arithmetic is "
                     "wrong); use fp16 or fp32 on CPU")
    world = args.world_size if args.world_size is not None else 4 if gpu else 2
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    where = (f"GPU {torch.cuda.get_device_name()} (compiled Triton kernels)" if gpu
             else "CPU (Triton interpreter; torch reference as the oracle)")
    print(f"ditron_ops self-check: {where}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"virtual world of {world} ranks, dtype {str(dtype).replace('torch.', '')}\n")
    rows = launch(run_checks, world, device=device, args=(dtype, 5 if gpu else 2))[0]
    return _report(rows, world)


def _precompile(argv) -> int:
    from .runtime.precompile import DTYPE_NAMES, families, precompile

    ops = sorted({op for serves in families().values() for op in serves} | set(families()))
    parser = argparse.ArgumentParser(prog="python -m ditron_ops precompile",
                                     description="Compile every kernel variant into the Triton "
                                                 "cache (TRITON_CACHE_DIR), in parallel.")
    parser.add_argument("--ops", nargs="+", choices=ops, default=None, metavar="OP",
                        help=f"ops or families (default all): {', '.join(ops)}")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPE_NAMES), default=None,
                        help="default all")
    args = parser.parse_args(argv)
    got = precompile(args.ops, args.dtypes)
    if got["device"] is None:
        print(f"ditron_ops precompile: nothing to compile on this machine (no GPU: kernels run in "
              f"the Triton interpreter); families: {', '.join(got['families'])}")
        return 0
    print(f"ditron_ops precompile: {got['kernels']} kernel variant(s) compiled or loaded from the "
          f"Triton cache in {got['seconds']:.1f} s on {got['device']} "
          f"({', '.join(got['families'])})")
    return 0


def _report(rows, world: int) -> int:
    print(f"{'op':<22} {'world':>5} {'max |err|':>10} {'ok':>6} {'time/call':>12}")
    for name, err, t_us, exact in rows:
        print(f"{name:<22} {world:>5} {err:>10.3g} {str(exact):>6} {t_us:>10.1f}us")
    ok = all(exact for *_, exact in rows)
    print("\nall ops match the reference (collectives bitwise, GEMMs within their dtype's tolerance)"
          if ok else "\nMISMATCH against the reference")
    return 0 if ok else 1


def _distributed(args) -> int:
    """One rank per process (torchrun): nvshmem on GPUs when available, else torch.distributed."""
    from .runtime.torchrun import torchrun_group

    with torchrun_group() as group:
        gpu = group.device.type == "cuda"
        dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
        if group.rank == 0:
            print(f"ditron_ops self-check: {group.world_size} processes, {group.backend} backend, "
                  f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU'}; torch {torch.__version__}, "
                  f"triton {triton.__version__}; dtype {str(dtype).replace('torch.', '')}\n")
        rows = run_checks(group, dtype, 5 if gpu else 2)
    return _report(rows, group.world_size) if group.rank == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
