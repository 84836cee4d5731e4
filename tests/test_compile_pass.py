"""``ditron_ops.compile``: the post-grad pass on 2 and 3 gloo processes (TorchGroup), on DTensor
tensor-parallel code (a sequence-parallel Transformer block, a row-sharded MLP, a
tensor-parallel head) and on hand-written functional collectives. Compiled with inductor (a C++
compiler on the CPU machine); forward and backward against eager."""
import pytest
import torch

from ditron_ops.testing import run_gloo
from ditron_ops.testing.compile_checks import funcol_body, patterns_body, tp_compile_body

TOL = 1e-4  # fp32: one GEMM over concatenated K vs a sum of GEMMs, reference sums in rank order


def _norm_registered() -> bool:
    import ditron_ops  # noqa: F401

    return hasattr(torch.ops.ditron, "all_reduce_rmsnorm")


@pytest.mark.parametrize("world_size", [2, 3])
def test_tp_modules_compile_to_ditron_ops(world_size):
    results = run_gloo(tp_compile_body, world_size, timeout_s=400)
    for rank, res in enumerate(results):
        for det in (False, True):
            r = res[det]
            assert r["max_err"] < TOL, (rank, det, r)
            assert r["modes"] == [det], (rank, det, r)
            assert {"ditron.ag_gemm.default", "ditron.gemm_rs.default",
                    "ditron.gemm_ar.default"} <= set(r["ditron_ops"]), (rank, det, r)
            # forward: 3 gathers (attention, ffn, 2-D mlp) and 3 scatters, 2 all-reduces;
            # backward: the same collectives the other way round
            assert r["rewritten"].count("ag_gemm") == 6 and r["rewritten"].count("gemm_rs") == 6
            assert r["rewritten"].count("gemm_ar") == 4, (rank, det, r)
            # what is left is the row-parallel layer with a bias (its reduce-scatter sums the
            # bias): the one collective still in the graphs, with its reason
            assert r["c10d_left"] == ["_c10d_functional.reduce_scatter_tensor.default"], r
            assert [op for op, _ in r["left"]] == ["gemm_rs"] and "bias" in r["left"][0][1]
            assert r["graphs"] == 2  # forward and backward, both rewritten
        assert res[True]["repeat_equal"], (rank, res[True])
        inf = res["inference"]
        assert inf["kinds"] == ["inference"] and inf["max_err"] < TOL, inf
        if _norm_registered():
            assert "all_reduce_rmsnorm" in inf["rewritten"], inf


def test_functional_collectives_compile_to_ditron_ops():
    results = run_gloo(funcol_body, 2, timeout_s=300)
    for rank, res in enumerate(results):
        for det in ("False", "True"):
            r = res[det]
            assert r["rewritten"] == ["ag_gemm", "gemm_ar", "gemm_rs"] and not r["left"], r
            assert r["max_err"] <= 1e-5 * max(1.0, r["scale"]) and r["shape_ok"], r
        assert res["True"]["repeat_equal"], res


def test_enable_disable_and_context_form():
    import torch._inductor.config as config

    import ditron_ops.compile as dc

    def mine(graph):
        pass

    before = config.post_grad_custom_post_pass
    config.post_grad_custom_post_pass = mine
    try:
        with dc.enable(ops=("gemm_rs",)):
            assert dc.is_enabled()
            value = config.post_grad_custom_post_pass
            assert isinstance(value, list) and value[0] is mine and value[1].ops == ("gemm_rs",)
        assert config.post_grad_custom_post_pass is mine and not dc.is_enabled()
        dc.enable()
        dc.enable()  # twice: still one pass of ours
        value = config.post_grad_custom_post_pass
        assert len(value) == 2 and dc.is_enabled()
        dc.disable()
        assert config.post_grad_custom_post_pass is mine and not dc.is_enabled()
        with pytest.raises(ValueError, match="unknown ops"):
            dc.enable(ops=("matmul",))
    finally:
        config.post_grad_custom_post_pass = before


def test_group_mapping_is_a_typed_error_without_a_process_group():
    import torch.distributed as dist

    from ditron_ops.compile.groups import GroupMappingError, ditron_group

    assert not dist.is_initialized()
    with pytest.raises(GroupMappingError, match="not initialised"):
        ditron_group("0")


def test_explain_without_collectives_says_so():
    import ditron_ops.compile as dc

    report = dc.explain(lambda x: x @ x.t(), torch.randn(4, 4))
    assert report.reports == [] and "no collective" in str(report)


def test_pass_rewrites_and_leaves_with_reasons():
    (res,) = run_gloo(patterns_body, 1, timeout_s=300)
    r = res["refusals"]
    assert r["rewritten"] == ["all_reduce_rmsnorm"] and r["max_err"] < 1e-3, r
    reasons = " | ".join(why for _, why in r["left"])
    # (inductor folds the broadcasting [1, N] + [M, N] sum into addmm: refused as a bias)
    for expected in ("not [H] = [16]", "differ in shape or dtype", "changes its last dim",
                     "bias added before the reduction"):
        assert expected in reasons, (expected, r["left"])
    assert len(r["left"]) == 4, r["left"]  # the norm with a [1] weight, three reduce-scatters
    r = res["reused"]  # fp16 rewritten, bf16 matched (the CPU path takes fp16/fp32 only)
    assert r["rewritten"] == ["all_reduce_rmsnorm"] and max(r["errs"][:2]) < 1e-2, r
    assert len(r["left"]) == 1 and "the graph has bfloat16" in r["left"][0][1], r
    r = res["no_reference"]
    assert r["rewritten"] == [] and len(r["left"]) == 2, r
    assert all("no symmetric memory" in why and "allow_reference" in why for _, why in r["left"]), r
    r = res["dynamic"]
    assert r["rewritten"] == [] and r["left"] and r["max_err"] < 1e-5, r
    assert all("symbolic (dynamic) shape" in why for _, why in r["left"]), r


def test_cached_graph_runs_in_a_new_process(tmp_path, monkeypatch):
    from ditron_ops.testing.checks import run_child

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    runs = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        runs.append(run_child(__file__, str(tmp_path / name), timeout_s=300))
    first, second = runs
    ops = ["ditron::ag_gemm", "ditron::gemm_ar", "ditron::gemm_rs"]
    assert first["pass_ran"] and first["ditron_ran"] == ops and first["max_err"] < 1e-5, first
    # the second process loads the rewritten graph from the cache: the pass does not run, and
    # the graph's group names resolve there (TorchGroups made on first use)
    assert not second["pass_ran"] and sum(second["hits"].values()) >= 1, second
    assert second["ditron_ran"] == ops and second["max_err"] < 1e-5, second
    for run in runs:
        assert run["remap"] == {"same_name": True, "new_group": True, "nvshmem_later": True}, run


if __name__ == "__main__":  # the cache test's child process
    import json
    import sys

    from ditron_ops.testing.compile_checks import cache_child

    print("RESULT " + json.dumps(cache_child(sys.argv[1])), flush=True)


def test_producer_refuses_broadcast_mixed_dtypes_and_column_views():
    """The reducing side's matcher on traced graphs (no process group): a broadcasting sum of
    products, products of two dtypes and a view changing the last dim leave the pattern."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ditron_ops.compile import passes

    def reason(fn, *shapes, dtypes=None):
        dtypes = dtypes or [torch.float32] * len(shapes)
        gm = make_fx(fn, tracing_mode="fake")(*(torch.randn(*s).to(d) for s, d in zip(shapes, dtypes)))
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        with pytest.raises(passes._Left) as left:
            terms, _ = passes._producer(out)
            passes._check_terms(terms)
        return str(left.value)

    sq = ((4, 8), (8, 6), (4, 8), (8, 6))
    assert "differ in shape or dtype" in reason(
        lambda a1, b1, a2, b2: torch.mm(a1[:1], b1) + torch.mm(a2, b2), *sq)
    assert "differ in shape or dtype" in reason(
        lambda a1, b1, a2, b2: torch.mm(a1, b1) + torch.mm(a2, b2), *sq,
        dtypes=[torch.float16] * 2 + [torch.float32] * 2)
    assert "changes its last dim" in reason(lambda a, b: torch.mm(a, b).view(-1, 3), *sq[:2])
    gm = make_fx(lambda a, b: torch.mm(a, b).view(2, 2, 6), tracing_mode="fake")(
        torch.randn(4, 8), torch.randn(8, 6))
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert len(passes._producer(out)[0]) == 1  # a view keeping the columns is matched
