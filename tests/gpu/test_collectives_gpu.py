"""GPU tier (H200): collectives on a virtual world with the compiled kernels."""
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.testing import check_collectives, make_input

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(4099, 1001), (37, 3)])
def test_collectives_odd_sizes(world_size, dtype, rows, cols):
    ditron_ops.launch(check_collectives, world_size, args=(rows, cols, dtype))


@pytest.mark.parametrize("world_size", [2, 8])
def test_collectives_large_bf16(world_size):
    ditron_ops.launch(check_collectives, world_size, args=(8192, 4096, torch.bfloat16, False))


def _graph_replay(group, replays):
    """Capture all_gather + reduce_scatter + all_reduce in a CUDA graph, replay with new inputs."""
    x = make_input((513, 257), torch.bfloat16, group.device, group.rank)
    static = x.clone()

    def step():
        return (ditron_ops.all_gather(static), ditron_ops.reduce_scatter(static),
                ditron_ops.all_reduce(static, algorithm="one_shot"),
                ditron_ops.all_reduce(static, algorithm="two_shot"))

    step()  # warm-up: allocates the workspace outside capture
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:  # capture is host-only work; PyTorch's capture state is not thread-safe
        with torch.cuda.graph(graph, stream=group.stream, capture_error_mode="thread_local"):
            outs = step()
    group.barrier()
    for i in range(replays):
        static.copy_(make_input(static.shape, static.dtype, group.device, 100 * i + group.rank))
        graph.replay()
        group.synchronize()
        want = (ditron_ops.reference.all_gather(static, group),
                ditron_ops.reference.reduce_scatter(static, group),
                ditron_ops.reference.all_reduce(static, group),
                ditron_ops.reference.all_reduce(static, group))
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref), f"replay {i}"
    return replays


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_graph_capture_and_replay(world_size):
    assert ditron_ops.launch(_graph_replay, world_size, args=(5,)) == [5] * world_size


def _capture_without_warmup(group):
    x = torch.ones(64, device=group.device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=group.stream, capture_error_mode="thread_local"):
            ditron_ops.all_gather(x)
    except ditron_ops.DitronError as exc:
        return str(exc)
    return "no error"


def test_capture_before_warmup_raises_clear_error():
    msg = ditron_ops.launch(_capture_without_warmup, 1)[0]
    assert "CUDA-graph capture" in msg and "before capturing" in msg
