"""Bad input raises TypeError/ValueError naming the op before any kernel is launched."""
import pytest
import torch

import ditron_ops
from ditron_ops.collectives._launch import PURPOSE


def _expect(group, fn, exc, words):
    with pytest.raises(exc) as info:
        fn()
    for w in words:
        assert w in str(info.value), str(info.value)
    assert PURPOSE not in group._workspaces  # nothing was allocated or launched
    return True


def _cases(group):
    dev = group.device
    x = torch.ones(4, 3, device=dev)
    checks = [
        (lambda: ditron_ops.all_gather(x.to(torch.int32)), TypeError, ["all_gather", "int32"]),
        (lambda: ditron_ops.all_reduce(x.double()), TypeError, ["all_reduce", "float64"]),
        (lambda: ditron_ops.reduce_scatter([1, 2]), TypeError, ["reduce_scatter", "torch.Tensor"]),
        (lambda: ditron_ops.all_gather(torch.ones((), device=dev)), ValueError, ["all_gather", "dimension"]),
        (lambda: ditron_ops.all_gather(x, shard_sizes=[4]), ValueError, ["shard_sizes", "2 ranks"]),
        (lambda: ditron_ops.all_gather(x, shard_sizes=[3, 3]), ValueError, ["shard_sizes[", "4 rows"]),
        (lambda: ditron_ops.all_gather(x, shard_sizes=[4, -1]), ValueError, ["non-negative"]),
        (lambda: ditron_ops.all_reduce(x, algorithm="ring"), ValueError, ["algorithm"]),
        (lambda: ditron_ops.all_reduce(x, deterministic=1), TypeError, ["deterministic"]),
        (lambda: ditron_ops.all_gather(x, group="g"), TypeError, ["group"]),
    ]
    if dev.type == "cuda":
        checks.append((lambda: ditron_ops.all_gather(x.cpu()), ValueError, ["all_gather", "cpu"]))
    return all(_expect(group, fn, exc, words) for fn, exc, words in checks)


def test_bad_inputs_raise_before_launch_on_every_rank():
    assert ditron_ops.launch(_cases, 2) == [True, True]


def test_launch_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        ditron_ops.launch(lambda g: None, 0)


def test_no_group_outside_launch():
    with pytest.raises(ValueError, match="no group"):
        ditron_ops.all_gather(torch.ones(2, 2))


def test_rank_exception_is_reraised_on_caller():
    def fn(group):
        if group.rank == 1:
            raise KeyError("boom on rank 1")
        ditron_ops.all_gather(torch.ones(2, 2, device=group.device))

    with pytest.raises(KeyError, match="boom"):
        ditron_ops.launch(fn, 2, timeout_s=1.0)


def _meta_cases(group):
    """Every public op with one tensor argument on the meta device: (name, call)."""
    def real(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype)

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    half = torch.float16
    q, kv, lens = real(1, 4, 64, dtype=half), real(1, 8, 1, 64, dtype=half), torch.tensor([8], dtype=torch.int32)
    s = real(1, 4, 4, 64, dtype=half)
    return [
        ("ag_gemm", "a", lambda: ditron_ops.ag_gemm(meta(4, 8), real(8, 6))),
        ("ag_gemm", "b", lambda: ditron_ops.ag_gemm(real(4, 8), meta(8, 6))),
        ("ag_gemm", "bias", lambda: ditron_ops.ag_gemm(real(4, 8), real(8, 6), bias=meta(6))),
        ("ag_gemm", "out", lambda: ditron_ops.ag_gemm(real(4, 8), real(8, 6), out=meta(8, 6))),
        ("gemm_rs", "a", lambda: ditron_ops.gemm_rs(meta(4, 8), real(8, 6))),
        ("gemm_rs", "b", lambda: ditron_ops.gemm_rs(real(4, 8), meta(8, 6))),
        ("gemm_ar", "b", lambda: ditron_ops.gemm_ar(real(4, 8), meta(8, 6))),
        ("all_reduce", "x", lambda: ditron_ops.all_reduce(meta(4, 8))),
        ("all_gather", "x", lambda: ditron_ops.all_gather(meta(4, 8))),
        ("reduce_scatter", "x", lambda: ditron_ops.reduce_scatter(meta(4, 8))),
        ("all_to_all", "x", lambda: ditron_ops.all_to_all(meta(4, 8), 1, 0)),
        ("flash_decode", "q", lambda: ditron_ops.flash_decode(meta(1, 4, 64, dtype=half), kv, kv, lens)),
        ("flash_decode", "v_cache", lambda: ditron_ops.flash_decode(q, kv, meta(1, 8, 1, 64, dtype=half), lens)),
        ("flash_decode", "kv_lens", lambda: ditron_ops.flash_decode(
            q, kv, kv, torch.empty(1, dtype=torch.int32, device="meta"))),
        ("ulysses_attention", "k", lambda: ditron_ops.ulysses_attention(s, meta(1, 4, 4, 64, dtype=half), s)),
    ]


def test_meta_inputs_raise_naming_op_and_argument_before_anything_is_allocated():
    """A meta tensor outside tracing has no data: a typed error on every rank, not a copy
    error after a workspace was made (or a result computed from nothing)."""
    def body(group):
        for op, arg, call in _meta_cases(group):
            _expect(group, call, ValueError, [f"ditron.{op}", f"{arg} is on the meta device"])
            assert not group._workspaces, (op, arg)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_moe_meta_inputs_raise():
    def body(group):
        t, h, e, k = 6, 64, 4, 2
        x = torch.randn(t, h)
        idx = torch.rand(t, e).topk(k, dim=1).indices
        w = torch.rand(t, k)
        with ditron_ops.moe.Buffer(group, num_experts=e, max_tokens_per_rank=t, hidden=h, topk=k,
                                   dtype=torch.float32) as buf:
            for arg, call in (("x", lambda: buf.dispatch(x.to("meta"), idx, w)),
                              ("topk_idx", lambda: buf.dispatch(x, idx.to("meta"), w)),
                              ("topk_weights", lambda: buf.dispatch(x, idx, w.to("meta")))):
                with pytest.raises(ValueError, match=f"{arg} is on the meta device"):
                    call()
        return True
    assert ditron_ops.launch(body, 2) == [True, True]
