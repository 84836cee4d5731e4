"""GPU tier (H200): MoE dispatch / combine on virtual worlds W in {1, 2, 4, 8} with the compiled
kernels: bitwise vs the all-to-all reference, fp8 bits vs the torch formula (hardware cast),
run-to-run and batch invariance, CUDA graphs replayed 1000x, 10^4 back-to-back calls, errors,
the example layer, and the one-PE nvshmem backend."""
import json
import os
import sys
import threading

import pytest
import torch

import ditron_ops
from ditron_ops.moe import Buffer, MoEOverflowError
from ditron_ops.moe._launch import FP8_VARIANTS
from ditron_ops.testing import moe_checks as mc
from ditron_ops.testing.checks import one_pe_nvshmem

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
_CAPTURE_LOCK = threading.Lock()


def _settle(group):
    group.synchronize()
    group.barrier()


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "staged"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_matches_reference(world_size, in_place):
    """Deterministic dispatch + identity combine vs the reference, bitwise: both layouts,
    random and skewed routing, uneven token counts (one rank sends none), H = 1024, top-8 of
    8 W experts, int32 and int64 ids, alignment 16; combines in place (the virtual world's
    default) and staged (every other backend's path)."""
    def body(group):
        with Buffer(group, num_experts=8 * group.world_size, max_tokens_per_rank=96, hidden=1024, topk=8,
                    dtype=BF16) as buf:
            buf.combine_in_place = in_place
            count = 0 if group.rank == 1 else 96 - 7 * group.rank
            for seed, (kind, layout, align) in enumerate([("random", "expert_padded", 1), ("skewed", "expert_contig", 16),
                                                          ("random", "expert_contig", 1)]):
                idx, w = mc.routing(group, count, buf.num_experts, 8, kind, seed, torch.int32 if seed % 2 else torch.int64)
                x = mc.tokens(group, count, 1024, BF16, seed)
                mc.check_dispatch_combine(group, buf, x, idx, w, layout, align)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


@pytest.mark.parametrize("variant", FP8_VARIANTS)
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_bits_match_torch_formula(round_scale, variant):
    """fp8 dispatch with the hardware e4m3 cast: codes and scales equal torch's
    ``(x / (max(amax, 1e-4) / 448)).to(float8_e4m3fn)`` bit for bit (tiny, normal, large rows),
    in every quantization variant (``Buffer._fp8_variant``)."""
    def body(group):
        with Buffer(group, num_experts=16, max_tokens_per_rank=64, hidden=2048, topk=4, dtype=BF16, fp8=True,
                    round_scale=round_scale) as buf:
            buf._fp8_variant = variant
            idx, w = mc.routing(group, 64, 16, 4, "random", 3)
            scale = torch.logspace(-7, 4, 64, device=group.device)[:, None]
            x = (mc.tokens(group, 64, 2048, torch.float32, 4) * scale).to(BF16)
            for layout in ("expert_padded", "expert_contig"):
                mc.check_dispatch_combine(group, buf, x, idx, w, layout)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_fp8_reciprocal_quotient_is_the_ieee_division():
    """The reciprocal quotient of the fp8 variants (``_kernels._quotient``, hardware FMA), and
    the division one, equal CUDA's IEEE division: fp32 bits from 2^-20 up, e4m3 codes
    everywhere (NaN codes of either sign), on values made hard for it, NaN and groups holding
    +-inf included (``moe_checks.quotient_cases``)."""
    from ditron_ops.moe import _kernels

    for quant in (_kernels.QUANT_DIV, _kernels.QUANT_RCP):
        for seed in range(4):
            assert mc.quotient_mismatches(torch.device("cuda"), quant, rows=8192, seed=seed) == 0, (quant, seed)


def test_run_to_run_and_batch_invariance():
    """20 deterministic runs give the same bits (rows and combine); a token's combined output
    does not change when other ranks send other token subsets."""
    def run(buf, x, idx, w):
        d = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=True)
        scale = (mc.row_experts(buf, d).float() + 1.0)[:, None]
        y = (d.x.float() * scale).to(BF16)
        used = d.handle.src_of_row >= 0
        return d.x[used], buf.combine(y, d.handle), d.handle.src_of_row

    def body(group):
        with Buffer(group, num_experts=64, max_tokens_per_rank=256, hidden=2048, topk=8, dtype=BF16) as buf:
            idx, w = mc.routing(group, 256, 64, 8, "random", 5)
            x = mc.tokens(group, 256, 2048, BF16, 5)
            first = run(buf, x, idx, w)
            for _ in range(20):
                assert all(torch.equal(a, b) for a, b in zip(run(buf, x, idx, w), first))
            for sel in range(3):
                keep = torch.tensor([t for t in range(256) if (t * 7 + group.rank + sel) % 5 != 0], device=group.device)
                part = run(buf, x[keep], idx[keep], w[keep])
                assert torch.equal(part[1], first[1][keep])
            _settle(group)
        return True
    assert ditron_ops.launch(body, 4) == [True] * 4


def _graph(group, layout, in_place):
    """Capture dispatch + experts + combine once, after a per-rank device delay; replay 1000
    times: every replay's output equals the eager one (epochs and staging parity advance on the
    device; ranks arrive at different times)."""
    with Buffer(group, num_experts=8 * group.world_size, max_tokens_per_rank=128, hidden=1024, topk=8,
                dtype=BF16) as buf:
        buf.combine_in_place = in_place
        idx, w = mc.routing(group, 128, buf.num_experts, 8, "random", 9)
        x = mc.tokens(group, 128, 1024, BF16, 9)

        def step():
            d = buf.dispatch(x, idx, w, layout=layout, deterministic=True)
            return buf.combine(d.x * 2, d.handle)

        want = step().clone()
        step()
        _settle(group)
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK:
            with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
                torch.cuda._sleep(20000 * group.rank)  # per-rank device delay before every replay's exchange
                out = step()
        group.barrier()
        wrong = torch.zeros((), dtype=torch.int64, device=group.device)
        for _ in range(1000):
            graph.replay()
            wrong += (out != want).sum()
        _settle(group)
        assert int(wrong) == 0
        assert torch.equal(step(), want)  # eager again after the replays
        _settle(group)
    return True


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "staged"])
@pytest.mark.parametrize("layout", ["expert_padded", "expert_contig"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cuda_graph_replay_1000(world_size, layout, in_place):
    assert ditron_ops.launch(_graph, world_size, args=(layout, in_place)) == [True] * world_size


def test_ten_thousand_back_to_back_calls():
    """10^4 calls (dispatch + combine pairs, cached-handle dispatches, both layouts, both modes,
    token counts 0..T_max, combines in place, staged or each rank its own way) with no
    cleaning between them; every 50th combine checked bitwise."""
    def body(group):
        with Buffer(group, num_experts=32, max_tokens_per_rank=64, hidden=512, topk=4, dtype=BF16) as buf:
            pool = [(mc.routing(group, 64, 32, 4, "random", s), mc.tokens(group, 64, 512, BF16, s)) for s in range(16)]
            pending = torch.zeros((), dtype=torch.int64, device=group.device)
            handle = prev = None
            for i in range(5000):
                buf.combine_in_place = (i + group.rank) % 3 != 0
                count = (i * 13 + group.rank * 5) % 65
                (idx, w), x = pool[i % 16]
                idx, w, x = idx[:count], w[:count], x[:count]
                if i % 7 == 6:
                    d = buf.dispatch(prev[0] * 2, None, prev[1], handle=handle)
                    out = buf.combine(d.x, handle)
                    if i % 50 < 7:
                        pending += (out != mc.identity_combine(prev[0] * 2, handle.dest, prev[1])).sum()
                    continue
                d = buf.dispatch(x, idx, w, layout=("expert_padded", "expert_contig")[i % 2],
                                 expert_alignment=1 + 15 * (i % 4 == 1), deterministic=i % 3 != 0)
                out = buf.combine(d.x, d.handle)
                if i % 50 == 0:
                    pending += (out != mc.identity_combine(x, d.handle.dest, w)).sum()
                handle, prev = d.handle, (x, w)
            _settle(group)
            assert int(pending) == 0
        return True
    assert ditron_ops.launch(body, 4) == [True] * 4


def test_default_mode_and_overflow():
    """Default placement combines to the same bits as deterministic; a small receive capacity
    raises MoEOverflowError on the receiving rank naming expert and counts."""
    def body(group):
        with Buffer(group, num_experts=16, max_tokens_per_rank=128, hidden=1024, topk=4, dtype=BF16) as buf:
            idx, w = mc.routing(group, 128, 16, 4, "skewed", 2)
            x = mc.tokens(group, 128, 1024, BF16, 2)
            a = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=True)
            b = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=False)
            assert torch.equal(a.counts, b.counts) and torch.equal(a.offsets, b.offsets)
            assert torch.equal(buf.combine(a.x, a.handle), buf.combine(b.x, b.handle))
            _settle(group)
        with Buffer(group, num_experts=16, max_tokens_per_rank=128, hidden=1024, topk=4, dtype=BF16,
                    max_recv_tokens=100) as buf:
            idx = torch.zeros(128, 4, dtype=torch.int64, device=group.device)
            idx[:, 1:] = -1
            buf.dispatch(mc.tokens(group, 128, 1024, BF16, 3), idx, layout="expert_contig")
            _settle(group)
            if group.rank == 0:
                with pytest.raises(MoEOverflowError) as err:
                    buf.check()
                assert (err.value.expert, err.value.count, err.value.room) == (0, 128 * group.world_size, 100)
            else:
                buf.check()
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_missing_rank_times_out():
    def body(group):
        buf = Buffer(group, num_experts=8, max_tokens_per_rank=16, hidden=256, topk=2, dtype=BF16)
        return mc.combine_with_rank_1_missing(group, buf, 16, BF16, 1)
    assert ditron_ops.launch(body, 2, timeout_s=2.0) == [("moe_combine", 0, 1), "skipped"]


def test_example_layer_on_gpu():
    """examples/moe_ep_layer.py on 4 virtual ranks: bf16, torch._grouped_mm experts, autograd."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("moe_ep_layer", os.path.join(root, "examples", "moe_ep_layer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(["--world-size", "4"])
    assert losses[-1] < losses[0]


# ---- nvshmem backend, one PE (one process per GPU) --------------------------------------------

def _nvshmem_child(tmpdir: str) -> dict:
    res: dict = {}
    with one_pe_nvshmem(tmpdir) as group:
        for fp8 in (False, True):
            with Buffer(group, num_experts=8, max_tokens_per_rank=64, hidden=1024, topk=4, dtype=BF16, fp8=fp8) as buf:
                idx, w = mc.routing(group, 64, 8, 4, "random", 1)
                x = mc.tokens(group, 64, 1024, BF16, 1)
                for layout in ("expert_padded", "expert_contig"):
                    mc.check_dispatch_combine(group, buf, x, idx, w, layout)
                d = buf.dispatch(x, idx, w, layout="expert_contig")
                graph = torch.cuda.CUDAGraph()
                warm = buf.dispatch(x, None, w, handle=d.handle)  # plans are built before capture
                buf.combine(warm.x if not fp8 else warm.x.to(BF16), d.handle)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    d2 = buf.dispatch(x, None, w, handle=d.handle)
                    out = buf.combine(d2.x if not fp8 else d2.x.to(BF16), d.handle)
                for _ in range(100):
                    graph.replay()
                torch.cuda.synchronize()
                want = buf.combine(d.x if not fp8 else d.x.to(BF16), d.handle)
                res[f"graph_fp8={fp8}"] = bool(torch.equal(out, want))
                res[f"checked_fp8={fp8}"] = True
    return res


@pytest.mark.nvshmem
def test_nvshmem_one_pe():
    """The nvshmem backend at one PE: Buffer in NVSHMEM symmetric memory, reference checks for
    bf16 and fp8, a graph of cached dispatch + combine replayed 100x (fresh process)."""
    from ditron_ops.runtime import nvshmem_backend

    if not nvshmem_backend.nvshmem_available():
        pytest.skip("needs nvshmem4py (pip install 'ditron_ops[cu13]')")
    import tempfile

    from ditron_ops.testing.checks import run_child

    with tempfile.TemporaryDirectory() as tmp:
        res = run_child(__file__, tmp)
    assert res == {"graph_fp8=False": True, "checked_fp8=False": True, "graph_fp8=True": True,
                   "checked_fp8=True": True}, res


if __name__ == "__main__":
    print("RESULT " + json.dumps(_nvshmem_child(sys.argv[1])), flush=True)
