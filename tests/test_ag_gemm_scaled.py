"""fp8 ``ag_gemm_scaled`` on the CPU virtual world (Triton interpreter, which runs fp8 ``tl.dot``):
every scale mode against the float64 product of the dequantized operands, both paths and every
producer, K off 128 (block tails), typed errors, fake shapes, opcheck, compile."""
import pytest
import torch

import ditron_ops
from ditron_ops.gemm import _ag_launch
from ditron_ops.gemm.scaled import gathered_bytes, packed_row, scale_mode
from ditron_ops.testing.scaled_checks import (check_ag_gemm_scaled, check_reduce_scaled,
                                              reduce_inputs, scaled_inputs)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
MODES = ["tensor", "row", "block"]
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size,sizes,k,n", [(1, [9], 200, 40), (2, [5, 7], 256, 24),
                                                  (3, [4, 0, 6], 130, 136)])
def test_modes_match_float64(mode, world_size, sizes, k, n):
    def body(group):
        for impl in ("fused", "baseline"):
            check_ag_gemm_scaled(group, sizes, k, n, mode, out_dtype=torch.float16, impl=impl,
                                 bias=impl == "fused")
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("producer", ["copy", "pull", "push"])
def test_each_producer(monkeypatch, producer):
    monkeypatch.setattr(_ag_launch, "PRODUCER", producer)
    sizes = [3, 5]
    body = (lambda g: check_ag_gemm_scaled(g, sizes, 144, 32, "block", out_dtype=torch.float16))
    assert ditron_ops.launch(body, 2) == [True, True]


def test_ws_consumer_setting(monkeypatch):
    """``SCALED_CONSUMER_CORE = "ws"`` where the fp8 WS core refuses (no sm_90 here): the
    portable consumer, same results; a value it does not know: ValueError at plan build."""
    monkeypatch.setattr(_ag_launch, "PRODUCER", "copy")
    monkeypatch.setattr(_ag_launch, "SCALED_CONSUMER_CORE", "ws")
    body = (lambda g: check_ag_gemm_scaled(g, [40, 24], 144, 32, "row", out_dtype=torch.float16))
    assert ditron_ops.launch(body, 2) == [True, True]
    monkeypatch.setattr(_ag_launch, "SCALED_CONSUMER_CORE", "fast")
    with pytest.raises(ValueError, match="SCALED_CONSUMER_CORE"):
        ditron_ops.launch(lambda g: check_ag_gemm_scaled(g, [16], 144, 32, "row",
                                                         out_dtype=torch.float16), 1)


def test_packed_rows_halve_the_gather():
    """fp8 rows and their scales: about half the bf16 op's bytes (and exact layout rules)."""
    assert packed_row(4096, "row") == packed_row(4096, "tensor")
    layout = packed_row(4100, "block")
    # (scales from 4112, 33 of them: 4244 bytes, on whole 128-byte lines 4352)
    assert layout.scale_offset == 4112 and layout.scales == 33 and layout.pitch == 34 * 128
    assert packed_row(512, "row").pitch == 640 and packed_row(7168, "block").pitch == 7424
    bf16 = 2 * 8192 * 4096
    assert gathered_bytes([2048] * 4, 4096, "row") / bf16 == pytest.approx(0.5 + 128 / 8192)
    assert gathered_bytes([2048] * 4, 4096, "block") / bf16 == pytest.approx(0.5 + 128 / 8192)


def test_packed_rows_are_whole_lines_holding_values_then_scales():
    """Every K and mode: values from 0, scales from a 16-byte offset past them, the pitch whole
    128-byte lines and the least that holds both."""
    for k in range(1, 1100):
        for mode in ("tensor", "row", "block"):
            r = packed_row(k, mode)
            end = r.scale_offset + 4 * r.scales
            assert r.scale_offset >= k and r.scale_offset % 16 == 0, (k, mode)
            assert r.pitch % 128 == 0 and end <= r.pitch < end + 128, (k, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k,offset,pad", [(256, 0, 0), (200, 0, 0), (272, 16, 16), (130, 3, 3),
                                          (256, 0, 8), (640, 0, 0)])
def test_pack_rows_kernel_writes_values_then_scales(mode, k, offset, pad):
    """``pack_rows`` (one ``pack_rows_kernel`` launch: 16-byte vectors where ``a``'s rows are
    whole aligned vectors, bytes otherwise; ``a`` a view starting ``offset`` bytes in, rows
    ``k + pad`` bytes apart; K = 640: five block scales, two of the interpreter's scale blocks)
    puts every row's fp8 bytes at 0 and its scales at ``scale_offset``; a second call of the
    same layout reuses the bound kernel."""
    from ditron_ops.gemm._pad import pack_vec
    from ditron_ops.gemm.scaled import pack_rows

    rows = 11
    gen = torch.Generator().manual_seed(k + offset + pad)
    base = (torch.randn(rows * (k + pad) + offset, generator=gen) * 8).to(FP8)
    a = base[offset:offset + rows * (k + pad)].view(rows, k + pad)[:, :k]
    kb = -(-k // 128)
    sa = {"tensor": torch.rand(1, generator=gen), "row": torch.rand(rows, 1, generator=gen),
          "block": torch.rand(kb, rows, generator=gen).t()}[mode]  # block: column-major scales
    assert pack_vec(a) == (16 if k % 16 == 0 and offset % 16 == 0 and pad % 16 == 0 else 1)
    layout = packed_row(k, mode)

    def body(group):
        got = [pack_rows(a, sa, mode, group) for _ in range(2)]
        return got, len(group.plans)
    packed, plans = ditron_ops.launch(body, 1)[0]
    assert plans == 1
    lo = layout.scale_offset // 4
    want = sa.reshape(1, 1).expand(rows, 1) if mode == "tensor" else sa
    for got in packed:  # (the padding between and after is not written)
        assert got.shape == (rows, layout.pitch // 4)
        assert torch.equal(got.view(torch.uint8)[:, :k], a.view(torch.uint8))
        assert torch.equal(got[:, lo:lo + layout.scales], want)


def test_scale_mode_and_errors():
    a = torch.zeros(4, 256, dtype=FP8)
    b = torch.zeros(64, 256, dtype=FP8).t()
    one = torch.ones(1)
    assert scale_mode("x", a, b, one, one) == "tensor"
    assert scale_mode("x", a, b, torch.ones(4, 1), torch.ones(1, 64)) == "row"
    assert scale_mode("x", a, b, torch.ones(4, 2), torch.ones(2, 1)) == "block"
    with pytest.raises(ValueError, match="match no scale mode"):
        scale_mode("x", a, b, torch.ones(4, 1), torch.ones(2, 1))

    def body(group):
        bad = [
            (dict(a=a.to(torch.bfloat16)), TypeError, "float8_e4m3fn"),
            (dict(b=torch.zeros(256, 64, dtype=FP8)), ValueError, "column-major"),
            (dict(scale_a=torch.ones(4, 1, dtype=torch.float16)), TypeError, "scale_a"),
            (dict(scale_b=torch.ones(64, 1)), ValueError, "match no scale mode"),
            (dict(scale_a=torch.ones(2, 4).t(), scale_b=torch.ones(2, 1)), ValueError, "contiguous"),
            (dict(out_dtype=torch.float32), TypeError, "out_dtype"),
            (dict(bias=torch.zeros(63, dtype=torch.bfloat16)), ValueError, "bias"),
            (dict(impl="nope"), ValueError, "impl"),
        ]
        for change, exc, match in bad:
            args = dict(a=a, b=b, scale_a=one, scale_b=one) | change
            with pytest.raises(exc, match=match):
                ditron_ops.ag_gemm_scaled(args.pop("a"), args.pop("b"), args.pop("scale_a"),
                                          args.pop("scale_b"), group, **args)
        assert group._workspaces == {}  # raised before anything was allocated or launched
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def _opcheck(group):
    a_list, sa_list, b, sb = scaled_inputs([5], 160, 24, "block", group.device)
    # (no test_schema: it perturbs the inputs with arithmetic torch does not have for fp8)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ditron.ag_gemm_scaled.default,
                          (a_list[0], b, sa_list[0], sb, None, group.group_name, [5],
                           torch.float16, "fused"), test_utils=utils)
    return True


def test_opcheck():
    assert ditron_ops.launch(_opcheck, 1) == [True]


def _compiled(group):
    a_list, sa_list, b, sb = scaled_inputs([6], 128, 16, "row", group.device)

    def step(x, s):
        return ditron_ops.ag_gemm_scaled(x, b, s * 2, sb, group, out_dtype=torch.float16,
                                         impl="fused").relu()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    return torch.equal(compiled(a_list[0], sa_list[0]), step(a_list[0], sa_list[0]))


def test_compile_fullgraph():
    assert ditron_ops.launch(_compiled, 1) == [True]


def test_reduce_ops_compile_fullgraph_with_bias():
    """gemm_rs_scaled and gemm_ar_scaled with a bias inside one fullgraph-compiled function at
    W = 2: the same bits as eager (deterministic)."""
    def body(group):
        a, sa, b, sb = reduce_inputs(6, [136, 128], 24, "block", group.device)[group.rank]
        bias = torch.randn(24, generator=torch.Generator().manual_seed(1)).to(torch.float16)

        def step(x, s):
            rs = ditron_ops.gemm_rs_scaled(x, b, s, sb, group, bias=bias, out_dtype=torch.float16,
                                           deterministic=True)
            ar = ditron_ops.gemm_ar_scaled(x, b, s, sb, group, bias=bias, out_dtype=torch.float16,
                                           deterministic=True)
            return rs.float().sum() + ar.relu()
        if group.rank == 0:
            torch._dynamo.reset()
        group.barrier()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        return torch.equal(compiled(a, sa), step(a, sa))
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["gemm_rs_scaled", "gemm_ar_scaled"])
@pytest.mark.parametrize("world_size,m,k_sizes,n", [(1, 9, [200], 40), (2, 12, [256, 136], 24),
                                                    (3, 7, [130, 0, 64], 136)])
def test_reduce_modes_match_float64(mode, op, world_size, m, k_sizes, n):
    def body(group):
        for impl, det, bias in (("fused", False, False), ("fused", True, True),
                                ("baseline", False, True)):
            check_reduce_scaled(group, m, k_sizes, n, mode, op, out_dtype=torch.float16,
                                impl=impl, deterministic=det, bias=bias)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


def test_gemm_ar_scaled_algorithms_and_rs_shards():
    def body(group):
        for algorithm in ("one_shot", "two_shot"):
            for bias in (False, True):
                check_reduce_scaled(group, 10, [128, 144], 32, "row", "gemm_ar_scaled",
                                    out_dtype=torch.float16, algorithm=algorithm, bias=bias)
        check_reduce_scaled(group, 10, [128, 144], 32, "block", "gemm_rs_scaled",
                            out_dtype=torch.float16, shard_sizes=[7, 3], bias=True)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_reduce_deterministic_bitwise_repeatable():
    def body(group):
        outs = [check_reduce_scaled(group, 9, [256, 128], 48, "block", "gemm_ar_scaled",
                                    out_dtype=torch.float16, deterministic=True)
                for _ in range(2)]
        return torch.equal(*outs)
    assert ditron_ops.launch(body, 2) == [True, True]


def test_reduce_opcheck():
    def body(group):
        parts = reduce_inputs(6, [160], 24, "row", group.device)
        a, sa, b, sb = parts[0]
        utils = ("test_faketensor", "test_aot_dispatch_dynamic")
        bias = torch.randn(24).to(torch.float16)
        torch.library.opcheck(torch.ops.ditron.gemm_rs_scaled.default,
                              (a, b, sa, sb, bias, group.group_name, [6], torch.float16, True,
                               "fused"), test_utils=utils)
        torch.library.opcheck(torch.ops.ditron.gemm_ar_scaled.default,
                              (a, b, sa, sb, None, group.group_name, torch.float16, False, "fused",
                               "auto"), test_utils=utils)
        return True
    assert ditron_ops.launch(body, 1) == [True]


@pytest.mark.parametrize("op", ["gemm_rs_scaled", "gemm_ar_scaled"])
def test_reduce_bias_errors(op):
    """A bias of the wrong size or dtype is a typed error; ranks that disagree on passing one get
    ``DitronMismatchError`` on every rank; nothing runs first."""
    def body(group):
        a, sa, b, sb = reduce_inputs(4, [256], 64, "row", group.device)[0]
        fn = getattr(ditron_ops, op)
        for bias, exc in ((torch.zeros(63, dtype=torch.bfloat16), ValueError),
                          (torch.zeros(64, dtype=torch.float16), TypeError)):
            with pytest.raises(exc, match="bias"):
                fn(a, b, sa, sb, group, bias=bias)
        mine = torch.zeros(64, dtype=torch.bfloat16) if group.rank == 0 else None
        with pytest.raises(ditron_ops.DitronMismatchError, match="bias"):
            fn(a, b, sa, sb, group, bias=mine)
        assert group._workspaces == {}
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("op", ["gemm_rs_scaled", "gemm_ar_scaled"])
def test_unfused_deterministic_partials_take_the_invariant_tiles(op, monkeypatch):
    """On groups without symmetric memory the reducing ops run unfused; in deterministic mode
    each rank's fp32 partial (``scaled_matmul``) takes the batch-invariant tiles (the rule's
    deterministic mode), not M's best."""
    from ditron_ops.gemm import _core, scaled
    from ditron_ops.testing.scaled_checks import reduce_inputs

    asked = []
    rule = _core.select_config
    monkeypatch.setattr(_core, "select_config",
                        lambda *a, **kw: asked.append(kw["deterministic"]) or rule(*a, **kw))
    monkeypatch.setattr(scaled, "_fused_wanted", lambda *a: False)  # (no symmetric memory)

    def body(group):
        a, sa, b, sb = reduce_inputs(6, [128, 128], 24, "row", group.device)[group.rank]
        getattr(ditron_ops, op)(a, b, sa, sb, group, out_dtype=torch.float16,
                                deterministic=True)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]
    assert asked and all(asked), asked
