"""CPU tier: per-call plans (``runtime.plan``). A repeated call builds nothing; a new stride or
shape builds a plan, a new address none; values at a reused address (in-place updates, a freed
tensor's memory given to a new one) are read afresh; no plan keeps a call's tensors alive; the
cache is bounded and dropped with its group."""
import gc
import weakref

import pytest
import torch

import ditron_ops
from ditron_ops.runtime.launcher import BoundKernel

K, N = 16, 32  # fp32 rows of 64 and 128 bytes: every operand can back a TMA descriptor


class Spy:
    """Counts plan builds and kernel bindings while active."""

    def __init__(self, monkeypatch):
        self.bindings = 0
        init = BoundKernel.__init__

        def counting_init(obj, *args, **kwargs):
            self.bindings += 1
            init(obj, *args, **kwargs)

        monkeypatch.setattr(BoundKernel, "__init__", counting_init)

    def snapshot(self, group):
        return group.plans.builds, self.bindings


def _inputs(group, m=4):
    """``(a [m, K], w [N, K], x, q, cache, lens)``; ``a`` has ``m`` rows per rank (gemm_rs's M)."""
    gen = torch.Generator().manual_seed(group.rank)
    a = torch.randn(m * group.world_size, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    x = torch.randn(8, 8, generator=gen)
    q, cache = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 24, 2, 64, generator=gen)
    lens = torch.tensor([24, 9], dtype=torch.int32)
    return a, w, x, q, cache, lens


OPS = {
    "ag_gemm": lambda g, a, w, x, q, c, l: ditron_ops.ag_gemm(a[:4], w.t(), g, impl="fused"),
    "ag_gemm_gathered": lambda g, a, w, x, q, c, l: ditron_ops.ag_gemm(
        a[:4], w.t(), g, impl="fused", return_gathered=True)[1],
    "gemm_rs": lambda g, a, w, x, q, c, l: ditron_ops.gemm_rs(a, w.t(), g, impl="fused"),
    "gemm_ar_one_shot": lambda g, a, w, x, q, c, l: ditron_ops.gemm_ar(
        a, w.t(), g, impl="fused", algorithm="one_shot"),
    "gemm_ar_two_shot": lambda g, a, w, x, q, c, l: ditron_ops.gemm_ar(
        a, w.t(), g, impl="fused", algorithm="two_shot"),
    "all_reduce": lambda g, a, w, x, q, c, l: ditron_ops.all_reduce(x, g),
    "all_reduce_two_shot": lambda g, a, w, x, q, c, l: ditron_ops.all_reduce(
        x, g, algorithm="two_shot"),
    "all_gather": lambda g, a, w, x, q, c, l: ditron_ops.all_gather(x, g),
    "reduce_scatter": lambda g, a, w, x, q, c, l: ditron_ops.reduce_scatter(x, g),
    "flash_decode": lambda g, a, w, x, q, c, l: ditron_ops.flash_decode(q, c, c, l, g),
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("op", sorted(OPS))
def test_repeated_call_builds_nothing(monkeypatch, op, world_size):
    """After the first calls (the output's allocation may alternate between a few addresses),
    identical calls build no plan and agree (bindings and descriptors: the next test, at one
    rank, where the process-wide spy counts one rank's work)."""
    spy = Spy(monkeypatch)

    def body(group):
        inputs = _inputs(group)
        first = [OPS[op](group, *inputs) for _ in range(3)]
        before = spy.snapshot(group)
        again = [OPS[op](group, *inputs) for _ in range(3)]
        group.synchronize()
        assert all(torch.equal(t, first[0]) for t in first[1:] + again), op
        return before[0] > 0, spy.snapshot(group)[0] - before[0], before

    results = ditron_ops.launch(body, world_size)
    for built_first, new_plans, _ in results:
        assert built_first and new_plans == 0, (op, results)


def test_identical_calls_bind_nothing(monkeypatch):
    """One rank (so the process-wide counts are this rank's): the fourth to sixth identical
    calls of every op build no plan and construct no ``BoundKernel``. (Descriptors: the
    interpreter's launch path makes them per call, so that no cache keeps a call's tensors
    alive; the compiled path converts each base address once, the GPU tier's check.)"""
    spy = Spy(monkeypatch)

    def body(group):
        inputs = _inputs(group)
        for fn in OPS.values():
            for _ in range(3):
                fn(group, *inputs)
        before = spy.snapshot(group)
        for fn in OPS.values():
            for _ in range(3):
                fn(group, *inputs)
        return before, spy.snapshot(group)

    (before, after), = ditron_ops.launch(body, 1)
    assert before == after, (before, after)


def test_new_address_stride_or_shape(monkeypatch):
    """ag_gemm: a weight at a new address builds no plan and binds no kernel; a new
    stride or shape builds a plan; every result is right for the values of its call."""
    spy = Spy(monkeypatch)

    def body(group):
        a, w, *_ = _inputs(group, m=5)
        want = lambda b: torch.cat([a] * 1) @ b  # noqa: E731  (one rank: the gather is a)
        out = ditron_ops.ag_gemm(a, w.t(), group, impl="fused")
        assert torch.allclose(out, want(w.t()), atol=1e-4)
        plans, binds = spy.snapshot(group)

        w2 = torch.randn(N, K)  # new address, same layout
        assert torch.allclose(ditron_ops.ag_gemm(a, w2.t(), group, impl="fused"), want(w2.t()), atol=1e-4)
        assert spy.snapshot(group) == (plans, binds), "a new address needs no plan"

        b3 = w.t().contiguous()  # [K, N] row-major: a new stride
        assert torch.allclose(ditron_ops.ag_gemm(a, b3, group, impl="fused"), want(b3), atol=1e-4)
        assert spy.snapshot(group)[0] == plans + 1, "a new stride builds a plan"

        w4 = torch.randn(N + 8, K)  # a new shape
        assert torch.allclose(ditron_ops.ag_gemm(a, w4.t(), group, impl="fused"), want(w4.t()),
                              atol=1e-4)
        assert spy.snapshot(group)[0] == plans + 2, "a new shape builds a plan"
        return True

    assert ditron_ops.launch(body, 1) == [True]


@pytest.mark.parametrize("aligned", [True, False])
def test_values_at_a_reused_address(aligned):
    """The same addresses with new values: an in-place update (an optimizer step on the
    weight, a reused activation buffer), and a tensor freed and its memory taken by a new one
    of the same layout. Unaligned operands (copied into the plan's padded buffers) and aligned
    ones (read through descriptors over the call's tensors) must both read the call's values."""
    k = K if aligned else K - 3  # fp32 rows of 52 bytes cannot back a descriptor

    def body(group):
        pool = torch.empty(4 * N * k)  # the memory the "freed" and "new" tensors share
        weight = pool[:N * k].view(N, k)
        a = torch.randn(6 * group.world_size, k)
        results = []
        for step in range(3):
            weight.normal_()  # in place: same address, new values
            a.normal_()
            rs = ditron_ops.gemm_rs(a, weight.t(), group, impl="fused", deterministic=True)
            ag = ditron_ops.ag_gemm(a[:6], weight.t(), group, impl="fused")
            results.append((rs.clone(), ag.clone(), a.clone(), weight.clone()))
        del weight  # "freed"; a new tensor of the same layout takes its memory
        fresh = pool[:N * k].view(N, k)
        fresh.copy_(torch.randn(N, k))
        ag = ditron_ops.ag_gemm(a[:6], fresh.t(), group, impl="fused")
        results.append((None, ag.clone(), a.clone(), fresh.clone()))
        return results

    for rs, ag, a, w in ditron_ops.launch(body, 1)[0]:
        assert torch.allclose(ag, a[:6] @ w.t(), atol=1e-4)
        if rs is not None:
            assert torch.allclose(rs, a @ w.t(), atol=1e-4)


def test_ag_gemm_calls_of_one_layout_share_one_plan():
    """The eager shortcut, a call with a gradient (the op path), explicit shard sizes and the
    op called directly build one plan: a graph captured after warming up on one path finds it."""
    def body(group):
        a, w = torch.randn(4, 16), torch.randn(8, 16)
        ditron_ops.ag_gemm(a, w.t(), group, impl="fused")
        ditron_ops.ag_gemm(a, w.clone().requires_grad_().t(), group, impl="fused")
        ditron_ops.ag_gemm(a, w.t(), group, impl="fused", shard_sizes=[4])
        torch.ops.ditron.ag_gemm(a, w.t(), None, group.group_name, [4], False, "fused")
        return group.plans.builds
    assert ditron_ops.launch(body, 1) == [1]


def test_cache_is_bounded_and_dropped_with_the_group():
    def body(group):
        group.plans.capacity = 3
        for n in range(1, 7):
            ditron_ops.all_reduce(torch.ones(8 * n), group)
        assert len(group.plans) == 3
        # an evicted plan is rebuilt and still right
        assert torch.equal(ditron_ops.all_reduce(torch.ones(8), group), torch.ones(8) * group.world_size)
        return group

    groups = ditron_ops.launch(body, 2)
    assert all(len(g.plans) == 0 for g in groups), "plans outlived their world"


def test_stale_plan_rebuild_allocates_nothing_and_may_run_during_capture(monkeypatch):
    """gemm_rs, then gemm_ar one-shot (whose slots grow the shared workspace: gemm_rs's plan
    goes stale), then gemm_rs inside a (simulated) CUDA-graph capture: the stale plan is rebuilt
    over the new buffer with its own padded copies, no new plan is refused, results are right.
    (Measured on the H200 before the fix: the gemm_rs graph test failed at W=2 and 4.)"""
    k = K - 3  # unaligned rows: the plans own padded copies of a and b
    from ditron_ops.runtime import workspace

    monkeypatch.setattr(workspace, "_MIN_DATA_BYTES", 256)  # workspaces sized to the calls

    def body(group):
        a = torch.randn(8 * group.world_size, k)
        w = torch.randn(N, k)
        want = [ditron_ops.gemm_rs(a, w.t(), group, impl="fused", deterministic=True)]
        ditron_ops.gemm_ar(a, w.t(), group, impl="fused", algorithm="one_shot", deterministic=True)
        stale = [p for p in group.plans._plans.values() if p.stale()]
        assert stale, "the one-shot call should have grown the workspace"
        pads = [(p.a_pad, p.b_pad) for p in stale]

        def capturing(what):
            raise AssertionError(f"refused during capture: {what}")

        monkeypatch.setattr(group, "refuse_during_capture", capturing)
        got = ditron_ops.gemm_rs(a, w.t(), group, impl="fused", deterministic=True)
        fresh = [p for p in group.plans._plans.values() if hasattr(p, "a_pad") and not p.stale()]
        assert any(p.a_pad is pa and p.b_pad is pb for p in fresh for pa, pb in pads), \
            "the rebuilt plan should own the stale one's padded copies"
        assert torch.equal(got, want[0])
        return True

    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "all_reduce", "flash_decode",
                                "ag_gemm_scaled fused", "ag_gemm_scaled baseline",
                                "local_attention"])
def test_a_plan_keeps_no_call_tensor_alive(op):
    """A cached plan holds its scratch, never the tensors of the call that built it (inputs or
    output): each call passes its own, and up to ``PLAN_CAPACITY`` plans per group each holding
    a first call's tensors ran a serving bench out of memory."""
    def call(group):  # the call's tensors, referenced only by the returned list
        gen = torch.Generator().manual_seed(group.rank)
        if op == "flash_decode":
            q, k = torch.randn(2, 4, 64, generator=gen), torch.randn(2, 32, 2, 64, generator=gen)
            lens = torch.tensor([32, 7], dtype=torch.int32)
            return [q, k, lens, ditron_ops.flash_decode(q, k, k, lens, group)]
        if op == "all_reduce":
            x = torch.randn(64, generator=gen)
            return [x, ditron_ops.all_reduce(x, group)]
        if op.startswith("ag_gemm_scaled"):  # fp8 rows and row-wise scales, gathered with them
            a = torch.randn(8, 32, generator=gen).to(torch.float8_e4m3fn)
            b = torch.randn(16, 32, generator=gen).to(torch.float8_e4m3fn).t()
            sa, sb = torch.rand(8, 1, generator=gen) + 0.5, torch.rand(1, 16, generator=gen) + 0.5
            out = ditron_ops.ag_gemm_scaled(a, b, sa, sb, group, out_dtype=torch.float16,
                                            impl=op.split()[1])
            return [a, b, sa, sb, out]
        if op == "local_attention":
            from ditron_ops.attention.ulysses import local_attention
            q, k = torch.randn(1, 2, 16, 64, generator=gen), torch.randn(1, 2, 16, 64, generator=gen)
            return [q, k, local_attention(q, k, k)]
        a, b = torch.randn(8, 16, generator=gen), torch.randn(16, 12, generator=gen)
        fn = ditron_ops.ag_gemm if op == "ag_gemm" else ditron_ops.gemm_rs
        return [a, b, fn(a, b, group, impl="fused")]

    def body(group):
        tensors = call(group)
        group.synchronize()
        if op not in ("ag_gemm_scaled baseline", "local_attention"):  # (plans cached elsewhere)
            assert len(group.plans) >= 1
        refs = [weakref.ref(t) for t in tensors]
        del tensors
        gc.collect()
        return [r() is None for r in refs]
    results = ditron_ops.launch(body, 2)
    assert all(all(alive_gone) for alive_gone in results), results
