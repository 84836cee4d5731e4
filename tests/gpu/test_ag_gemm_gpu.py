"""GPU tier (H200): ag_gemm on a virtual world with the compiled TMA kernels."""
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.bench.shapes import DEFAULT_M, DEFAULT_WORLD_SIZE, get_model
from ditron_ops.testing.ag_gemm_checks import ag_gemm_inputs, check_ag_gemm

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()
MODELS = ["LLaMA-7B", "LLaMA-3.1-70B", "Qwen2-72B"]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("model", MODELS)
def test_ag_gemm_model_shapes_bf16(world_size, model):
    shape = get_model(model)
    sizes = [DEFAULT_M // world_size] * world_size
    ditron_ops.launch(check_ag_gemm, world_size,
                      args=(sizes, shape.n // DEFAULT_WORLD_SIZE, shape.k, torch.bfloat16))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ag_gemm_odd_shapes(world_size, dtype):
    sizes = [1000 + 37 * q if q % 3 else 1 + q for q in range(world_size)]

    def body(group):
        check_ag_gemm(group, sizes, 999, 1001, dtype)  # odd K: padded pitch, b copied
        check_ag_gemm(group, sizes, 1000, 1024, dtype, weight_layout=False, use_out=True)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("producer", ["pull", "push", "copy"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_ag_gemm_each_producer(monkeypatch, world_size, producer):
    """The SM pull producer and the one-launch push call (the default picks copy engines at
    these sizes): model shape, odd shapes, back-to-back sizes, graph replay."""
    from ditron_ops.gemm import _ag_launch as _launch

    monkeypatch.setattr(_launch, "PRODUCER", producer)
    shape = get_model("LLaMA-7B")
    odd = [1000 + 37 * q if q % 3 else 1 + q for q in range(world_size)]

    def body(group):
        check_ag_gemm(group, [DEFAULT_M // world_size] * world_size, shape.n // DEFAULT_WORLD_SIZE,
                      shape.k, torch.bfloat16)
        check_ag_gemm(group, odd, 999, 1001, torch.float16)
        for i in range(4):
            check_ag_gemm(group, [(i * 97 + q * 131) % 700 for q in range(world_size)],
                          64 + 96 * i, 128 + 64 * i, torch.bfloat16, seed=i)
        return _graph_replay(group, 2)
    assert ditron_ops.launch(body, world_size) == [2] * world_size


def test_ag_gemm_back_to_back_varying_shapes():
    def body(group):
        for i in range(12):
            sizes = [(i * 97 + q * 131) % 700 for q in range(group.world_size)]
            check_ag_gemm(group, sizes, 64 + 96 * (i % 5), 128 + 64 * (i % 4), torch.bfloat16,
                          seed=i, return_gathered=i % 2 == 0)
        return True
    assert ditron_ops.launch(body, 4) == [True] * 4


def _graph_replay(group, replays):
    sizes = [256 + 64 * q for q in range(group.world_size)]
    a, b, bias = ag_gemm_inputs(group, sizes, 512, 768, torch.bfloat16, True)
    static = a.clone()
    out = ditron_ops.ag_gemm(static, b, bias=bias, impl="fused", shard_sizes=sizes)  # warm-up
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            out = ditron_ops.ag_gemm(static, b, bias=bias, impl="fused", shard_sizes=sizes)
    group.barrier()
    for i in range(replays):
        new, _, _ = ag_gemm_inputs(group, sizes, 512, 768, torch.bfloat16, True, seed=i + 1)
        static.copy_(new)
        graph.replay()
        group.synchronize()
        want = ditron_ops.ag_gemm(static, b, bias=bias, impl="fused", shard_sizes=sizes)
        group.synchronize()
        assert torch.equal(out, want), f"replay {i}"
    return replays


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ag_gemm_cuda_graph_capture_and_replay(world_size):
    assert ditron_ops.launch(_graph_replay, world_size, args=(4,)) == [4] * world_size
