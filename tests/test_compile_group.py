"""``group=None`` inside compiled functions: one compiled function serves every rank and every
launch, in every backend, and the ranks' agreement exchanges stay in step while a peer compiles.

Two bugs this guards against: a traced graph that named the tracing rank's group (every other
rank then ran the op as that rank), and ``torch.compiler.is_compiling()``, a process-wide flag
that is True on every thread while one thread compiles, which made the other ranks' eager calls
skip their agreement exchange.
"""
import time

import pytest
import torch

import ditron_ops
from ditron_ops.runtime.group import CONTEXT


def _step(a, w1, w2):
    h = ditron_ops.ag_gemm(a, w1)                 # [W * 4, 6]
    y = ditron_ops.gemm_rs(h, w2, deterministic=True)   # this rank's rows of the sum
    return ditron_ops.all_reduce(y * 2, algorithm="one_shot", deterministic=True)


DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
               torch.cuda.is_available(), reason="a CPU world runs in the interpreter (CPU-only processes)")),
           pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(rank, device, rows=4):
    gen = torch.Generator().manual_seed(100 + rank)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return tuple(torch.randn(*shape, generator=gen).to(device, dtype)
                 for shape in ((rows, 8), (8, 6), (6, 5)))


def _run(compiled, world_size, device="cpu"):
    def body(group):
        a, w1, w2 = _inputs(group.rank, device)
        got = compiled(a, w1, w2)          # compiled first: a peer may still be eager
        want = _step(a, w1, w2)
        return torch.equal(got, want), tuple(got.shape)
    return ditron_ops.launch(body, world_size, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_context_group_compiled_across_ranks_and_launches(backend, device):
    for world_size in (2, 3, 8):
        # Dynamo checks its cache before it takes its compile lock, so the W ranks of a new
        # world may each trace once: a fresh function per world keeps under its recompile limit
        torch._dynamo.reset()
        compiled = torch.compile(_step, fullgraph=True, backend=backend)
        for _ in range(2):  # a second launch reuses the graphs with its own groups
            results = _run(compiled, world_size, device)
            assert all(ok for ok, _ in results), (backend, world_size, results)
            # gemm_rs of W * 4 gathered rows: 4 rows of the sum per rank
            assert [shape for _, shape in results] == [(4, 5)] * world_size


@pytest.mark.parametrize("device", DEVICES)
def test_uneven_rows_get_their_own_shape_per_rank(device):
    """gemm_rs whose rows do not split evenly: each rank's graph has its own output shape."""
    torch._dynamo.reset()

    def step(h, w2):
        return ditron_ops.gemm_rs(h, w2, deterministic=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")

    def body(group):
        gen = torch.Generator().manual_seed(7)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        h, w2 = (torch.randn(*s, generator=gen).to(device, dtype) for s in ((7, 6), (6, 5)))
        return tuple(compiled(h, w2).shape), torch.equal(compiled(h, w2), step(h, w2))

    for _ in range(2):
        assert ditron_ops.launch(body, 3, device) == [((3, 5), True), ((2, 5), True), ((2, 5), True)]


def test_traced_graph_names_the_context_not_a_rank():
    """The graph's ops carry ``CONTEXT``: what a later launch's ranks resolve to their own."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _run(compiled, 2, device)
    first = len(graphs)  # one, or one per rank where a rank checked the guards mid-compile
    _run(compiled, 2, device)
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


def test_a_peer_inside_torch_compile_is_waited_for_past_the_bound():
    """Host barriers do not count the time a peer spends in torch.compile (an inductor compile
    outlasts any wait bound, and Dynamo serializes the ranks' compiles)."""
    def slow_backend(gm, example_inputs):
        time.sleep(2.5)  # a compile 2.5x the bound below
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend=slow_backend)

    def body(group):
        x = torch.ones(4)
        if group.rank == 1:
            x = compiled(x)  # rank 0 meets it at all_reduce's agreement meanwhile
        return ditron_ops.all_reduce(x).tolist()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        pytest.skip("the CPU world shows it; the barrier is the same on the GPU")
    assert ditron_ops.launch(body, 2, device, timeout_s=1.0) == [[3.0] * 4] * 2


def test_a_rank_calls_its_compiled_function_while_a_peer_fx_traces():
    """Dynamo's FX-tracing check reads a process-wide flag: a rank entering a compiled function
    while a peer FX-traces (as aot_eager's and inductor's make_fx do) goes on to Dynamo instead
    of raising (H200, W=8, aot_eager: a rank raised "FX to symbolically trace a
    dynamo-optimized function"). Rank 1 calls only once rank 0's trace is under way."""
    import threading

    tracing = threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x):
            tracing.set()
            time.sleep(1.0)  # FX tracing stays on meanwhile
            return x

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1, backend="eager")

    def body(group):
        if group.rank == 0:
            torch.fx.symbolic_trace(Slow())
        else:
            assert tracing.wait(30)
            time.sleep(0.1)  # inside rank 0's trace
        return compiled(torch.ones(2, device=group.device)).tolist()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert ditron_ops.launch(body, 2, device) == [[2.0, 2.0]] * 2
    assert not torch._dynamo.config.force_compile_during_fx_trace  # launch's patch is undone


def _mlp_step(a, w1, w2):
    h, gathered = ditron_ops.ag_gemm(a, w1, return_gathered=True)
    row = torch.arange(gathered.shape[0], dtype=gathered.dtype).unsqueeze(1)  # each row its own grad
    return ditron_ops.gemm_rs(h, w2, deterministic=True).square().sum() + (gathered * row).sum()


def _attention_step(q, k, v):
    return ditron_ops.ulysses_attention(q, k, v, causal=True).float().square().sum()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU world runs in the interpreter (CPU-only processes)")
@pytest.mark.parametrize("step", [_mlp_step, _attention_step], ids=["mlp", "attention"])
def test_compiled_backward_matches_eager_on_every_rank(step):
    """Backward through a compiled graph of group=None ops: the backward's collectives are the
    ops themselves (AOTAutograd traces them with fake tensors) and ag_gemm's gathered-rows
    gradient lands at each rank's own offset."""
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")

    def body(group):
        gen = torch.Generator().manual_seed(group.rank)
        if step is _mlp_step:
            tensors = [torch.randn(*s, generator=gen).requires_grad_() for s in ((4, 8), (8, 6), (6, 5))]
        else:
            tensors = [torch.randn(1, 4, 2, 64, generator=gen).half().requires_grad_() for _ in "qkv"]
        grads = []
        for fn in (compiled, step):
            for t in tensors:
                t.grad = None
            fn(*tensors).backward()
            grads.append([t.grad.clone() for t in tensors])
        return all(torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-3)
                   for x, y in zip(*grads))

    for _ in range(3):  # later launches reuse graphs whichever rank traced them
        assert ditron_ops.launch(body, 2, "cpu") == [True, True]
