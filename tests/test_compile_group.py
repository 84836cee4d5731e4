"""``group=None`` inside compiled functions: one compiled function serves every rank and every
launch, in every backend, and the ranks' agreement exchanges stay in step while a peer compiles.

Two bugs this guards against: a traced graph that named the tracing rank's group (every other
rank then ran the op as that rank), and ``torch.compiler.is_compiling()``, a process-wide flag
that is True on every thread while one thread compiles, which made the other ranks' eager calls
skip their agreement exchange.
"""
import pytest
import torch

import ditron_ops
from ditron_ops.runtime.group import CONTEXT


def _step(a, w1, w2):
    h = ditron_ops.ag_gemm(a, w1)                 # [W * 4, 6]
    y = ditron_ops.gemm_rs(h, w2)                 # this rank's rows of the sum
    return ditron_ops.all_reduce(y * 2, algorithm="one_shot")


def _inputs(rank, rows=4):
    gen = torch.Generator().manual_seed(100 + rank)
    a = torch.randn(rows, 8, generator=gen)
    w1 = torch.randn(8, 6, generator=gen)
    w2 = torch.randn(6, 5, generator=gen)
    return a, w1, w2


def _run(compiled, world_size):
    def body(group):
        a, w1, w2 = _inputs(group.rank)
        got = compiled(a, w1, w2)          # compiled first: a peer may still be eager
        want = _step(a, w1, w2)
        return torch.equal(got, want), tuple(got.shape)
    return ditron_ops.launch(body, world_size)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_context_group_compiled_across_ranks_and_launches(backend):
    for world_size in (2, 3, 8):
        # Dynamo checks its cache before it takes its compile lock, so the W ranks of a new
        # world may each trace once: a fresh function per world keeps under its recompile limit
        torch._dynamo.reset()
        compiled = torch.compile(_step, fullgraph=True, backend=backend)
        for _ in range(2):  # a second launch reuses the graphs with its own groups
            results = _run(compiled, world_size)
            assert all(ok for ok, _ in results), (backend, world_size, results)
            # gemm_rs of W * 4 gathered rows: 4 rows of the sum per rank
            assert [shape for _, shape in results] == [(4, 5)] * world_size


def test_uneven_rows_get_their_own_shape_per_rank():
    """gemm_rs whose rows do not split evenly: each rank's graph has its own output shape."""
    torch._dynamo.reset()

    def step(h, w2):
        return ditron_ops.gemm_rs(h, w2)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")

    def body(group):
        gen = torch.Generator().manual_seed(7)
        h, w2 = torch.randn(7, 6, generator=gen), torch.randn(6, 5, generator=gen)
        return tuple(compiled(h, w2).shape), torch.equal(compiled(h, w2), step(h, w2))

    for _ in range(2):
        assert ditron_ops.launch(body, 3) == [((3, 5), True), ((2, 5), True), ((2, 5), True)]


def test_traced_graph_names_the_context_not_a_rank():
    """The graph's ops carry ``CONTEXT``: what a later launch's ranks resolve to their own."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    _run(compiled, 2)
    first = len(graphs)  # one, or one per rank where a rank checked the guards mid-compile
    _run(compiled, 2)
    assert len(graphs) == first <= 2  # a later launch's ranks reuse them
    names = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("ditron."):
                op = getattr(node.target, "default", node.target)  # packet or overload
                schema = [arg.name for arg in op._schema.arguments]
                names.append(node.args[schema.index("group_name")])
    assert names == [CONTEXT] * 3 * first


def test_context_name_outside_a_group_is_a_typed_error():
    with pytest.raises(ValueError, match="no group given and none is current"):
        ditron_ops.runtime.resolve_group(CONTEXT)
