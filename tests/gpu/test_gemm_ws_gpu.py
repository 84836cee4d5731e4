"""GPU tier: the warp-specialized sm_90 core (``gemm/_ws_*``) as ``matmul(core="ws")`` runs it.

Integer-valued operands in [-4, 4] make every product and partial sum exact in fp32, so each
result must equal the float64 product rounded once, whatever the schedule (data parallel,
stream-K with its fix-up, split-K in the kernel or by the second reduce kernel).
"""
import threading

import pytest
import torch

from ditron_ops.gemm import _core, _ws_configs, _ws_launch

from gemm_helpers import DEV, integer_cases, ints, last_plan  # (tests/gpu/)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
    or not _ws_launch.HAVE_GLUON, reason="the WS core needs sm_90 and Gluon")

SHAPES = [(1000, 2560, 2560), (517, 4480, 5120), (4808, 272, 14080), (129, 136, 72),
          (2100, 7000, 648), (3000, 1536, 4096), (512, 576, 4608), (40, 1024, 512)]
"""Ragged M, N, K; one tile column; one short K step; several waves; few-tile shapes the rule
gives to stream-K / split planes / narrow tiles; M just above the skinny tiles' bound."""

SCHEDULES = [("coop128x256", _ws_configs.MODE_DP, None), ("coop128x256", _ws_configs.MODE_SK, None),
             ("pp128x128", _ws_configs.MODE_DP, None), ("pp128x128", _ws_configs.MODE_SK, None),
             ("pp64x128", _ws_configs.MODE_DP, None), ("pp64x128", _ws_configs.MODE_SPLITR, 3),
             ("pp128x128", _ws_configs.MODE_SPLIT, 3), ("pp64x256", _ws_configs.MODE_DP, None),
             ("coop128x192", _ws_configs.MODE_DP, None)]
"""Every config of the rule with the schedules it can take (and the forced in-kernel split), and
the two-accumulator tile (192 columns as 128 + 64)."""


def _sms() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count


@pytest.mark.parametrize("m,n,k", [s for s in SHAPES if (s[2] * 2) % 32 == 0])
def test_matmul_on_the_ws_core_is_exact(m, n, k):
    """``matmul(core="ws")`` runs the WS rule's plan (``ws:`` names) on rows on sectors; its
    result is the exact product for both B layouts, with and without bias, bf16 and fp32 C;
    calls repeat bitwise."""
    a, bias = ints(m, k, seed=1), ints(n, seed=3)
    for layout, with_bias, b, want in integer_cases(a, bias, k, n):
        for out_dtype in (torch.bfloat16, torch.float32):
            out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEV)
            got = _core.matmul(a, b, bias=bias if with_bias else None, out=out,
                               deterministic=False, core="ws")
            assert last_plan().ws is not None, (m, n, k, layout)
            assert torch.equal(got, want.to(out_dtype)), (m, n, k, layout, with_bias, out_dtype)
            again = _core.matmul(a, b, bias=bias if with_bias else None,
                                 out=torch.empty_like(out), deterministic=False, core="ws")
            assert torch.equal(again, got)


@pytest.mark.parametrize("variant,mode,split", SCHEDULES, ids=lambda x: str(x))
def test_every_schedule_is_exact(variant, mode, split):
    """Each (config, schedule) forced on the shapes: the exact product (fix-ups included)."""
    for m, n, k in SHAPES[:6]:
        a, bias = ints(m, k, seed=4), ints(n, seed=5)
        for layout, with_bias, b, want in integer_cases(a, bias, k, n):
            p = _ws_configs.plan(m, n, k, 2, 2, _sms(), variant=variant, mode=mode, split=split)
            got = _ws_launch.ws_matmul(a, b, bias=bias if with_bias else None, plan_=p)
            assert torch.equal(got, want.to(torch.bfloat16)), (m, n, k, layout, with_bias,
                                                              _ws_configs.describe(p))


def test_refusals_raise_and_auto_stays_portable():
    """``core="ws"`` raises before any launch where the WS core refuses (rows off 32-byte
    sectors, small M, deterministic mode); ``core="auto"`` runs the ``tl`` core there."""
    k = 1016  # 2032-byte rows: on 16 bytes (TMA), off 32-byte sectors
    a, b = ints(512, k, seed=1), ints(256, k, seed=2).t()
    with pytest.raises(ValueError, match="sectors"):
        _core.matmul(a, b, deterministic=False, core="ws")
    a, b = ints(16, 512, seed=1), ints(256, 512, seed=2).t()
    with pytest.raises(ValueError, match="skinny"):
        _core.matmul(a, b, deterministic=False, core="ws")
    a = ints(512, 512, seed=1)
    if not _core.DET_ON_WS:
        with pytest.raises(ValueError, match="default mode"):
            _core.matmul(a, b, deterministic=True, core="ws")
    a, b = ints(512, k, seed=1), ints(256, k, seed=2).t()
    _core.matmul(a, b, deterministic=False)  # rows off sectors: nothing to tune
    assert last_plan().ws is None


def test_graph_replay_and_threads():
    """A captured WS ``matmul`` replays with new operand values; three threads (virtual ranks)
    running stream-K plans and their bound ``matmul(core="ws")`` plans at once each get their
    exact products (per-thread partials and plans)."""
    m, n, k = 3000, 1536, 4096
    a, b = ints(m, k, seed=1), ints(n, k, seed=2).t()
    out = _core.matmul(a, b, deterministic=False, core="ws")  # the plan, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _core.matmul(a, b, out=out, deterministic=False, core="ws")
    a.copy_(ints(m, k, seed=7))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (a.double() @ b.double()).to(torch.bfloat16))

    errors = []

    def body(seed):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                x, w = ints(m, k, seed=seed), ints(n, k, seed=seed + 1).t()
                p = _ws_configs.plan(m, n, k, 2, 2, _sms(), variant="coop128x256",
                                     mode=_ws_configs.MODE_SK)
                for _ in range(5):
                    got = _ws_launch.ws_matmul(x, w, plan_=p)
                    bound = _core.matmul(x, w, deterministic=False, core="ws")  # per-thread plan
                stream.synchronize()
                want = (x.double() @ w.double()).to(torch.bfloat16)
                if not (torch.equal(got, want) and torch.equal(bound, want)):
                    errors.append(seed)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=body, args=(10 * i, )) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("n,k", [(1536, 4096), (4480, 5120), (272, 14080), (1000, 4112),
                                 (1000, 1016)])
def test_deterministic_rows_carry_the_same_bits_on_both_cores(monkeypatch, n, k):
    """``DET_ON_WS``'s condition: on random (not integer) operands, the WS core's deterministic
    plan (its one fixed config, data parallel) gives every row the bits of the portable core's
    batch-invariant tiles, at every M (the skinny tiles at small M included), into the input
    dtype and into fp32, bf16 and fp16, B as ``w.t()`` and as ``[K, N]``, with and without
    bias (fp32 out with bias: deterministic gemm_rs's partials). K 1016: rows off sectors, the
    portable core alone (a control)."""
    monkeypatch.setattr(_core, "DET_ON_WS", True)
    monkeypatch.setattr(_core._MATMUL_PLANS, "cache", None, raising=False)  # (plans of this test)
    gen = torch.Generator(device="cpu").manual_seed(n + k)
    sectors = (k * 2) % 32 == 0
    for dtype, layout, with_bias in ((torch.bfloat16, "nk", False), (torch.bfloat16, "kn", True),
                                     (torch.float16, "nk", True)):
        a_all = (torch.randn(8192, k, generator=gen) / k ** 0.25).to(dtype).to(DEV)
        w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(dtype).to(DEV)
        b = w.t() if layout == "nk" else w.t().contiguous()
        bias = torch.randn(n, generator=gen).to(dtype).to(DEV) if with_bias else None
        for out_dtype in (dtype, torch.float32):
            ref = torch.empty(8192, n, dtype=out_dtype, device=DEV)
            _core.matmul(a_all, b, bias=bias, out=ref, deterministic=True, core="tl")
            for m in (1, 3, 17, 64, 255, 1000, 8192):
                a = a_all[:m].clone()
                what = (m, dtype, layout, with_bias, out_dtype)

                def fresh():
                    return torch.full((m, n), float("nan"), dtype=out_dtype, device=DEV)
                got = _core.matmul(a, b, bias=bias, out=fresh(), deterministic=True, core="tl")
                assert torch.equal(got, ref[:m]), ("tl", ) + what
                if m > _ws_launch.SKINNY_M and sectors:
                    got = _core.matmul(a, b, bias=bias, out=fresh(), deterministic=True,
                                       core="ws")
                    p = last_plan().ws.plan
                    assert (p.variant == _ws_configs.DETERMINISTIC_CONFIG
                            and p.mode == _ws_configs.MODE_DP), _ws_configs.describe(p)
                    diff = (got.float() - ref[:m].float()).abs().max().item()
                    assert torch.equal(got, ref[:m]), ("ws", diff) + what
                got = _core.matmul(a, b, bias=bias, out=fresh(), deterministic=True)  # (timed)
                assert torch.equal(got, ref[:m]), ("auto", ) + what
