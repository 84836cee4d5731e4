"""gemm_rs P2 alone (W=1, deterministic, every partial present) vs our plain GEMM, paired graph
timing, on the bench's model shapes: ``PYTHONPATH=. python tools/rs_present.py``."""
import torch

from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
from ditron_ops.ag_gemm import matmul
from ditron_ops.bench.gemm_rs import _inputs, _shapes
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.bench.shapes import DEFAULT_M
from ditron_ops.gemm_rs import gemm_rs
from ditron_ops.runtime.virtual import launch


def body(group):
    warm_gpu(group.device)
    for (k, n), models in _shapes(False).items():
        a, b = _inputs(DEFAULT_M, k, n, torch.bfloat16, group.device)
        t = paired_graph_times(group, {
            "plain": lambda: matmul(a, b),
            "fused": lambda: gemm_rs(a, b, group, deterministic=True, impl="fused")},
            rounds=12, target_ms=25)
        print(f"{DEFAULT_M}x{n}x{k} {models}: plain {t['plain']:.1f}us fused {t['fused']:.1f}us "
              f"overhead {100 * (t['fused'] / t['plain'] - 1):.2f}%", flush=True)


launch(body, 1, torch.device("cuda", 0))
