"""GPU tier (H200): gemm_rs / gemm_ar on a virtual world, bitwise vs the order-exact reference."""
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.bench.shapes import DEFAULT_M, DEFAULT_WORLD_SIZE, get_model
from ditron_ops.testing.gemm_rs_checks import check_gemm_reduce, check_tp_mlp_autograd, gemm_rs_inputs, spy_own_tail

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("model", ["LLaMA-7B", "Qwen2-72B"])
def test_model_shapes_bf16(world_size, model):
    shape = get_model(model)  # GEMM-RS of the MLP: [M, N/8] @ [N/8, K]
    ditron_ops.launch(check_gemm_reduce, world_size,
                      args=(DEFAULT_M, shape.k, shape.n // DEFAULT_WORLD_SIZE, torch.bfloat16))


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_odd_shapes(world_size, algorithm):
    def body(group):
        check_gemm_reduce(group, 1001, 999, 1001, torch.bfloat16, algorithm=algorithm)
        check_gemm_reduce(group, 37, 512, 256, torch.float16, algorithm=algorithm, weight_layout=False)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


def _determinism(group):
    a, b = gemm_rs_inputs(group, 2048, 1024, 512, torch.bfloat16, seed=1)
    with ditron_ops.deterministic():
        first = ditron_ops.gemm_ar(a, b, group)
        for _ in range(100):
            assert torch.equal(ditron_ops.gemm_ar(a, b, group), first)
        for k in (1, 7, 16, 129, 1000, 2047):
            assert torch.equal(ditron_ops.gemm_ar(a[:k], b, group), first[:k]), k
    return True


def test_run_to_run_and_batch_invariance():
    assert ditron_ops.launch(_determinism, 4) == [True] * 4


def _graph_replay(group):
    a, b = gemm_rs_inputs(group, 512, 768, 256, torch.bfloat16)
    static = a.clone()
    run = lambda: (ditron_ops.gemm_rs(static, b, group, deterministic=True),  # noqa: E731
                   ditron_ops.gemm_ar(static, b, group, deterministic=True, algorithm="one_shot"))
    run()
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            outs = run()
    group.barrier()
    for i in range(3):
        static.copy_(gemm_rs_inputs(group, 512, 768, 256, torch.bfloat16, seed=i + 2)[0])
        graph.replay()
        group.synchronize()
        want = run()
        group.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(outs, want)), i
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_graph_capture_and_replay(world_size):
    assert ditron_ops.launch(_graph_replay, world_size) == [True] * world_size


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_split_tail_forced(world_size, monkeypatch):
    """Whole own tiles as halves next to peers' partials and boundary rows (the tail rule forced
    to 5 tiles; the model shapes above meet the rule itself at W = 2 and 4), bitwise."""
    from ditron_ops.gemm._core_configs import select_config
    from ditron_ops.gemm import _rs_launch as _launch

    share = torch.cuda.get_device_properties(0).multi_processor_count // world_size
    if not select_config(4000, 1000, share, torch.device("cuda"), deterministic=True).split_tail:
        pytest.skip("the rule's tiles for this shape have no split tail")
    seen = spy_own_tail(monkeypatch)
    monkeypatch.setattr(_launch, "tail_tiles",
                        lambda tiles, programs, cfg: min(tiles, 5) if cfg.split_tail else 0)
    ditron_ops.launch(lambda g: check_gemm_reduce(g, 4000, 1000, 520, torch.bfloat16), world_size)
    assert seen and all(t == 5 for t in seen), seen


@pytest.mark.parametrize("world_size", [2, 4])
def test_autograd_tensor_parallel_mlp(world_size):
    """ag_gemm -> gemm_rs forward and backward on the rank threads (autograd's CUDA worker thread
    would run every rank's backward in turn), bf16, uneven shards."""
    sizes = [256 + 64 * r for r in range(world_size)]
    assert ditron_ops.launch(check_tp_mlp_autograd, world_size,
                             args=(sizes, 512, 256, torch.bfloat16, 2e-2)) == [True] * world_size
