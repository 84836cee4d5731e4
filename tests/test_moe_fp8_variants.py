"""MoE fp8 quantization variants (``moe._launch.FP8_VARIANTS``) on the CPU virtual world
(Triton interpreter): the same bits as the ``div`` path and torch's formula."""
import pytest
import torch

import ditron_ops
from ditron_ops.moe import Buffer
from ditron_ops.testing import moe_checks as mc

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
F32, F16 = torch.float32, torch.float16


def _fp8_rows(buf, d):
    """``{source: (codes, scales, weight)}`` of the received rows (placement-free)."""
    src = d.handle.src_of_row.tolist()
    codes = d.x.reshape(-1, buf.hidden).view(torch.uint8)
    scales = d.scales.reshape(-1, buf.hidden // 128)
    return {s: (codes[r], scales[r], d.weights.reshape(-1)[r]) for r, s in enumerate(src) if s >= 0}


def _same_rows(a, b, what):
    assert a.keys() == b.keys(), what
    for s in a:
        assert all(torch.equal(x, y) for x, y in zip(a[s], b[s])), f"{what}: source entry {s}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fp8_variants_same_bits(world_size):
    """Every fp8 quantization variant (``_launch.FP8_VARIANTS``: an IEEE division per value,
    the group's reciprocal and two corrections, that in a kernel of its own) gives the torch
    formula's codes and scales and the ``div`` variant's outputs bit for bit: both layouts,
    deterministic (every output tensor) and default placement (rows by source entry), cached
    handles, fp16 and fp32 tokens, power-of-two scales, uneven and zero token counts, values
    from 1e-6 to 1e3 (amax under 1e-4 too) and exact zeros; ``div``'s bits also for groups
    holding ``+-inf`` or NaN (the cached calls; torch's NaN codes may differ in sign)."""
    from ditron_ops.moe._launch import FP8_VARIANTS

    def body(group):
        dtype = F16 if group.world_size % 2 else F32
        for round_scale in (False, True):
            with Buffer(group, num_experts=2 * group.world_size, max_tokens_per_rank=6, hidden=256,
                        topk=2, dtype=dtype, fp8=True, round_scale=round_scale) as buf:
                count = (6, 5, 0)[group.rank]
                for seed, layout in enumerate(("expert_padded", "expert_contig")):
                    idx, w = mc.routing(group, count, buf.num_experts, 2, "random", 60 + seed)
                    x = mc.tokens(group, count, 256, F32, 60 + seed)
                    x = x * torch.tensor([1e-6, 1.0, 30.0, 1e3, 0.1, 3e-5])[:count, None]
                    x[:, 7:9] = 0.0
                    x[:, 9] = -0.0
                    x = x.to(dtype)
                    odd = x / 4  # a group with +-inf (scale inf: +-0, NaN codes), one with NaN
                    odd[:, 3:5] = torch.tensor([float("inf"), -float("inf")], dtype=dtype)
                    odd[:, 130] = float("nan")
                    runs = {}
                    for variant in FP8_VARIANTS:
                        buf._fp8_variant = variant
                        mc.check_dispatch_combine(group, buf, x, idx, w, layout)  # torch's formula
                        # other tokens in each call: a staging half written out of turn shows
                        det = buf.dispatch(x, idx, w, layout=layout, deterministic=True)
                        fresh = buf.dispatch(-3 * x, idx, w, layout=layout, deterministic=False)
                        cached = buf.dispatch(odd, None, w, handle=det.handle)
                        mc._settle(group)
                        runs[variant] = (det, fresh, cached)
                    base = runs["div"]
                    for variant, (det, fresh, cached) in runs.items():
                        what = f"rank {group.rank} {layout} round_scale={round_scale} {variant}"
                        used = base[0].handle.src_of_row >= 0  # other rows are unspecified
                        for got, want in ((det, base[0]), (cached, base[2])):
                            for name in ("x", "scales"):
                                a, b = (getattr(d, name).reshape(used.shape[0], -1)[used] for d in (got, want))
                                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: {name}"
                            for name in ("weights", "counts", "offsets"):
                                assert torch.equal(getattr(got, name), getattr(want, name)), f"{what}: {name}"
                        for name in ("src_of_row", "dest", "cstart"):
                            assert torch.equal(getattr(det.handle, name), getattr(base[0].handle, name)), what
                        _same_rows(_fp8_rows(buf, fresh), _fp8_rows(buf, base[1]), what + " default mode")
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


def test_fp8_variant_change_meets_before_the_next_wait(monkeypatch):
    """Changing ``Buffer._fp8_variant`` has every rank meet before its next waiting launch
    (``Group.meet_before_next_wait``): the variant is in the plan key, not in the agreed call
    signature, so the next dispatch may compile on one rank while a peer's kernel waits.
    Setting the same variant again meets nothing; an unknown one raises."""
    def body(group):
        meets = []
        monkeypatch.setattr(group, "meet_before_next_wait", lambda: meets.append(1), raising=False)
        with Buffer(group, num_experts=2 * group.world_size, max_tokens_per_rank=2, hidden=128,
                    topk=1, dtype=F32, fp8=True) as buf:
            meets.clear()  # the Buffer's own agreement
            first = buf._fp8_variant  # the rule's, for a 2-token bound
            buf._fp8_variant = "rcp"
            buf._fp8_variant = "split"
            buf._fp8_variant = "split"
            buf._fp8_variant = "div"
            with pytest.raises(ValueError, match="not one of"):
                buf._fp8_variant = "fast"
            return (first, len(meets), buf._fp8_variant)
    assert ditron_ops.launch(body, 2) == [("rcp", 2, "div")] * 2


def test_fp8_variant_rule():
    """A Buffer's fp8 variant comes from its token bound times hidden (``fp8_variant``): ``rcp``
    for the low-latency bound, ``split`` for the throughput one, switching at
    ``FP8_SPLIT_MIN_VALUES`` whatever the split of that product into tokens and channels."""
    from ditron_ops.moe._launch import FP8_SPLIT_MIN_VALUES as LIMIT, fp8_variant

    assert fp8_variant(128, 7168) == "rcp" and fp8_variant(4096, 7168) == "split"
    for hidden in (128, 1024, 7168, 16384):
        at = -(-LIMIT // hidden)
        assert (fp8_variant(at - 1, hidden), fp8_variant(at, hidden)) == ("rcp", "split"), hidden


def test_a_buffer_over_the_bound_quantizes_apart(monkeypatch):
    """A Buffer whose token bound reaches ``FP8_SPLIT_MIN_VALUES`` (lowered here to 6 x 256
    values) runs ``split`` by default, and its dispatch gives ``div``'s bits."""
    from ditron_ops.moe import _launch

    monkeypatch.setattr(_launch, "FP8_SPLIT_MIN_VALUES", 6 * 256)

    def body(group):
        with Buffer(group, num_experts=2 * group.world_size, max_tokens_per_rank=6, hidden=256,
                    topk=2, dtype=F32, fp8=True) as buf, \
                Buffer(group, num_experts=2 * group.world_size, max_tokens_per_rank=5, hidden=256,
                       topk=2, dtype=F32, fp8=True) as small:
            assert (buf._fp8_variant, small._fp8_variant) == ("split", "rcp")
            idx, w = mc.routing(group, 6, buf.num_experts, 2, "random", 7)
            x = mc.tokens(group, 6, 256, F32, 7)
            got = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=True)
            assert any(k[-1] == "split" for k in buf.plans._plans)
            mc._settle(group)
            buf._fp8_variant = "div"
            want = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=True)
            mc._settle(group)
            _same_rows(_fp8_rows(buf, got), _fp8_rows(buf, want), f"rank {group.rank}")
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_fp8_reciprocal_quotient_is_the_ieee_division():
    """``_kernels._quotient`` with the group's reciprocal equals fp32 IEEE division bit for bit
    wherever ``|v / s| >= 2^-20`` and gives its e4m3 code everywhere (``moe_checks.quotient_cases``:
    values one to four ulps around every e4m3 value and rounding midpoint times the scale,
    scales with all-ones mantissas, zeros of both signs, subnormals, NaN, groups holding
    ``+-inf`` with scale ``+inf``; the interpreter's fused multiply-add is the exact one,
    ``_kernels._fma``)."""
    from ditron_ops.moe import _kernels

    for quant in (_kernels.QUANT_DIV, _kernels.QUANT_RCP):
        for seed in range(2):
            assert mc.quotient_mismatches(torch.device("cpu"), quant, seed=seed) == 0, (quant, seed)
