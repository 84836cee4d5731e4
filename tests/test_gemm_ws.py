"""The experimental warp-specialized GEMM (``gemm._ws``) in the Triton interpreter, which runs
``tl.range(warp_specialize=True)`` as a plain loop: ``ws_matmul`` against torch on small fp32 /
fp16 shapes (several tiles per program, ragged edges, both B layouts, operands and outputs no
descriptor reads as they are), the stage fit, the ``--only ws`` bench rows, and no production
module importing it."""
import csv
import subprocess
import sys

import pytest
import torch

from ditron_ops.gemm._core_configs import TileConfig
from ditron_ops.gemm._ws import WS_VARIANTS, WsVariant, ws_stages, ws_matmul

SMALL = {"ws": WsVariant(TileConfig(16, 32, 16, 2, 4, 2)),
         "nows": WsVariant(TileConfig(32, 16, 16, 4, 8, 2), warp_specialize=False)}
"""Small tiles: the interpreter's one program then runs many tiles (the persistent loop)."""


def _check(got, a, b, dtype):
    ref = a.float() @ b.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SMALL))
def test_ws_matmul_matches_torch(name, dtype):
    """M, N off the tiles, K off BLOCK_K; B as ``w.t()`` and as ``[K, N]``."""
    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((40, 48, 72), (33, 80, 136), (16, 32, 16)):
        a = torch.randn(m, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        for b in (w.t(), w.t().contiguous()):
            _check(ws_matmul(a, b, SMALL[name]), a, b, dtype)


def test_ws_matmul_pads_what_no_descriptor_reads():
    """A with an unaligned row pitch, B strided both ways, a column-major fp32 output: padded
    copies in, a staged C out; repeated calls reuse the plan with new values."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(24, 38, generator=gen, dtype=torch.float16)[:, :37]  # pitch 76 bytes
    b = torch.randn(37, 60, generator=gen, dtype=torch.float16)[:, ::2]  # strides (60, 2)
    out = torch.empty(30, 24, dtype=torch.float32).t()  # [24, 30] column-major
    for _ in range(2):
        got = ws_matmul(a, b, SMALL["ws"], out=out)
        assert got is out
        _check(out, a, b, torch.float16)
        a.mul_(-1)


def test_gpu_variants_in_the_interpreter():
    """Every ``WS_VARIANTS`` entry (the GPU's tiles) on a tiny shape, and the empty cases."""
    a = torch.randn(40, 72, dtype=torch.float16)
    w = torch.randn(48, 72, dtype=torch.float16)
    for name in WS_VARIANTS:
        _check(ws_matmul(a, w.t(), name), a, w.t(), torch.float16)
    assert ws_matmul(a[:, :0], w.t()[:0]).eq(0).all()
    assert ws_matmul(a[:0], w.t()).shape == (0, 48)
    with pytest.raises(TypeError, match="share a dtype"):
        ws_matmul(a, w.t().float())


def test_ws_stages():
    """The H200's 232,448 bytes: 128x256 keeps 3 stages with bf16 C (213,464 compiled), fp32 C
    drops it to 2; tiles whose fp32 C alone fills shared memory raise."""
    limit = 232448
    cfg = WS_VARIANTS["ws/128x256x64/s3"].cfg
    assert ws_stages(cfg, 2, 2, limit) == cfg
    assert ws_stages(cfg, 2, 4, limit).num_stages == 2
    assert ws_stages(WS_VARIANTS["ws/128x128x64/s6"].cfg, 2, 4, limit).num_stages == 5
    with pytest.raises(ValueError, match="does not fit"):
        ws_stages(TileConfig(256, 256, 64, 8, 4, 3), 2, 4, limit)


def test_bench_ws_quick_writes_rows(tmp_path):
    """``bench gemm_sweep --only ws`` (interpreter plumbing): per shape the rule and every
    variant with a small error, then a geo-mean row per impl."""
    from ditron_ops.bench.__main__ import main

    assert main(["gemm_sweep", "--quick", "--only", "ws", "--rounds", "1",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("gemm_sweep-*.csv")))))
    impls = ["rule", *WS_VARIANTS]
    shapes = [r for r in rows if r["shape"] != "geo-mean"]
    assert len(shapes) == 3 * len(impls) and {r["case"] for r in rows} == {"ws fp16"}
    assert [r["impl"] for r in shapes[:len(impls)]] == impls
    assert all(float(r["rel_err"]) < 1e-2 for r in shapes)
    assert [r["impl"] for r in rows if r["shape"] == "geo-mean"] == impls


def test_no_production_module_imports_it():
    """``import ditron_ops`` (every op, the rule) leaves the experiment unloaded."""
    code = ("import sys, ditron_ops, ditron_ops.gemm._core; "
            "assert 'ditron_ops.gemm._ws' not in sys.modules; "
            "assert 'ditron_ops.gemm._ws_kernels' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ws_matmul_refuses_bad_shapes_before_launch():
    a = torch.ones(4, 8)
    with pytest.raises(ValueError, match="b \\[K, N\\]"):
        ws_matmul(a, torch.ones(7, 3))
    with pytest.raises(ValueError, match="out must be"):
        ws_matmul(a, torch.ones(8, 3), out=torch.empty(4, 4))


def test_ws_plans_are_per_thread():
    """Virtual ranks are threads: each gets its own plans (padded copies, descriptor scratch)."""
    import threading
    from ditron_ops.gemm import _ws
    a, b = torch.ones(4, 8), torch.ones(8, 3)
    v = WsVariant(TileConfig(16, 16, 16, 4, 4, 1))
    ws_matmul(a, b, v)
    caches = [_ws._PLANS.cache]
    t = threading.Thread(target=lambda: (ws_matmul(a, b, v), caches.append(_ws._PLANS.cache)))
    t.start()
    t.join()
    assert len(caches) == 2 and caches[0] is not caches[1]
