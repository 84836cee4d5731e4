"""ulysses_attention and all_to_all on the CPU virtual world (Triton interpreter) vs the
references: all-gather of the sequence + SDPA over the whole sequence + slice; gradients vs the
reference's autograd; determinism under injected delays; validation, timeouts, opcheck, compile."""
import random
import time

import pytest
import torch

import ditron_ops
from ditron_ops import reference
from ditron_ops.attention import ulysses as api
from ditron_ops.testing.ulysses_checks import rank_1_skips_a_call, replicated_dk_reference

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _full_inputs(b, s, hq, hkv, d, dtype, seed=0):
    """The whole sequence's q, k, v (every rank builds the same; rank r takes its chunk)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))


def _chunk(x, group):
    s_r = x.shape[1] // group.world_size
    return x[:, group.rank * s_r:(group.rank + 1) * s_r].contiguous()


def _check(group, b, s_r, hq, hkv, d, causal, dtype):
    q, k, v = (_chunk(x, group) for x in _full_inputs(b, s_r * group.world_size, hq, hkv, d, dtype))
    out = ditron_ops.ulysses_attention(q, k, v, group, causal=causal)
    want = reference.ulysses_attention(q, k, v, group, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err
    return err


@pytest.mark.parametrize("world_size,b,s_r,hq,hkv,d,causal,dtype", [
    (1, 1, 13, 2, 1, 64, True, torch.float32),
    (2, 1, 16, 8, 2, 64, True, torch.float32),    # KV split, S_r a multiple of BLOCK_N (runs)
    (2, 2, 7, 4, 1, 64, False, torch.float16),    # 8/1-like: the KV head replicated
    (2, 1, 5, 2, 2, 128, True, torch.float32),
    (3, 1, 5, 6, 3, 64, True, torch.float32),
    (3, 1, 9, 3, 1, 64, False, torch.float32),    # W=3, replicated
    (4, 1, 6, 8, 2, 64, True, torch.float16),     # 32/8-like at W > Hkv: replicated
    (4, 1, 16, 4, 4, 64, False, torch.float32),   # 64/8-like: one KV head per rank
])
def test_matches_reference(world_size, b, s_r, hq, hkv, d, causal, dtype):
    ditron_ops.launch(_check, world_size, args=(b, s_r, hq, hkv, d, causal, dtype))


def _grads(group, s_r, hq, hkv, causal, deterministic):
    """The op's gradients on this rank vs the full-sequence reference's autograd, sliced."""
    w, d = group.world_size, 64
    full = [x.requires_grad_() for x in _full_inputs(1, s_r * w, hq, hkv, d, torch.float32, seed=3)]
    dout_full = torch.randn(1, s_r * w, hq, d, generator=torch.Generator().manual_seed(4))
    (reference.attention(*full, causal=causal) * dout_full).sum().backward()
    mine = [_chunk(x.detach(), group).requires_grad_() for x in full]
    out = ditron_ops.ulysses_attention(*mine, group, causal=causal, deterministic=deterministic)
    (out * _chunk(dout_full, group)).sum().backward()
    for x, ref in zip(mine, full):
        want = _chunk(ref.grad, group)
        err = (x.grad - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), err
    return True


@pytest.mark.parametrize("world_size,s_r,hq,hkv,causal,deterministic", [
    (2, 7, 4, 2, True, True),     # KV split
    (2, 5, 4, 1, False, False),   # replicated (default mode: the same blockwise backward on CPU)
    (3, 6, 3, 1, True, True),     # replicated over three ranks
])
def test_gradients_match_reference_autograd(world_size, s_r, hq, hkv, causal, deterministic):
    assert ditron_ops.launch(_grads, world_size,
                             args=(s_r, hq, hkv, causal, deterministic)) == [True] * world_size


def _repeat_with_delays(group, runs, seed):
    """Forward and deterministic backward ``runs`` times, each rank sleeping a random time
    before every call (arrival orders differ run to run); all results bitwise equal. The
    replicated KV head's gradient equals the rank-ordered fp32 sum of every replica's partial."""
    w = group.world_size
    full = _full_inputs(1, 6 * w, 3, 1, 64, torch.float32, seed=seed)
    dout = _chunk(torch.randn(1, 6 * w, 3, 64, generator=torch.Generator().manual_seed(9)), group)
    rng = random.Random(seed * 100 + group.rank)
    results = []
    for _ in range(runs):
        q, k, v = (_chunk(x, group).requires_grad_() for x in full)
        time.sleep(rng.uniform(0.0, 0.05))
        out = ditron_ops.ulysses_attention(q, k, v, group, causal=True, deterministic=True)
        time.sleep(rng.uniform(0.0, 0.05))
        out.backward(dout)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    q, k, v = (_chunk(x, group) for x in full)
    assert torch.equal(results[0][2], replicated_dk_reference(group, q, k, v, dout, torch.float32))
    return True


def test_deterministic_bitwise_under_delays():
    assert ditron_ops.launch(_repeat_with_delays, 3, args=(3, 1)) == [True] * 3


def _back_to_back(group):
    """Calls of changing shapes reuse the double-buffered workspace: each is still right."""
    shapes = [(16, 4, 2, False), (5, 2, 2, True), (9, 4, 1, True)]
    for i in range(9):
        s_r, hq, hkv, causal = shapes[i % 3]
        _check(group, 1, s_r, hq, hkv, 64, causal, torch.float32)
    return group.plans.builds


def test_back_to_back_changing_shapes_and_plan_reuse():
    assert ditron_ops.launch(_back_to_back, 2) == [3, 3]  # one plan per shape, reused


@pytest.mark.parametrize("bad,exc,match", [
    (dict(q=(1, 4, 3, 64)), ValueError, "multiple of the world size"),
    (dict(k=(1, 4, 3, 64), v=(1, 4, 3, 64), q=(1, 4, 6, 64)), ValueError, "split when"),
    (dict(q=(1, 4, 4, 32), k=(1, 4, 2, 32), v=(1, 4, 2, 32)), ValueError, "head_dim"),
    (dict(k=(1, 5, 2, 64), v=(1, 5, 2, 64)), ValueError, "must match"),
    (dict(v=(1, 4, 1, 64)), ValueError, "equal"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
])
def test_validation(bad, exc, match):
    def body(group):
        shapes = dict(q=(1, 4, 4, 64), k=(1, 4, 2, 64), v=(1, 4, 2, 64))
        shapes.update(bad)
        dtype = shapes.pop("dtype", torch.float32)
        q, k, v = (torch.zeros(shapes[n], dtype=dtype) for n in ("q", "k", "v"))
        with pytest.raises(exc, match=match):
            ditron_ops.ulysses_attention(q, k, v, group)
        assert "ulysses" not in group._workspaces
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def _unequal_chunks(group):
    q = torch.zeros(1, 4 + group.rank, 2, 64)
    k = torch.zeros(1, 4 + group.rank, 2, 64)
    with pytest.raises(ditron_ops.DitronMismatchError, match="disagree on S_r") as info:
        ditron_ops.ulysses_attention(q, k, k, group)
    assert (info.value.mine, info.value.theirs) == (4 + group.rank, 5 - group.rank)
    return True


def test_unequal_sequence_chunks_raise_naming_the_rule():
    assert ditron_ops.launch(_unequal_chunks, 2) == [True, True]


def _shapes_disagree_later(group):
    """Both ranks built both plans together; then they call different ones: the kernel's
    fingerprint check raises DitronSizeMismatchError instead of mixing the data."""
    small, large = (torch.ones(1, s, 2, 64) for s in (4, 6))
    ditron_ops.ulysses_attention(small, small, small, group)
    ditron_ops.ulysses_attention(large, large, large, group)
    group.synchronize()
    x = small if group.rank == 0 else large
    with pytest.raises(ditron_ops.DitronSizeMismatchError):
        ditron_ops.ulysses_attention(x, x, x, group)
        group.synchronize()
    return True


def test_later_shape_disagreement_is_a_size_mismatch():
    assert ditron_ops.launch(_shapes_disagree_later, 2, timeout_s=2.0) == [True, True]


def _rank1_skips(group):
    got = rank_1_skips_a_call(group, torch.ones(1, 4, 2, 64))
    return got if got == "skipped" else (got.op, got.peer)


def test_missing_rank_times_out():
    got = ditron_ops.launch(_rank1_skips, 2, timeout_s=1.0)
    assert got == [("ulysses_attention", 1), "skipped"]


def test_opcheck_and_compile():
    def body(group):
        from ditron_ops.testing.ulysses_checks import check_op_integration

        q, k, v = _full_inputs(1, 8, 2, 1, 64, torch.float32)
        return check_op_integration(group, q, k, v, 0.125, True)
    assert ditron_ops.launch(body, 1) == [True]


def _a2a_cases(group):
    w = group.world_size
    cases = [((2, 3, 4 * w, 8), 2, 1), ((2, 4 * w, 3, 8), 1, 2), ((2 * w, 3, 5), 0, 2),
             ((3, 5, 2 * w), 2, 0), ((2 * w, 7), 0, 0), ((3, 2 * w, 16), 1, -1)]
    for shape, sc, ga in cases:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(group.rank))
        for dtype in (torch.float32, torch.float16):
            got = ditron_ops.all_to_all(x.to(dtype), sc, ga, group)
            assert torch.equal(got, reference.all_to_all(x.to(dtype), group, sc, ga % x.dim()))
    # gradient: the inverse exchange
    x = torch.randn(2, 2 * w, 3 * w, 8, generator=torch.Generator().manual_seed(7 + group.rank),
                    requires_grad=True)
    weight = torch.randn(2, 2 * w * w, 3, 8, generator=torch.Generator().manual_seed(8))
    (ditron_ops.all_to_all(x, 2, 1, group) * weight).sum().backward()
    want = ditron_ops.all_to_all(weight, 1, 2, group)
    assert torch.equal(x.grad, want)
    with pytest.raises(ValueError, match="multiple of the world size"):
        ditron_ops.all_to_all(torch.zeros(2, 2 * w + 1), 1, 0, group)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_to_all_matches_reference(world_size):
    if world_size == 1:
        def body(group):
            x = torch.randn(3, 4, 5)
            return torch.equal(ditron_ops.all_to_all(x, 1, 2, group), x)
        assert ditron_ops.launch(body, 1) == [True]
        return
    assert ditron_ops.launch(_a2a_cases, world_size) == [True] * world_size


@pytest.mark.parametrize("causal", [False, True])
def test_local_attention_matches_reference(causal):
    q, k, v = _full_inputs(2, 21, 4, 2, 64, torch.float32, seed=5)
    got = api.local_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=causal)
    want = reference.attention(q, k, v, causal=causal).transpose(1, 2)
    assert (got - want).abs().max().item() < 2e-5


def test_quick_bench_writes_rows(tmp_path):
    import csv

    from ditron_ops.bench.__main__ import main

    argv = ["ulysses", "--quick", "--world-sizes", "2", "--dtype", "fp32", "--rounds", "1",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "ulysses-fp32-cpu-quick.csv")))
    assert [r["case"].split()[0] for r in rows] == ["local", "fused", "fused"]
    assert all(float(r["time_us"]) > 0 and float(r["max_abs_err"]) < 1e-4 for r in rows)


def _gloo_checks(group):
    from ditron_ops.testing.ulysses_checks import check_ulysses

    return check_ulysses(group, torch.float32)


def test_torch_backend_over_gloo():
    """Groups without symmetric memory (torchrun with the torch backend) take the unfused
    path: all_to_all over torch.distributed, SDPA, all_to_all back."""
    from ditron_ops.testing import run_gloo

    results = run_gloo(_gloo_checks, 2)
    assert all(len(r) == 4 for r in results)


def test_checks_on_virtual_world():
    from ditron_ops.testing.ulysses_checks import check_ulysses

    assert all(len(r) == 4 for r in ditron_ops.launch(check_ulysses, 2, args=(torch.float32,)))
