"""GPU tier (H200): ulysses_attention and all_to_all on a virtual world with the compiled kernels,
against the reference (all-gather of the sequence + SDPA over the whole sequence + slice); the
local attention kernel against SDPA; one NVSHMEM PE (one process per GPU)."""
import importlib.util
import json
import random
import sys
import threading
import time

import pytest
import torch

import ditron_ops
from ditron_ops import reference
from ditron_ops.attention import ulysses as api
from ditron_ops.testing.checks import one_pe_nvshmem
from ditron_ops.testing.ulysses_checks import rank_1_skips_a_call, replicated_dk_reference

pytestmark = pytest.mark.gpu
_CAPTURE_LOCK = threading.Lock()
TOL = 2e-2  # bf16/fp16 output vs the fp32 reference, relative to the largest value


def _full(b, s, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))


def _chunk(x, group):
    s_r = x.shape[1] // group.world_size
    return x[:, group.rank * s_r:(group.rank + 1) * s_r].contiguous().to(group.device)


def _inputs(group, b, s_r, hq, hkv, d, dtype, seed=0):
    full = _full(b, s_r * group.world_size, hq, hkv, d, dtype, seed)
    return tuple(_chunk(x, group) for x in full)


def _check(group, b, s_r, hq, hkv, d, dtype, causal):
    q, k, v = _inputs(group, b, s_r, hq, hkv, d, dtype)
    out = ditron_ops.ulysses_attention(q, k, v, group, causal=causal)
    want = reference.ulysses_attention(q, k, v, group, causal=causal)
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL * max(1.0, want.float().abs().max().item()), err
    return err


CASES = {  # (dtype, D, Hq, Hkv, B, S_r)
    "32/8 bf16 D128": (torch.bfloat16, 128, 32, 8, 1, 1024),   # S_r a multiple of BLOCK_N: runs
    "64/8 fp16 D64 odd": (torch.float16, 64, 64, 8, 2, 333),
    "8/1 bf16 replicated": (torch.bfloat16, 128, 8, 1, 1, 517),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_matches_reference(world_size, case, causal):
    dtype, d, hq, hkv, b, s_r = CASES[case]
    ditron_ops.launch(_check, world_size, args=(b, s_r, hq, hkv, d, dtype, causal))


def _grads(group, s_r, hq, hkv, causal, deterministic):
    w, d = group.world_size, 128
    full = [x.to(group.device).requires_grad_()
            for x in _full(1, s_r * w, hq, hkv, d, torch.bfloat16, seed=3)]
    dout = torch.randn(1, s_r * w, hq, d, generator=torch.Generator().manual_seed(4))
    dout = dout.to(torch.bfloat16).to(group.device)
    (reference.attention(*[x.float() for x in full], causal=causal) * dout.float()).sum().backward()
    mine = [_chunk(x.detach(), group).requires_grad_() for x in full]
    out = ditron_ops.ulysses_attention(*mine, group, causal=causal, deterministic=deterministic)
    out.backward(_chunk(dout, group))
    for name, x, ref in zip("qkv", mine, full):
        want = _chunk(ref.grad, group).float()
        err = (x.grad.float() - want).abs().max().item()
        assert err <= 3e-2 * max(1.0, want.abs().max().item()), (name, err)
    return True


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("world_size,hq,hkv", [(2, 32, 8), (4, 32, 8), (4, 8, 1), (8, 32, 4)])
def test_gradients_match_reference_autograd(world_size, hq, hkv, deterministic):
    assert ditron_ops.launch(_grads, world_size,
                             args=(256, hq, hkv, True, deterministic)) == [True] * world_size


def _delayed(group, runs):
    """``runs`` forwards and deterministic backwards; each rank launches the forward kernel a
    rank-random time after its peers (a host sleep inside the launch gate, while the peers'
    kernels already wait), so chunks arrive in different orders run to run. Everything must
    stay bitwise equal. The replicated KV head's gradient equals the rank-ordered fp32 sum of
    the replicas' partials."""
    w = group.world_size
    full = _full(1, 512 * w, 8, 1, 128, torch.bfloat16, seed=1)
    dout = _chunk(torch.randn(1, 512 * w, 8, 128, generator=torch.Generator().manual_seed(2))
                  .to(torch.bfloat16), group)
    rng = random.Random(group.rank)
    ditron_ops.ulysses_attention(*(_chunk(x, group) for x in full), group, causal=True)
    plan = next(p for p in group.plans._plans.values() if isinstance(p, api._UlyssesPlan))
    launch = plan.kernel.launch

    def delayed_launch(*args):
        time.sleep(rng.uniform(0.0, 0.004))
        launch(*args)
    plan.kernel.launch = delayed_launch
    results = []
    for _ in range(runs):
        q, k, v = (_chunk(x, group).requires_grad_() for x in full)
        out = ditron_ops.ulysses_attention(q, k, v, group, causal=True, deterministic=True)
        out.backward(dout)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    plan.kernel.launch = launch
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    q, k, v = (_chunk(x, group) for x in full)
    assert torch.equal(results[0][2], replicated_dk_reference(group, q, k, v, dout, torch.bfloat16))
    return True


@pytest.mark.parametrize("world_size", [4, 8])
def test_deterministic_bitwise_under_delays(world_size):
    assert ditron_ops.launch(_delayed, world_size, args=(6,)) == [True] * world_size


def _graph(group, causal):
    q, k, v = _inputs(group, 1, 1024, 32, 8, 128, torch.bfloat16, seed=5)
    static = q.clone()
    ditron_ops.ulysses_attention(static, k, v, group, causal=causal)
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK:
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(),
                              capture_error_mode="thread_local"):
            out = ditron_ops.ulysses_attention(static, k, v, group, causal=causal)
    group.barrier()
    for i in range(4):
        static.copy_(_inputs(group, 1, 1024, 32, 8, 128, torch.bfloat16, seed=10 + i)[0])
        graph.replay()
        group.synchronize()
        want = ditron_ops.ulysses_attention(static, k, v, group, causal=causal)
        group.synchronize()
        assert torch.equal(out, want), i
    return True


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_graph_capture_and_replay(world_size, causal):
    assert ditron_ops.launch(_graph, world_size, args=(causal,)) == [True] * world_size


def _back_to_back(group, calls):
    """Calls of changing shapes (both parities of the workspace, several plans): every call is
    bitwise the first call of its shape (the forward is deterministic), every 7th is checked
    against the reference."""
    shapes = [(1, 1024, 32, 8, True), (2, 333, 16, 8, False), (1, 517, 8, 1, True),
              (1, 64, 32, 4, False)]
    inputs = [_inputs(group, b, s_r, hq, hkv, 128, torch.bfloat16, seed=i)
              for i, (b, s_r, hq, hkv, _) in enumerate(shapes)]
    first = {}
    wrong = torch.zeros((), dtype=torch.int64, device=group.device)
    for i in range(calls):
        j = i % len(shapes)
        causal = shapes[j][4]
        out = ditron_ops.ulysses_attention(*inputs[j], group, causal=causal)
        if j not in first:
            first[j] = out
        else:
            wrong += (out != first[j]).any()
        if i % 7 == 0:
            want = reference.ulysses_attention(*inputs[j], group, causal=causal)
            assert (out.float() - want.float()).abs().max().item() < TOL * 6, i
    group.synchronize()
    assert int(wrong) == 0
    return True


def test_back_to_back_changing_shapes():
    assert ditron_ops.launch(_back_to_back, 4, args=(200,)) == [True] * 4


def test_opcheck_and_compile():
    def body(group):
        from ditron_ops.testing.ulysses_checks import check_op_integration

        q, k, v = _inputs(group, 1, 256, 8, 2, 128, torch.bfloat16)
        return check_op_integration(group, q, k, v, 0.088, False)
    assert ditron_ops.launch(body, 1) == [True]


def _a2a(group):
    w = group.world_size
    for shape, sc, ga in [((2, 1000, 8 * w, 128), 2, 1), ((2, 999 * w, 8, 64), 1, 2),
                          ((3 * w, 5, 7), 0, 2), ((4 * w, 4099), 0, 0)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(group.rank))
            x = x.to(dtype=dtype, device=group.device)
            assert torch.equal(ditron_ops.all_to_all(x, sc, ga, group),
                               reference.all_to_all(x, group, sc, ga))
    return True


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_to_all_matches_reference(world_size):
    assert ditron_ops.launch(_a2a, world_size) == [True] * world_size


@pytest.mark.parametrize("config", list(api.GPU_CONFIGS))
@pytest.mark.parametrize("s,hq,hkv,causal", [(4096, 8, 2, False), (1000, 4, 1, True),
                                             (8192, 4, 1, True)])
def test_local_attention_configs_match_sdpa(config, s, hq, hkv, causal):
    q, k, v = (x.transpose(1, 2).contiguous().cuda() for x in _full(1, s, hq, hkv, 128,
                                                                    torch.bfloat16, seed=s))
    got = api.local_attention(q, k, v, causal=causal, config=config)
    want = api.sdpa(q.float(), k.float(), v.float(), causal, 128 ** -0.5)
    assert (got.float() - want).abs().max().item() < TOL


def _rank1_skips(group):
    got = rank_1_skips_a_call(group, torch.ones(1, 256, 8, 128, dtype=torch.bfloat16, device=group.device))
    return got if got == "skipped" else got.op


def test_missing_rank_times_out():
    assert ditron_ops.launch(_rank1_skips, 2, timeout_s=1.0) == ["ulysses_attention", "skipped"]


# -- one NVSHMEM PE: the op on symmetric memory of one process per GPU --------------------------

CHILD_TIMEOUT_S = 600


def _child(tmpdir: str) -> dict:
    res = {}
    with one_pe_nvshmem(tmpdir) as group:
        res["backend"] = group.backend
        q, k, v = (x.to(group.device) for x in _full(1, 1024, 8, 2, 128, torch.bfloat16))
        for causal in (False, True):
            out = ditron_ops.ulysses_attention(q, k, v, group, causal=causal)
            want = reference.attention(q, k, v, causal=causal)
            res[f"err_causal={causal}"] = (out.float() - want.float()).abs().max().item()
        res["a2a_equal"] = torch.equal(ditron_ops.all_to_all(q, 2, 1, group), q)
        from ditron_ops.testing.ulysses_checks import check_ulysses

        res["checks"] = check_ulysses(group, torch.bfloat16)  # asserts inside (+ gradients)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ditron_ops.ulysses_attention(q, k, v, group, causal=True)
        graph.replay()
        torch.cuda.synchronize()
        res["graph_equal"] = torch.equal(captured, ditron_ops.ulysses_attention(q, k, v, group,
                                                                                causal=True))
        group.synchronize()
    return res


@pytest.mark.nvshmem
@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None,
                    reason="needs nvshmem4py (pip install 'ditron_ops[cu13]')")
def test_nvshmem_one_pe(tmp_path):
    from ditron_ops.testing.checks import run_child

    r = run_child(__file__, str(tmp_path), timeout_s=CHILD_TIMEOUT_S)
    print("nvshmem ulysses:", r)
    assert r["backend"] == "nvshmem" and r["a2a_equal"] and r["graph_equal"]
    assert len(r["checks"]) == 4
    assert r["err_causal=False"] < TOL * 4 and r["err_causal=True"] < TOL * 4


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child(sys.argv[1])), flush=True)
