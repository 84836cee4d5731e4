"""``python -m ditron_ops``: detect the hardware, self-check every op, print a short table.

Default: a virtual world of 4 ranks on the GPU if there is one, else 2 ranks on the CPU with the
kernels in the Triton interpreter (plus the torch reference path they are compared with).
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from . import _env
from .runtime.virtual import launch
from .selfcheck import run_checks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditron_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="virtual ranks (default 4 GPU, 2 CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default bf16 on GPU, fp32 on CPU")
    args = parser.parse_args(argv)
    _env.prepare_cuda_for_virtual_ranks()
    gpu = torch.cuda.is_available() and not _env.use_interpreter()
    device = "cuda" if gpu else "cpu"
    world = args.world_size or (4 if gpu else 2)
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    where = (f"GPU {torch.cuda.get_device_name()} (compiled Triton kernels)" if gpu
             else "CPU (Triton interpreter; torch reference as the oracle)")
    print(f"ditron_ops self-check: {where}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"virtual world of {world} ranks, dtype {str(dtype).replace('torch.', '')}\n")
    rows = launch(run_checks, world, device=device, args=(dtype, 5 if gpu else 2))[0]
    print(f"{'op':<22} {'world':>5} {'max |err|':>10} {'ok':>6} {'time/call':>12}")
    for name, err, t_us, exact in rows:
        print(f"{name:<22} {world:>5} {err:>10.3g} {str(exact):>6} {t_us:>10.1f}us")
    ok = all(exact for *_, exact in rows)
    print("\nall ops match the reference (collectives bitwise, GEMMs within their dtype's tolerance)"
          if ok else "\nMISMATCH against the reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
