"""P2 alone: the fused path with every chunk / partial present (W=1) vs our plain GEMM on the
benches' model shapes, exactly as ``python -m ditron_ops.bench ag_gemm`` / ``gemm_rs`` measure
it (``_present`` for the default tile configuration / ``present``), for quick A/B runs:
``PYTHONPATH=. python tools/present.py ag_gemm|gemm_rs``."""
import pathlib
import sys

import torch

from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
from ditron_ops.gemm import _core
from ditron_ops.bench import ag_gemm, gemm_rs
from ditron_ops.bench.harness import BenchConfig, warm_gpu
from ditron_ops.runtime.virtual import launch

cfg = BenchConfig((1,), torch.bfloat16, "bf16", False, torch.device("cuda", 0),
                  pathlib.Path("/tmp"), 12, 25.0)
OPS = {"ag_gemm": lambda g, rows: ag_gemm._present(g, cfg, rows, [_core.GPU_CONFIG]),
       "gemm_rs": lambda g, rows: gemm_rs.present(g, cfg, rows)}


def body(group):
    warm_gpu(group.device)
    rows = []
    OPS[sys.argv[1]](group, rows)
    for r in rows:
        print(r.case, r.shape, f"ratio {r.ratio:.4f}", r.extra, flush=True)


if len(sys.argv) != 2 or sys.argv[1] not in OPS:
    raise SystemExit(f"usage: python tools/present.py {'|'.join(OPS)}")
launch(body, 1, cfg.device)
