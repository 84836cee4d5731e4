"""GPU tier: the WS core's fp8 form (``_ws_scaled``), each config the rule or a bench can pick,
exact on integer-valued e4m3 operands with power-of-two scales (every product, sum and scale
exact in fp32, C rounded once), and ``scaled_matmul``'s tuned choice against the float64
product of the dequantized operands."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _ws_scaled, scaled
from ditron_ops.testing.scaled_checks import check_close

from gemm_helpers import skip_unless_ws

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn


def _operands(m, n, k, mode, seed):
    """Integer fp8 ``a [M, K]``, the weight's ``b = w.t()``, power-of-two scales per ``mode``
    ("tensor", "row", "block") and the exact float64 product of the dequantized operands."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-3, 4, (m, k), generator=gen).float()
    w = torch.randint(-3, 4, (n, k), generator=gen).float()
    kb, nb = -(-k // 128), -(-n // 128)
    shapes = {"tensor": ((1, ), (1, )), "row": ((m, 1), (1, n)), "block": ((m, kb), (kb, nb))}
    sa, sb = (2.0 ** torch.randint(-1, 2, s, generator=gen).float() for s in shapes[mode])
    if mode == "block":
        a_deq = a * sa.repeat_interleave(128, 1)[:, :k]
        w_deq = w * sb.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n].t()
    else:
        a_deq, w_deq = a * sa.reshape(-1, 1), w * sb.reshape(-1, 1)
    want = a_deq.double() @ w_deq.double().t()
    # rows on 16 bytes as the ops hand them over (K 1000, 4100: padded copies)
    a8 = scaled._aligned_rows(a.to(FP8).to(DEV))
    b = scaled.k_major(w.to(FP8).to(DEV).t())
    return a8, b, sa.to(DEV), sb.to(DEV), want.to(DEV)


def _kernel_scales(sa, sb, mode):
    """``(sa, sa_row, sb, sb_row, SCALE)`` as ``scaled_matmul`` hands them to a kernel."""
    sbk, sb_row = scaled._b_scales(sb, mode)
    sa_k = sa.reshape(1) if mode == "tensor" else sa
    sa_row = 0 if mode == "tensor" else sa.shape[1]
    return sa_k, sa_row, sbk, sb_row, scaled.MODES[mode]


SHAPES = [(512, 1024, 1024), (200, 384, 128), (33, 136, 1000), (1000, 1000, 4100)]


@pytest.mark.parametrize("config,mode", [
    (c, mode) for c, cfg in _ws_scaled.SCALED_CONFIGS.items()
    for mode in ("tensor", "row", "block") if scaled.MODES[mode] in cfg.modes])
def test_every_config_is_exact(config, mode):
    """Each config and scale mode, C in bf16 / fp16 / fp32, with and without bias, on M off the
    tiles (33, 200, 1000), N off 128 (136, 1000; block tails), K of one step (128) and off
    steps (1000, 4100), back to back on one plan (new operand values); 3 programs, so each
    takes many tiles (ring phases across tiles, both consumers, a partner-less last
    ping-pong unit)."""
    skip_unless_ws()
    for (m, n, k), dtype, with_bias in itertools.product(
            SHAPES, (torch.bfloat16, torch.float16, torch.float32), (False, True)):
        a8, b, sa, sb, want = _operands(m, n, k, mode, seed=m + n + k)
        bias = (torch.arange(n, device=DEV) % 7 - 3).to(dtype) if with_bias else None
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        sa_k, sa_row, sbk, sb_row, scale = _kernel_scales(sa, sb, mode)
        gemm = _ws_scaled.WsScaledGemm(a8, b, out, bias, sa_k, sbk, sa_row, sb_row, scale,
                                       config, sms=3)
        for i in range(2):
            if i:  # new values in the same tensors
                a8.copy_((a8.float() * -1).to(FP8))
                want = -want
            gemm.run(a8, b, out, bias, sa_k, sbk)
            exact = want + (bias.double() if with_bias else 0)
            torch.cuda.synchronize()
            assert torch.equal(out, exact.to(dtype)), (config, mode, m, n, k, dtype, with_bias, i)


@pytest.mark.parametrize("mode", ["tensor", "row", "block"])
def test_scaled_matmul_on_either_core(mode):
    """``scaled_matmul`` (the default mode: the core its timing keeps) and each WS config
    serving the mode (``p2``'s longer fp8 accumulation faces this bound) on random operands:
    within e4m3 products and one bf16 rounding of the float64 product of the dequantized
    operands, K up to 7168."""
    skip_unless_ws()
    for m, n, k in [(2048, 4096, 4096), (777, 1536, 2176), (4096, 7168, 7168)]:
        gen = torch.Generator().manual_seed(m)
        a8 = (torch.randn(m, k, generator=gen) * 4).to(FP8).to(DEV)
        b = (torch.randn(n, k, generator=gen) * 4).to(FP8).to(DEV).t()
        kb, nb = -(-k // 128), -(-n // 128)
        shapes = {"tensor": ((1, ), (1, )), "row": ((m, 1), (1, n)),
                  "block": ((m, kb), (kb, nb))}[mode]
        sa, sb = (torch.rand(*s, generator=gen).add(0.5).to(DEV) for s in shapes)
        if mode == "block":
            a_deq = a8.double() * sa.double().repeat_interleave(128, 1)[:, :k]
            b_deq = (b.double() * sb.double().repeat_interleave(128, 0)[:k]
                     .repeat_interleave(128, 1)[:, :n])
        else:
            a_deq = a8.double() * sa.double().reshape(-1, 1)
            b_deq = b.double() * sb.double().reshape(1, -1)
        sa_k, sa_row, sbk, sb_row, scale = _kernel_scales(sa, sb, mode)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        name = scaled.scaled_core(a8, b, sa_k, sa_row, sbk, sb_row, scale, None, out)
        outs = [(out, name)]
        for config in _ws_scaled.configs_for(scale):
            outs.append((torch.empty_like(out), config))
            _ws_scaled.WsScaledGemm(a8, b, outs[-1][0], None, sa_k, sbk, sa_row, sb_row, scale,
                                    config).run(a8, b, outs[-1][0], None, sa_k, sbk)
        for got, who in outs:
            try:  # one rounding to bf16 plus fp32 sums of the products (|A| @ |B| bound)
                check_close(got, a_deq, b_deq)
            except AssertionError as exc:
                raise AssertionError(f"{mode} {m}x{n}x{k} {who}: {exc}") from None


def test_scaled_matmul_keeps_the_ws_plan_where_timing_prefers_it(monkeypatch):
    """With the timing's verdict forced to the WS core, ``scaled_matmul`` runs it (its plan
    named ``ws:``, the product exact); forced to the portable core, it runs that (``tl``)."""
    skip_unless_ws()
    from ditron_ops.gemm import _tune
    for prefer, prefix in ((True, "ws:"), (False, "tl")):
        monkeypatch.setattr(_tune, "prefer_ws", lambda t_tl, t_ws, p=prefer: p)
        m, n, k = 640 + prefer, 768, 512  # (a new shape per verdict: a new plan)
        a8, b, sa, sb, want = _operands(m, n, k, "row", seed=5)
        out = torch.empty(m, n, dtype=torch.float32, device=DEV)
        sa_k, sa_row, sbk, sb_row, scale = _kernel_scales(sa, sb, "row")
        name = scaled.scaled_core(a8, b, sa_k, sa_row, sbk, sb_row, scale, None, out)
        assert name.startswith(prefix), (prefer, name)
        torch.cuda.synchronize()
        assert torch.equal(out, want.float()), name
