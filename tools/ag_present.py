"""ag_gemm P2 alone (W=1, every chunk present) for the default tile configuration, as in
``python -m ditron_ops.bench ag_gemm`` (``_present``): ``PYTHONPATH=. python tools/ag_present.py``."""
import pathlib

import torch

from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
from ditron_ops.ag_gemm import _launch
from ditron_ops.bench.ag_gemm import _present
from ditron_ops.bench.harness import BenchConfig, warm_gpu
from ditron_ops.runtime.virtual import launch

cfg = BenchConfig((1,), torch.bfloat16, "bf16", False, torch.device("cuda", 0),
                  pathlib.Path("/tmp"), 12, 25.0)


def body(group):
    warm_gpu(group.device)
    rows = []
    _present(group, cfg, rows, [_launch.GPU_CONFIG])
    for r in rows:
        print(r.case, r.shape, f"ratio {r.ratio:.4f}", r.extra, flush=True)


launch(body, 1, cfg.device)
