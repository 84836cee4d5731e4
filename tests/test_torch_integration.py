"""Every op is a real torch.ops.ditron op: opcheck and torch.compile(fullgraph=True)."""
import pytest
import torch

import ditron_ops


def _opcheck_all(group):
    x = torch.randn(6, 4, device=group.device)
    w = group.world_size
    cases = [
        (torch.ops.ditron.all_gather.default, (x, group.group_name, [6] * w)),
        (torch.ops.ditron.reduce_scatter.default, (x, group.group_name, False)),
        (torch.ops.ditron.all_reduce.default, (x, group.group_name, "one_shot", True)),
        (torch.ops.ditron.all_reduce.default, (x, group.group_name, "two_shot", False)),
    ]
    # AOT dispatch traces with process-global patchers that are not thread-safe, so it runs with
    # one virtual rank; larger worlds check the schema and the fake implementation.
    utils = (("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
             if w == 1 else ("test_schema", "test_faketensor"))
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=utils)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_opcheck(world_size):
    assert all(ditron_ops.launch(_opcheck_all, world_size))


def _compiled(group):
    def step(x):
        g = ditron_ops.all_gather(x * 2, group)
        r = ditron_ops.reduce_scatter(g, group)
        return ditron_ops.all_reduce(r + 1, group, algorithm="one_shot") - 1

    x = torch.randn(4, 3, device=group.device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if group.world_size > 1 else "inductor")
    return torch.equal(compiled(x), step(x))


def test_compile_fullgraph_one_rank_inductor():
    assert ditron_ops.launch(_compiled, 1) == [True]


def test_virtual_ranks_run_their_backward_on_their_own_thread():
    """Autograd's one worker thread per device would run every rank's backward nodes in turn (a
    node meeting its peers then waits for ranks queued behind it): each rank runs its own."""
    def body(group):
        return torch._C._is_multithreading_enabled()
    assert ditron_ops.launch(body, 2) == [False, False]
    assert torch._C._is_multithreading_enabled()  # the caller's thread is left as it was
