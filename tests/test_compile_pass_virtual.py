"""``ditron_ops.compile`` in the virtual world (CPU interpreter): each ``launch`` rank thread
joins PyTorch's threaded process group (``multi_threaded_pg``, installed by the test), writes
functional collectives over it, and the compiled graph runs ditron ops on the thread's virtual
group (``compile.groups``: a threaded process group maps to ``CONTEXT``)."""
import pytest
import torch

import ditron_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


def _body(group, store, rows=8, k=32, n=48):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import ditron_ops.compile as dc
    from ditron_ops.compile import passes
    from ditron_ops.testing.compile_checks import fresh_compile

    w = group.world_size
    dist.init_process_group("threaded", rank=group.rank, world_size=w, store=store)
    try:
        pg = dist.group.WORLD
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows * w, k, generator=gen).chunk(w)[group.rank].contiguous()
        w1, w2 = (torch.randn(*s, generator=gen) / s[0] ** 0.5 for s in ((k, n), (n, k)))

        def mlp(x, w1, w2):
            h = funcol.all_gather_tensor(x, 0, pg) @ w1
            return funcol.reduce_scatter_tensor(h.relu() @ w2, "sum", 0, pg)

        want = mlp(x, w1, w2)
        start = len(passes._reports)
        # inductor's config is per thread (a ContextVar in torch 2.13): enabled on each rank
        with dc.enable(allow_reference=True), fresh_compile():
            got = torch.compile(mlp)(x, w1, w2)
        mine = f"group {group.group_name!r}"  # (the reports of every rank's compile are shared)
        entries = [e for r in passes._reports[start:] for e in r.entries if mine in e.detail]
        return {"max_err": (got - want).abs().max().item(), "shape": tuple(got.shape),
                "rewritten": sorted(e.op for e in entries if e.rewritten),
                "left": [e.detail for e in entries if not e.rewritten],
                "symmetric": group.has_symmetric_memory,  # the fused ops, not the reference path
                "plans": sorted({str(key[0]) for key in group.plans._plans})}
    finally:
        dist.destroy_process_group()


def test_threaded_pg_compiles_to_ops_on_the_virtual_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (_install_threaded_pg,
                                                                       _uninstall_threaded_pg)

    _install_threaded_pg()  # per-thread c10d world; the group-name registry per thread too
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        torch._dynamo.reset()
        results = ditron_ops.launch(_body, 2, "cpu", args=(dist.HashStore(),))
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
        torch._dynamo.reset()
    for rank, res in enumerate(results):
        assert res["rewritten"] == ["ag_gemm", "gemm_rs"] and not res["left"], (rank, res)
        assert res["shape"] == (8, 32) and res["max_err"] < 1e-4, (rank, res)
        # the ops ran on this rank's virtual group (the plans eager ag_gemm + gemm_rs build)
        assert res["symmetric"] and res["plans"] == ["all_gather", "reduce_scatter"], (rank, res)
