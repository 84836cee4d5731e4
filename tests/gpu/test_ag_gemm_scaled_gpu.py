"""GPU tier: fp8 ``ag_gemm_scaled`` / ``gemm_rs_scaled`` / ``gemm_ar_scaled`` (portable core, and
the fp8 WS core as consumer and producer) on a virtual world, against the float64 product of
the dequantized operands, every scale mode, K off 128 (block tails), graphs."""
import threading
import time

import pytest
import torch

import ditron_ops
from ditron_ops.testing.scaled_checks import (check_ag_gemm_scaled, check_close,
                                              check_reduce_scaled, dequantized, reduce_inputs,
                                              reduce_operands, scaled_inputs)

pytestmark = pytest.mark.gpu
MODES = ["tensor", "row", "block"]
_CAPTURE_LOCK = threading.Lock()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_scaled_modes(world_size, mode):
    sizes = [512 + 37 * q for q in range(world_size)]

    def body(group):
        check_ag_gemm_scaled(group, sizes, 4096, 1536, mode)
        check_ag_gemm_scaled(group, sizes, 1000, 1000, mode, out_dtype=torch.float16, bias=True)
        check_ag_gemm_scaled(group, sizes, 1000, 1000, mode, impl="baseline")
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("producer", ["push", "copy", "pull"])
@pytest.mark.parametrize("mode", MODES)
def test_scaled_each_producer(monkeypatch, producer, mode):
    from ditron_ops.gemm import _ag_launch
    monkeypatch.setattr(_ag_launch, "PRODUCER", producer)
    sizes = [300, 0, 517]
    assert ditron_ops.launch(lambda g: check_ag_gemm_scaled(g, sizes, 2176, 384, mode), 3) == \
        [True] * 3


@pytest.mark.parametrize("producer", ["copy", "pull"])
@pytest.mark.parametrize("mode", MODES)
def test_scaled_ws_consumer(monkeypatch, producer, mode):
    """``SCALED_CONSUMER_CORE = "ws"``: the waiting fp8 split kernel consumes the gathered rows
    (built on every rank: ``consumer_config`` asked), twice per plan, a rank without rows, N and
    K off the tiles, with and without bias."""
    from ditron_ops.gemm import _ag_launch, _ws_scaled
    from ditron_ops.gemm._ws_launch import core_refusal
    if core_refusal(torch.device("cuda")) is not None:
        pytest.skip(core_refusal(torch.device("cuda")))
    monkeypatch.setattr(_ag_launch, "PRODUCER", producer)
    monkeypatch.setattr(_ag_launch, "SCALED_CONSUMER_CORE", "ws")
    built = []
    config = _ws_scaled.consumer_config
    monkeypatch.setattr(_ws_scaled, "consumer_config",
                        lambda *args: built.append(args) or config(*args))
    sizes = [300, 0, 517]

    def body(group):
        for _ in range(2):
            check_ag_gemm_scaled(group, sizes, 2176, 384, mode)
            check_ag_gemm_scaled(group, sizes, 1000, 1000, mode, bias=True, seed=1)
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3
    assert len(built) >= 3 * 2, built  # (each rank's two plans)


def _captured(group, step):
    """``step`` run once, then captured in a CUDA graph (one rank at a time); returns
    ``(graph, output)`` once every rank has captured."""
    step()
    group.synchronize()
    g = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(g, stream=torch.cuda.current_stream(),
                              capture_error_mode="thread_local"):
            out = step()
    group.barrier()
    return g, out


@pytest.mark.parametrize("mode", MODES)
def test_scaled_graph_replay(mode):
    sizes = [256, 256]

    def body(group):
        a_list, sa_list, b, sb = scaled_inputs(sizes, 1024, 512, mode, group.device)
        r = group.rank
        a, sa = a_list[r].clone(), sa_list[r].clone()

        g, out = _captured(group, lambda: ditron_ops.ag_gemm_scaled(a, b, sa, sb, group,
                                                                    impl="fused"))
        a2, sa2, _, _ = scaled_inputs(sizes, 1024, 512, mode, group.device, seed=5)
        a.copy_(a2[r])
        sa.copy_(sa2[r])
        g.replay()
        group.synchronize()
        a64, b64 = dequantized(a2, sa2, b, sb, mode)
        check_close(out, a64, b64)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["gemm_rs_scaled", "gemm_ar_scaled"])
def test_reduce_scaled_modes(op, mode, world_size):
    k_sizes = [1024 + 128 * q if q % 3 != 2 else 1000 for q in range(world_size)]

    def body(group):
        check_reduce_scaled(group, 1000, k_sizes, 1536, mode, op)
        check_reduce_scaled(group, 1000, k_sizes, 1000, mode, op, bias=True)
        check_reduce_scaled(group, 64, k_sizes, 4096, mode, op, out_dtype=torch.float16,
                            impl="baseline", bias=True)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_reduce_scaled_on_the_ws_producer(monkeypatch, mode, world_size):
    """``SCALED_PRODUCER_CORE = "ws"``: the fp8 WS core pushes each rank's fp32 sums into the
    owners' slots (gemm_rs, gemm_ar two-shot) or every rank's (gemm_ar one-shot), the finish
    kernel sums them in rank order. Against the float64 reference: both tile widths of the
    wave rule (N 1536: 256-wide at 1000 rows; N 640 at 3000 rows: narrow), rank 0's bias,
    uneven and empty shards, twice per plan; N off 16 (1000) runs the portable producer.
    The WS producer must have run wherever it takes the operands."""
    from ditron_ops.gemm import _rs_launch, _ws_scaled
    from ditron_ops.gemm._ws_launch import core_refusal
    if core_refusal(torch.device("cuda")) is not None:
        pytest.skip(core_refusal(torch.device("cuda")))
    monkeypatch.setattr(_rs_launch, "SCALED_PRODUCER_CORE", "ws")
    monkeypatch.setattr(_rs_launch, "SCALED_WS_MIN_K", {1: 0, 2: 0})  # (every K here)
    built = []  # the pushing plans bound (a build that fell back to the portable core: none)
    init = _ws_scaled.WsScaledGemm.__init__

    def counted(self, *args, push=None, **kw):
        init(self, *args, push=push, **kw)
        if push is not None:
            built.append(args[9])
    monkeypatch.setattr(_ws_scaled.WsScaledGemm, "__init__", counted)
    k_sizes = [1024 + 128 * q if q % 3 != 2 else 1000 for q in range(world_size)]
    uneven = [0 if q == 2 else 300 + 97 * q for q in range(world_size)]  # (rank 2: no rows)

    def body(group):
        for _ in range(2):
            check_reduce_scaled(group, 1000, k_sizes, 1536, mode, "gemm_rs_scaled", bias=True)
            check_reduce_scaled(group, 3000, k_sizes, 640, mode, "gemm_rs_scaled", seed=1)
            check_reduce_scaled(group, sum(uneven), k_sizes, 768, mode, "gemm_rs_scaled",
                                seed=2, shard_sizes=uneven, out_dtype=torch.float16)
            check_reduce_scaled(group, 1000, k_sizes, 1000, mode, "gemm_rs_scaled", seed=3)
            for algorithm in ("one_shot", "two_shot"):
                check_reduce_scaled(group, 640, k_sizes, 1024, mode, "gemm_ar_scaled", seed=4,
                                    bias=True, algorithm=algorithm)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size
    # each rank's WS plans: 1000 x 1536, 3000 x 640, the uneven shards, both gemm_ar forms
    assert len(built) >= 5 * world_size, built


@pytest.mark.parametrize("mode", MODES)
def test_reduce_scaled_deterministic_batch_invariant(mode):
    """Rows bitwise equal across M (deterministic mode: fixed K order, rank-ordered fp32 sums)."""
    def body(group):
        parts = reduce_inputs(1000, [1024, 640], 1536, mode, group.device)
        a, sa, b, sb = parts[group.rank]
        full = ditron_ops.gemm_ar_scaled(a, b, sa, sb, group, deterministic=True)
        for m in (1, 3, 17, 64, 255):
            sub_sa = sa if mode == "tensor" else sa[:m].contiguous()
            got = ditron_ops.gemm_ar_scaled(a[:m].contiguous(), b, sub_sa, sb, group,
                                            deterministic=True)
            assert torch.equal(got, full[:m]), f"M={m}"
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("core", ["tl", "ws"])
@pytest.mark.parametrize("op", ["gemm_rs_scaled", "gemm_ar_scaled"])
def test_reduce_scaled_graph_replay_with_bias(monkeypatch, op, core):
    """A captured call (block scales, rank 0's bias) replays over new operands and scales in
    place: the float64 reference of the new values; its producer on either core (``ws``: the
    fp8 WS core's pushing form at any K)."""
    from ditron_ops.gemm import _rs_launch
    from ditron_ops.gemm._ws_launch import core_refusal
    if core == "ws" and core_refusal(torch.device("cuda")) is not None:
        pytest.skip(core_refusal(torch.device("cuda")))
    monkeypatch.setattr(_rs_launch, "SCALED_PRODUCER_CORE", core)
    monkeypatch.setattr(_rs_launch, "SCALED_WS_MIN_K", {1: 0, 2: 0})
    k_sizes, m, n = [1024, 640], 512, 768

    def body(group):
        parts = reduce_inputs(m, k_sizes, n, "block", group.device)
        a, sa, b, sb = (t.clone() for t in parts[group.rank])
        bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        bias = bias.to(group.device)

        g, out = _captured(group, lambda: getattr(ditron_ops, op)(a, b, sa, sb, group, bias=bias,
                                                                  impl="fused"))
        new = reduce_inputs(m, k_sizes, n, "block", group.device, seed=5)
        a.copy_(new[group.rank][0])
        sa.copy_(new[group.rank][1])
        g.replay()
        group.synchronize()
        rows = None
        if op == "gemm_rs_scaled":
            sizes = ditron_ops.split_sizes(m, group.world_size)
            rows = slice(sum(sizes[:group.rank]), sum(sizes[:group.rank + 1]))
        # b and its scales are the same tensors: the reference takes the new A sides only
        ref_parts = [(new[r][0], new[r][1], parts[r][2], parts[r][3]) for r in range(2)]
        a64, b64 = reduce_operands(ref_parts, "block", rows)
        check_close(out, a64, b64, bias)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("op", ["ag_tl", "ag_ws", "rs", "ag_bf16", "rs_bf16"])
def test_scaled_back_to_back(monkeypatch, op, world_size):
    """Fused calls queued back to back with no host synchronization between them (a decode
    loop, a bench's timing) finish within a bound, and each gives the float64 reference:
    tensor scales, the bench's first model shard (753x4096x7168, the copy producer). The queue
    is polled, so a stall fails the test, naming the op, instead of hanging it (the stalled
    work then holds the GPU; benchmarks/NOTES.md, fp8). The bf16 ops on the same path
    (``*_bf16``: relative error against a float64 product) tell whether a stall is the fp8
    ops' own."""
    from ditron_ops.gemm import _ag_launch
    from ditron_ops.gemm._ws_launch import core_refusal
    if op == "ag_ws":
        if core_refusal(torch.device("cuda")) is not None:
            pytest.skip(core_refusal(torch.device("cuda")))
        monkeypatch.setattr(_ag_launch, "SCALED_CONSUMER_CORE", "ws")
    m, n, k = 753, 4096, 7168

    def body(group):
        w, r = group.world_size, group.rank
        if op.endswith("bf16"):
            gen = torch.Generator().manual_seed(3)
            rows = m * w if op == "rs_bf16" else m
            a_all = [torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(group.device)
                     for _ in range(w)]
            b_all = [torch.randn(k, n, generator=gen).div(k ** 0.5).to(torch.bfloat16)
                     .to(group.device) for _ in range(w if op == "rs_bf16" else 1)]
            a, b = a_all[r], b_all[r if op == "rs_bf16" else 0]
            if op == "rs_bf16":  # rows [m r, m (r + 1)) of the sum over ranks
                want = sum(x[m * r:m * (r + 1)].double() @ y.double()
                           for x, y in zip(a_all, b_all))
                call = lambda: ditron_ops.gemm_rs(a, b, group, impl="fused")  # noqa: E731
            else:
                want = torch.cat(a_all).double() @ b_all[0].double()
                call = lambda: ditron_ops.ag_gemm(a, b, group, impl="fused")  # noqa: E731
            check = lambda out: torch.testing.assert_close(  # noqa: E731
                out.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        elif op == "rs":
            parts = reduce_inputs(m * group.world_size, [k] * group.world_size, n, "tensor",
                                  group.device)
            a, sa, b, sb = parts[group.rank]
            rows = slice(m * group.rank, m * (group.rank + 1))
            a64, b64 = reduce_operands(parts, "tensor", rows)
            call = lambda: ditron_ops.gemm_rs_scaled(a, b, sa, sb, group, impl="fused")  # noqa: E731
        else:
            a_list, sa_list, b, sb = scaled_inputs([m] * group.world_size, k, n, "tensor",
                                                   group.device)
            a, sa = a_list[group.rank], sa_list[group.rank]
            a64, b64 = dequantized(a_list, sa_list, b, sb, "tensor")
            call = lambda: ditron_ops.ag_gemm_scaled(a, b, sa, sb, group, impl="fused")  # noqa: E731
        if not op.endswith("bf16"):
            check = lambda out: check_close(out, a64, b64)  # noqa: E731
        call()
        group.synchronize()
        outs = [call() for _ in range(3)]  # (queued: nothing waits for them until here)
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + 60
        while not done.query():
            assert time.monotonic() < deadline, f"{op}: three queued calls stalled (W = " \
                f"{group.world_size}, rank {group.rank})"
            time.sleep(0.01)
        group.synchronize()
        for out in outs:
            check(out)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size
