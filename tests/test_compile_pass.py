"""``ditron_ops.compile``: the post-grad pass on 2 and 3 gloo processes (TorchGroup), on DTensor
tensor-parallel code (a sequence-parallel Transformer block, a row-sharded MLP, a
tensor-parallel head) and on hand-written functional collectives. Compiled with inductor (a C++
compiler on the CPU machine); forward and backward against eager."""
import pytest
import torch

from ditron_ops.testing import run_gloo
from ditron_ops.testing.compile_checks import funcol_body, tp_compile_body

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
