"""MoE dispatch / combine on the CPU virtual world (Triton interpreter) vs the all-to-all reference."""
import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

import ditron_ops
from ditron_ops.moe import Buffer, MoEInputError, MoEOverflowError
from ditron_ops.testing import moe_checks as mc
from ditron_ops.testing.interpreter import programs_as_threads

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
F32, F16 = torch.float32, torch.float16


def _buffer(group, experts_per_rank=3, max_tokens=6, hidden=16, topk=3, dtype=F32, in_place=True, **kw):
    """A Buffer; ``in_place=False``: its combines stage the expert outputs (the path of every
    backend but the virtual world's); ``"mixed"``: odd ranks stage, even ones do not."""
    buf = Buffer(group, num_experts=experts_per_rank * group.world_size, max_tokens_per_rank=max_tokens,
                 hidden=hidden, topk=topk, dtype=dtype, **kw)
    assert buf.combine_in_place  # a virtual world reads expert outputs in place by default
    buf.combine_in_place = group.rank % 2 == 0 if in_place == "mixed" else in_place
    return buf


IN_PLACE = pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "staged"])
WITH_MIXED = pytest.mark.parametrize("in_place", [True, False, "mixed"], ids=["in_place", "staged", "mixed"])


@IN_PLACE
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_reference_both_layouts_and_routings(world_size, in_place):
    """Deterministic dispatch (rows, counts, offsets, dest, sources, weights) and the combine of
    identity experts equal the all-to-all reference bit for bit; uneven token counts per rank
    (rank 2 sends none), fp16 and fp32, int32 and int64 ids, alignment 1 and 4."""
    def body(group):
        with _buffer(group, dtype=F16 if group.world_size % 2 else F32, in_place=in_place) as buf:
            e = buf.num_experts
            count = 0 if group.rank == 2 else 6 - group.rank % 3
            for seed, (kind, layout, align) in enumerate([("random", "expert_padded", 1),
                                                          ("skewed", "expert_contig", 4),
                                                          ("random", "expert_contig", 1)]):
                idx, w = mc.routing(group, count, e, 3, kind, seed, torch.int32 if seed % 2 else torch.int64)
                x = mc.tokens(group, count, 16, buf.dtype, seed)
                mc.check_dispatch_combine(group, buf, x, idx, w if seed != 2 else None, layout, align)
        return True
    assert ditron_ops.launch(body, world_size) == [True] * world_size


def test_fp8_quantization_bitwise():
    """fp8 dispatch: codes and scales equal the torch formula (max(amax, 1e-4) / 448, e4m3 round
    to nearest even), with and without power-of-two scales; amax below 1e-4 and large values."""
    def body(group):
        for round_scale in (False, True):
            with _buffer(group, experts_per_rank=2, hidden=256, topk=2, dtype=F16, fp8=True,
                         round_scale=round_scale) as buf:
                idx, w = mc.routing(group, 5, buf.num_experts, 2, "random", 3)
                x = mc.tokens(group, 5, 256, F32, 4) * torch.tensor([1e-6, 1.0, 30.0, 1e3, 0.1])[:, None]
                mc.check_dispatch_combine(group, buf, x.to(F16), idx, w, "expert_contig")
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_edge_routing_zero_tokens_no_experts_one_expert():
    """T = 0 on a rank, all-(-1) routing, every token to one expert: both layouts, both modes."""
    def body(group):
        with _buffer(group) as buf:
            for kind in ("none", "one_expert"):
                for layout in ("expert_padded", "expert_contig"):
                    count = 0 if group.rank == 0 else 6
                    idx, w = mc.routing(group, count, buf.num_experts, 3, kind, 7)
                    x = mc.tokens(group, count, 16, F32, 7)
                    mc.check_dispatch_combine(group, buf, x, idx, w, layout)
                    d = buf.dispatch(x, idx, w, layout=layout, deterministic=False)
                    assert torch.equal(buf.combine(d.x, d.handle), mc.identity_combine(x, d.handle.dest, w))
                    want = 0 if kind == "none" else (6 * (group.world_size - 1) if group.rank == group.world_size - 1 else 0)
                    assert int(d.counts.sum()) == want and int(d.handle.cstart[-1]) == want
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3


def test_default_mode_same_layout_sizes_same_combine():
    """Default (atomic) placement: counts, offsets and the set of rows per expert equal the
    deterministic dispatch's; the combine is bitwise the same; ``ditron_ops.deterministic()``
    selects the deterministic placement."""
    def body(group):
        with _buffer(group) as buf:
            idx, w = mc.routing(group, 6, buf.num_experts, 3, "skewed", 11)
            x = mc.tokens(group, 6, 16, F32, 11)
            det = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=True)
            fast = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=False)
            assert torch.equal(det.counts, fast.counts) and torch.equal(det.offsets, fast.offsets)
            used = det.handle.src_of_row >= 0
            assert torch.equal(used, fast.handle.src_of_row >= 0)
            for e in range(buf.experts_local):
                lo, hi = int(det.offsets[e]), int(det.offsets[e + 1])
                a = det.handle.src_of_row[lo:hi].sort().values
                assert torch.equal(a, fast.handle.src_of_row[lo:hi].sort().values)
            assert torch.equal(buf.combine(det.x * 3, det.handle), buf.combine(fast.x * 3, fast.handle))
        with _buffer(group) as buf:
            modes = lambda: sorted({key[5] for key in buf.plans._plans})  # noqa: E731  (key[5]: det)
            buf.dispatch(x, idx, w)
            assert modes() == [False]
            with ditron_ops.deterministic():
                ctx = buf.dispatch(x, idx, w, layout="expert_contig")
            assert modes() == [False, True] and torch.equal(ctx.handle.src_of_row, det.handle.src_of_row)
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3


def test_layout_chunk_pass_counts_like_torch():
    """Deterministic layout, pass 1 (entries compared with their chunk ``JB`` at a time, the
    histogram from each expert's last entry): every entry's rank among its chunk's earlier
    entries of its id and every chunk's histogram equal a plain count; ids outside [-1, E)
    count as -1 and the first one is reported; an expert filling a whole chunk, experts absent
    from a chunk (their stale words zeroed), a partial last chunk, E not a multiple of the
    zero-fill step."""
    from ditron_ops.moe import _kernels as K, _launch as L

    ch, experts = L.CPU_CHUNK, 21
    assert ch % L.CPU_CHUNK_J == 0 and ch // L.CPU_CHUNK_J > 1 and experts % L.CPU_HIST_E
    gen = torch.Generator().manual_seed(0)
    n = 3 * ch + 5
    idx = torch.randint(-1, 4, (n,), generator=gen)
    idx = torch.where(idx < 0, -1, idx * 5)  # few experts: many entries of each
    idx[:ch] = 4
    idx[ch + 3], idx[ch + 7], idx[2 * ch + 1] = experts + 2, -5, experts
    chunks = -(-n // ch)
    idx32 = torch.zeros(n, dtype=torch.int32)
    pos = torch.full((n,), -7, dtype=torch.int32)
    hist = torch.full((chunks * experts,), 99, dtype=torch.int32)
    bad = torch.full((1,), 2**63 - 1, dtype=torch.int64)
    K.layout_chunk_kernel[(chunks,)](idx, idx32, pos, hist, bad, n, experts, CH=ch, JB=L.CPU_CHUNK_J,
                                     EB=L.CPU_HIST_E)
    e = torch.where((idx >= 0) & (idx < experts), idx, -1)
    want_pos = torch.tensor([int((e[i - i % ch:i] == e[i]).sum()) for i in range(n)], dtype=torch.int32)
    want_hist = torch.stack([torch.bincount(e[c * ch:(c + 1) * ch][e[c * ch:(c + 1) * ch] >= 0],
                                            minlength=experts) for c in range(chunks)]).int().flatten()
    assert torch.equal(idx32, e.int()) and torch.equal(pos, want_pos) and torch.equal(hist, want_hist)
    assert int(want_pos[ch - 1]) == ch - 1 and int(bad) == ((ch + 3) << 32) | (experts + 2)


def test_run_to_run_delays_and_batch_invariance():
    """Deterministic mode under injected per-rank delays: the same bits every run; a token's
    combined output (per-expert scaling experts) does not depend on which other tokens any rank
    sent."""
    def run(group, buf, x, idx, w, delay):
        time.sleep(delay)
        d = buf.dispatch(x, idx, w, layout="expert_padded", deterministic=True)
        scale = (mc.row_experts(buf, d).float() + 1.0)[:, None]
        y = (d.x.reshape(-1, 16) * scale).reshape(d.x.shape)
        used = d.handle.src_of_row >= 0  # other rows are unspecified
        return d.x.reshape(-1, 16)[used], buf.combine(y, d.handle), d.handle.src_of_row

    def body(group):
        with _buffer(group) as buf:
            idx, w = mc.routing(group, 6, buf.num_experts, 3, "random", 5)
            x = mc.tokens(group, 6, 16, F32, 5)
            first = run(group, buf, x, idx, w, 0.0)
            for i in range(3):
                again = run(group, buf, x, idx, w, 0.02 * ((group.rank + i) % group.world_size))
                assert all(torch.equal(a, b) for a, b in zip(again, first))
            keep = [t for t in range(6) if (t + group.rank) % 3 != 1]
            part = run(group, buf, x[keep], idx[keep], w[keep], 0.0)
            assert torch.equal(part[1], first[1][keep])
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3


@WITH_MIXED
def test_cached_handle_and_back_to_back_calls(in_place):
    """30 calls on one Buffer: layouts, token counts, modes and cached-handle dispatches
    interleaved (epochs and staging parity never cleaned); every combine equals the local
    expectation bit for bit, a cached dispatch equals a fresh one; combines in place, staged,
    or each rank its own way (every rank tells its peers where its rows are)."""
    def body(group):
        with _buffer(group, max_tokens=7, in_place=in_place) as buf:
            prev = None  # (handle, x, idx, w, deterministic) of the last fresh dispatch
            for i in range(30):
                if i % 5 == 4:
                    handle, x, idx, w, det = prev
                    d = buf.dispatch(x * 2, handle=handle)
                    fresh = buf.dispatch(x * 2, idx, layout=handle.layout, expert_alignment=handle.expert_alignment,
                                         deterministic=det)
                    used = handle.src_of_row >= 0
                    assert torch.equal(d.x.reshape(-1, 16)[used], fresh.x.reshape(-1, 16)[used])
                    assert torch.equal(buf.combine(d.x, handle, w), mc.identity_combine(x * 2, handle.dest, w)), i
                    continue
                count = (i * 5 + group.rank) % 8
                idx, w = mc.routing(group, count, buf.num_experts, 3, "random", 100 + i)
                x = mc.tokens(group, count, 16, F32, 100 + i)
                det = i % 3 != 0
                d = buf.dispatch(x, idx, w, layout=("expert_padded", "expert_contig")[i % 2],
                                 expert_alignment=1 + (i % 3) * (i % 2), deterministic=det)
                assert torch.equal(buf.combine(d.x, d.handle), mc.identity_combine(x, d.handle.dest, w)), i
                prev = (d.handle, x, idx, w, det)
            group.synchronize()
            buf.check()
        return True
    assert ditron_ops.launch(body, 3) == [True] * 3


@IN_PLACE
def test_combine_out_and_zero_copy_input(in_place):
    """``out=`` writes in place; expert outputs written into ``combine_input()`` (contiguous
    layout, alignment 1) are combined without a staging copy and give the same bits."""
    def body(group):
        with _buffer(group, in_place=in_place) as buf:
            idx, w = mc.routing(group, 5, buf.num_experts, 3, "random", 9)
            x = mc.tokens(group, 5, 16, F32, 9)
            d = buf.dispatch(x, idx, w, layout="expert_contig")
            y = d.x * 2 - 1
            want = buf.combine(y, d.handle)
            out = torch.full((5, 16), float("nan"))
            assert buf.combine(y, d.handle, out=out) is out and torch.equal(out, want)
            stage = buf.combine_input()
            stage.copy_(y)
            assert torch.equal(buf.combine(stage, d.handle), want)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@IN_PLACE
def test_autograd_matches_formulas(in_place):
    """Gradients through dispatch (tokens and received weights) and a weighted combine, for
    both layouts and a cached-handle dispatch, against the closed forms (experts scale their
    rows by e + 1)."""
    def body(group):
        e_total, k = 3 * group.world_size, 3
        with _buffer(group, in_place=in_place) as buf:
            for layout in ("expert_padded", "expert_contig"):
                idx, w0 = mc.routing(group, 5, e_total, k, "random", 21)
                x = mc.tokens(group, 5, 16, F32, 21).requires_grad_()
                w = w0.clone().requires_grad_()
                g = mc.tokens(group, 5, 16, F32, 22)
                d = buf.dispatch(x, idx, w, layout=layout, deterministic=True)
                scale = (mc.row_experts(buf, d).float() + 1.0)[:, None]
                y = (d.x.reshape(-1, 16) * scale).reshape(d.x.shape)
                again = buf.dispatch(x * 2, handle=d.handle)  # cached: gradient 2 * sum_j 1
                loss = (buf.combine(y, d.handle) * g).sum() + 0.5 * d.weights.sum() + again.x.sum()
                loss.backward()
                valid = idx >= 0
                sc = torch.where(valid, idx.clamp(min=0).float() + 1, 0.0)
                want_x = (w0 * sc).sum(1, keepdim=True) * g + 2.0 * valid.sum(1, keepdim=True)
                want_w = torch.where(valid, sc * (x.detach() * g).sum(1, keepdim=True) + 0.5, 0.0)
                assert torch.allclose(x.grad, want_x, atol=1e-4), (x.grad - want_x).abs().max()
                assert torch.allclose(w.grad, want_w, atol=1e-4), (w.grad - want_w).abs().max()
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_opcheck_and_compile():
    """Every op passes opcheck (schema, autograd registration, fake, AOT dispatch); a dispatch +
    combine step compiles with fullgraph=True and gives the eager bits."""
    def body(group):
        with _buffer(group, experts_per_rank=4, max_tokens=5, topk=2) as buf:
            idx, w = mc.routing(group, 4, 4, 2, "random", 1)
            x = mc.tokens(group, 4, 16, F32, 1)
            utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
            for layout, align in (("expert_padded", 1), ("expert_contig", 4)):
                torch.library.opcheck(torch.ops.ditron.moe_dispatch.default,
                                      (x, idx, w, buf.name, layout, align, True, False, False, True), test_utils=utils)
                d = buf.dispatch(x, idx, w, layout=layout, expert_alignment=align)
                h = d.handle.tensors()
                rows = d.x.reshape(-1, 16)
                torch.library.opcheck(torch.ops.ditron.moe_dispatch_cached.default,
                                      (x * 2, w, *h, buf.name, False, False, True), test_utils=utils)
                for weights in (w, None):
                    torch.library.opcheck(torch.ops.ditron.moe_combine.default, (rows, weights, *h, buf.name),
                                          test_utils=utils)
                torch.library.opcheck(torch.ops.ditron.moe_combine_out.default,
                                      (rows, w, *h, buf.name, torch.empty(4, 16)),
                                      test_utils=("test_schema", "test_faketensor"))

            def step(x, idx, w):
                d = buf.dispatch(x * 1.0, idx, w, layout="expert_contig", expert_alignment=2, deterministic=True)
                return buf.combine(d.x * 2, d.handle)

            torch._dynamo.reset()
            return torch.equal(torch.compile(step, fullgraph=True)(x, idx, w), step(x, idx, w))
    assert ditron_ops.launch(body, 1) == [True]


def test_bad_input_typed_errors():
    """Wrong dtypes / shapes / arguments raise before any launch; a rank with too many tokens
    raises ValueError and its peers MoEInputError at their next check; an expert id out of range
    is reported on every rank; bad Buffer arguments are refused."""
    def body(group):
        r, world = group.rank, group.world_size
        with _buffer(group) as buf:
            idx, w = mc.routing(group, 4, buf.num_experts, 3, "random", 2)
            x = mc.tokens(group, 4, 16, F32, 2)
            for args, kw, exc, match in [
                    ((x.half(), idx), {}, TypeError, "dtype"), ((x[:, :8], idx), {}, ValueError, r"\[T, 16\]"),
                    ((x, idx.float()), {}, TypeError, "dtype"), ((x, idx[:, :2]), {}, ValueError, "topk_idx"),
                    ((x, idx, w[:, :2]), {}, ValueError, "topk_weights"), ((x, idx), {"layout": "rows"}, ValueError, "layout"),
                    ((x, idx), {"expert_alignment": 4}, ValueError, "alignment"),
                    ((x, idx), {"expert_alignment": 0}, ValueError, "positive"),
                    ((x, idx), {"deterministic": 1}, TypeError, "deterministic")]:
                with pytest.raises(exc, match=match):
                    buf.dispatch(*args, **kw)
            assert buf.dispatch_calls == 0
            d = buf.dispatch(x, idx, w)
            with pytest.raises(ValueError, match="shape"):
                buf.combine(d.x[:1], d.handle)
            with pytest.raises(TypeError, match="dtype"):
                buf.combine(d.x.half(), d.handle)
            buf.combine(d.x, d.handle)
        with _buffer(group) as buf:  # too many tokens on rank 0
            count = 7 if r == 0 else 3
            idx, w = mc.routing(group, count, buf.num_experts, 3, "random", 3)
            x = mc.tokens(group, count, 16, F32, 3)
            if r == 0:
                with pytest.raises(ValueError, match="more than max_tokens_per_rank"):
                    buf.dispatch(x, idx, w)
            else:
                buf.dispatch(x, idx, w)
            group.synchronize()
            with pytest.raises(MoEInputError, match="rank 0 passed 7 tokens") as err:
                buf.check()
            assert err.value.rank == 0 and err.value.kind == "tokens"
        with _buffer(group) as buf:  # an id out of range on the last rank
            idx, w = mc.routing(group, 4, buf.num_experts, 3, "random", 4)
            if r == world - 1:
                idx[2, 1] = buf.num_experts + 5
            d = buf.dispatch(mc.tokens(group, 4, 16, F32, 4), idx, w)
            group.synchronize()
            with pytest.raises(MoEInputError, match=rf"rank {world - 1} passed topk_idx\[2, 1\] = {buf.num_experts + 5}"):
                buf.check()
            with pytest.raises(MoEInputError):  # a failed Buffer stays failed, before any launch
                buf.combine(d.x, d.handle)
        for kw, exc in [(dict(num_experts=3 * world + 1), ValueError), (dict(hidden=12), ValueError),
                        (dict(dtype=torch.bfloat16), TypeError), (dict(topk=0), ValueError),
                        (dict(fp8=True), ValueError), (dict(dtype=torch.int32), TypeError)]:
            args = dict(num_experts=3 * world, max_tokens_per_rank=4, hidden=16, topk=2, dtype=F32)
            args.update(kw)
            with pytest.raises(exc):
                Buffer(group, **args)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_receive_overflow_reports_expert_and_counts():
    """A receive capacity too small (``max_recv_tokens``) and a token naming an expert twice in
    the padded layout: the receiving rank raises MoEOverflowError naming the expert and counts;
    the kept rows are intact and nothing is written past them."""
    def body(group):
        r, world = group.rank, group.world_size
        with _buffer(group, max_recv_tokens=5) as buf:
            idx = torch.tensor([[0, -1, -1]] * 4)  # 4 W entries for expert 0 on rank 0, room for 5
            x = mc.tokens(group, 4, 16, F32, 8)
            d = buf.dispatch(x, idx, layout="expert_contig", deterministic=True)
            group.synchronize()
            if r == 0:
                with pytest.raises(MoEOverflowError, match="received 8 entries for expert 0 but had room for 5") as err:
                    buf.check()
                assert (err.value.expert, err.value.count, err.value.room) == (0, 8, 5)
                assert d.counts.tolist() == [5, 0, 0] and d.offsets.tolist() == [0, 5, 5, 5]
                assert d.x.shape == (5, 16) and torch.equal(d.x[:4], x)
                assert torch.equal(d.x[4], mc.tokens(group, 4, 16, F32, 8, rank=1)[0])
                assert d.handle.src_of_row.tolist() == [0, 3, 6, 9, 6 * 3]
            else:
                buf.check()
                assert (d.handle.dest[:, 0] == -1).tolist() == [False, True, True, True]
        with _buffer(group) as buf:
            idx = torch.tensor([[1, 1, 1]] * 6)  # 18 entries per rank for expert 1: W x 6 rows fit
            d = buf.dispatch(mc.tokens(group, 6, 16, F32, 9), idx, layout="expert_padded")
            group.synchronize()
            if r == 0:
                with pytest.raises(MoEOverflowError, match=f"received {18 * world} entries for expert 1 but had room for {6 * world}"):
                    buf.check()
                assert d.counts.tolist() == [0, 6 * world, 0]
            else:
                buf.check()
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_missing_rank_times_out():
    """A rank that skips a combine: its peer raises DitronTimeoutError naming the op and peer."""
    def body(group):
        return mc.combine_with_rank_1_missing(group, _buffer(group), 3, F32, 6)
    assert ditron_ops.launch(body, 2, timeout_s=1.0) == [("moe_combine", 0, 1), "skipped"]


def test_registry_size_hint_and_groups_without_symmetric_memory():
    from ditron_ops.errors import DitronError
    from ditron_ops.moe.buffer import resolve_buffer

    with pytest.raises(DitronError, match="no symmetric memory"):
        Buffer(ditron_ops.Group(0, 1, "cpu", "plain"), num_experts=2, max_tokens_per_rank=2, hidden=8, topk=1,
               dtype=F32)

    def body(group):
        buf = _buffer(group)
        name = buf.name
        assert resolve_buffer(name) is buf and Buffer.size_hint(group.world_size, num_experts=buf.num_experts,
                                                                max_tokens_per_rank=6, hidden=16, topk=3,
                                                                dtype=F32) == buf.regions.nbytes
        buf.close()
        buf.close()  # idempotent
        with pytest.raises(ValueError, match="no open Buffer"):
            resolve_buffer(name)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


_COMPILE = r"""
import torch
torch.cuda.is_available = lambda: True   # ditron then builds triton.jit kernels; nothing runs
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ditron_ops.moe import _combine_kernels as C, _kernels as K, _launch as L
T = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}
def build(fn, ptrs, constexprs, **opts):
    warps = constexprs.pop("num_warps", 4)
    sig = {n: "constexpr" if n in constexprs else T[ptrs[n]] if n in ptrs else "i32" for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, **opts))
i32, i64, f32, u8, bf16 = torch.int32, torch.int64, torch.float32, torch.uint8, torch.bfloat16
lay = dict(idx_ptr=i64, idx32_ptr=i32, pos_ptr=i32, hist_ptr=i32, bad_ptr=i64, count_ptr=i32)
build(K.layout_chunk_kernel, lay, dict(CH=L.GPU_CHUNK, JB=L.GPU_CHUNK_J, EB=L.GPU_HIST_E))
build(K.layout_atomic_kernel, lay, dict(CH=L.GPU_CHUNK))
build(K.layout_scan_kernel, lay, dict(CH=L.GPU_CHUNK, CB=L.GPU_SCAN[0], EB=L.GPU_SCAN[1]))
for fp8 in (False, True):
    st = u8 if fp8 else bf16
    ptrs = dict(x_ptr=bf16, w_ptr=f32, src_ptr=i32, dest_ptr=i32, out_x=st, out_s=f32, out_w=f32, counts_ptr=i32,
                offsets_ptr=i32, cstart_ptr=i32, idx32_ptr=i32, pos_ptr=i32, prefix_ptr=i32, count_ptr=i32,
                bad_ptr=i64, scratch_ptr=i32, sig_ptr=i64, table_ptr=i64, cnt_sym=i32, sorted_sym=i32,
                wst_sym=f32, xst_sym=st, sst_sym=f32, err_claim=i64, err_record=i64, moe_claim=i64, moe_record=i64)
    tiles = dict(L.GPU_DISPATCH, **L.dispatch_tiles(7168, 2, fp8, True))
    for quant, stage in ((K.QUANT_DIV, True), (K.QUANT_RCP, True), (K.QUANT_RCP, False)) if fp8 else ((0, True),):
        k = build(K.dispatch_kernel, ptrs, dict(tiles, FP8=fp8, VEC=L.vec(bf16, fp8), CH=L.GPU_CHUNK,
                                                QUANT=quant, STAGE=stage))
        assert "div.full" not in k.asm["ptx"] and "div.approx" not in k.asm["ptx"], "fp8 scales need IEEE divisions"
k = build(K.quantize_kernel, dict(x_ptr=bf16, sig_ptr=i64, xst_sym=u8, sst_sym=f32),
          dict(QUANT=K.QUANT_RCP, VEC=16, BLOCK_R=4, BLOCK_H=1024, num_warps=L.GPU_QUANT_WARPS))
assert "div.full" not in k.asm["ptx"] and "div.approx" not in k.asm["ptx"], "fp8 scales need IEEE divisions"
assert "fma.rn.f32" in k.asm["ptx"], "the reciprocal quotient's corrections are fused"
ptrs = dict(y_ptr=bf16, w_ptr=f32, dest_ptr=i32, out_ptr=bf16, counts_ptr=i32, offsets_ptr=i32, cstart_ptr=i32,
            route_ptr=i64, sig_ptr=i64, table_ptr=i64, yst_sym=bf16, rowmap_sym=i32, err_claim=i64, err_record=i64)
for in_place in (True, False):
    k = build(C.combine_kernel, ptrs, dict(L.combine_tiles(7168, 2, 8, 4096, True), IN_PLACE=in_place, VEC=8),
              enable_fp_fusion=False)
    assert "fma" not in k.asm["ptx"], "the combine must not fuse products into sums"
    assert "ld.global.cg.v4" in k.asm["ptx"], "the combine's row loads must be 16 bytes wide"
print("COMPILED")
"""


def test_gpu_kernels_compile_for_sm90():
    """The GPU code path (hardware fp8 cast, inline-PTX signals, loop-carried types the
    interpreter does not check) compiles for sm_90 in a fresh process, every fp8 quantization
    variant too; the combine has no FMA and the fp8 quantization only IEEE divisions (torch's
    bits)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr[-4000:]


def _load_example():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("moe_ep_layer", os.path.join(root, "examples", "moe_ep_layer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_ep_layer_trains_like_the_single_process_layer():
    """examples/moe_ep_layer.py: router -> dispatch -> grouped GEMMs -> combine, 4 SGD steps with
    autograd on 2 ranks; loss and first-step gradients match the one-process layer (it asserts)."""
    losses = _load_example().main(["--world-size", "2"])
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_example_check_can_fail(monkeypatch):
    """The example's comparison catches a wrong combine (weights ignored)."""
    example = _load_example()
    real = Buffer.combine
    monkeypatch.setattr(Buffer, "combine", lambda self, y, handle, topk_weights=None, out=None: real(
        self, y, handle, torch.ones_like(handle.topk_weights)))
    with pytest.raises(AssertionError):
        example.main(["--world-size", "1"])


def test_bench_quick_writes_rows(tmp_path):
    """``python -m ditron_ops.bench moe --quick`` on CPU: every impl row with its bytes, GB/s,
    copy-bandwidth and traffic fractions, programs, the deterministic cost, and exact identity
    combines (in place and staged); ``--only combine`` times the combines alone."""
    import csv

    from ditron_ops.bench.__main__ import main

    assert main(["moe", "--quick", "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "moe-fp32-cpu-quick.csv")))
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("T=4 padded fp32", i) for i in ("dispatch det", "dispatch default", "dispatch cached", "combine",
                                         "combine staged")] + [
        ("T=8 contig fp8", i) for i in ("dispatch det", "dispatch default", "dispatch cached",
                                        "dispatch default div", "dispatch cached div", "dispatch default split",
                                        "dispatch cached split", "combine", "combine staged", "combine zero-copy")]
    for r in rows:
        assert r["world_size"] == "2" and float(r["time_us"]) > 0 and float(r["baseline_us"]) > 0
        assert int(r["nbytes"]) > 0 and float(r["GB_s"]) >= 0 and float(r["copy_GB_s"]) > 0
        assert float(r["traffic_frac"]) >= float(r["frac_copy"]) / 2
        assert r["programs"] == "1" and r["sms"] == "2"
        assert float(r["max_err"]) == 0.0 if "fp32" in r["case"] else float(r["max_err"]) < 0.5
    assert all(float(r["det_cost"]) > 0 for r in rows if r["impl"] == "dispatch default")
    assert [r["same_bits"] for r in rows if r["impl"].endswith(("div", "split"))] == ["1"] * 4
    assert [r["variant"] for r in rows if r["case"].endswith("fp8") and r["impl"].startswith("dispatch")
            and not r["same_bits"]] == ["rcp"] * 3  # the rule's, at this token bound
    assert main(["moe", "--quick", "--dtype", "fp32", "--only", "combine", "--out", str(tmp_path / "only")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "only" / "moe-fp32-cpu-quick.csv")))
    assert [(r["case"], r["impl"]) for r in rows] == [("T=4 padded fp32", "combine"), ("T=4 padded fp32", "combine staged")]
    with pytest.raises(ValueError, match="--only takes"):
        main(["moe", "--quick", "--dtype", "fp32", "--only", "combin", "--out", str(tmp_path / "bad")])
    for only in ("tokens", "tokens,combine", "tokens,padded"):  # GPU-only cases; fp8 dispatch only
        with pytest.raises(ValueError, match="tokens"):
            main(["moe", "--quick", "--dtype", "fp32", "--only", only, "--out", str(tmp_path / "bad")])


def test_precompile_builds_every_combine_variant(monkeypatch):
    """``precompile``'s moe family makes the combine plan of every dtype (its own width and
    fp32's, in place and staged), fp16 / fp32 here (the interpreter's bf16 math is wrong)."""
    from ditron_ops.moe import _launch

    launched = []
    real = _launch.CombinePlan.__init__
    monkeypatch.setattr(_launch.CombinePlan, "__init__", lambda self, *a, **kw: launched.append(kw) or real(self, *a, **kw))
    _launch._precompile(torch.device("cpu"), (F16, F32))
    assert [(kw["dtype"], kw["hidden"], kw["in_place"]) for kw in launched] == [
        (dtype, width, in_place) for own in (F16, F32) for dtype, width in ((own, 128), (F32, 8))
        for in_place in (True, False)]


THREADED_TIMEOUT_S = 120.0
"""Wait bound of worlds whose programs run as threads: a program waits for its sibling programs,
which share the GIL with every spinning thread of both ranks; on a loaded 2-core CI machine a
sibling's pre-barrier work took over the default 10 s once (a spurious moe_combine timeout)."""


@IN_PLACE
def test_several_programs_per_rank(monkeypatch, in_place):
    """Three concurrent programs per rank (the GPU's persistent grids): the work split, each
    program's table scratch, the done counters and the epoch publication give the reference's
    bits for both layouts, the default mode and a cached-handle dispatch."""
    from ditron_ops.moe import buffer

    monkeypatch.setattr(buffer, "programs_per_rank", lambda group: 3)

    def body(group):
        with _buffer(group, max_tokens=40, in_place=in_place) as buf:
            assert buf.programs == 3
            for seed, (kind, layout, align) in enumerate([("random", "expert_padded", 1), ("skewed", "expert_contig", 4)]):
                count = 40 - 9 * group.rank
                idx, w = mc.routing(group, count, buf.num_experts, 3, kind, seed)
                x = mc.tokens(group, count, 16, F32, seed)
                mc.check_dispatch_combine(group, buf, x, idx, w, layout, align)
                d = buf.dispatch(x, idx, w, layout=layout, expert_alignment=align, deterministic=False)
                assert torch.equal(buf.combine(d.x, d.handle), mc.identity_combine(x, d.handle.dest, w))
                c = buf.dispatch(x * 2, None, w, handle=d.handle)
                assert torch.equal(buf.combine(c.x, d.handle), mc.identity_combine(x * 2, d.handle.dest, w))
        return True
    with programs_as_threads():
        assert ditron_ops.launch(body, 2, timeout_s=THREADED_TIMEOUT_S) == [True, True]


def test_tile_rules():
    """Tile sizes are a rule over the shapes: the widest power-of-two column block that pads a
    row by at most 1/8 (hidden 7168: 1024, not 2048 with a half-empty last step), about the
    same bytes per dispatch step for bf16 and fp8 rows, at least 8 row loads in flight per
    combine thread, and no tile past the token bound."""
    from ditron_ops.moe._launch import combine_tiles, dispatch_tiles, hidden_block

    assert [hidden_block(h, 2, 4096) for h in (7168, 4096, 5120, 2880, 136, 8)] == [1024, 2048, 1024, 1024, 16, 8]
    assert hidden_block(7168, 1, 4096, floor=128) == 1024 and hidden_block(384, 1, 4096, floor=128) == 128
    for h in (8, 24, 136, 2880, 4096, 5120, 7168, 7680):
        bh = hidden_block(h, 2, 4096)
        assert bh & (bh - 1) == 0 and 8 <= bh <= 2048 and (bh == 8 or (-(-h // bh) * bh - h) * 8 <= h), h
    bf16, fp8 = dispatch_tiles(7168, 2, False, True), dispatch_tiles(7168, 2, True, True)
    assert bf16["BLOCK_R"] * bf16["BLOCK_H"] * 2 == fp8["BLOCK_R"] * fp8["BLOCK_H"] == 32768
    assert fp8["BLOCK_H"] % 128 == 0 and fp8["BLOCK_SH"] % 128 == 0 and fp8["BLOCK_SR"] * fp8["BLOCK_SH"] == 8192
    t = combine_tiles(7168, 2, 8, 4096, True)
    assert (t["BLOCK_T"], t["BLOCK_H"], t["KC"], t["num_warps"]) == (4, 1024, 8, 16)
    assert t["BLOCK_T"] * t["BLOCK_H"] == 16 * 32 * 8  # one 16-byte load per thread per slot
    t2 = combine_tiles(7168, 2, 2, 4096, True)  # k = 2: four loads per slot, still 8 in flight
    assert t2["BLOCK_T"] * t2["BLOCK_H"] == 4 * 16 * 32 * 8 and t2["KC"] == 2
    assert combine_tiles(64, 4, 8, 3, True)["BLOCK_T"] == 4 and combine_tiles(7168, 2, 20, 64, True)["KC"] == 8


def _forced(rule, **over):
    """A tile rule whose result is overridden (CPU tests of tilings the rules would not pick)."""
    return lambda *a, **kw: {**rule(*a, **kw), **over}


@WITH_MIXED
@pytest.mark.parametrize("tiles", ["tails", "segments"])
def test_combine_and_dispatch_tilings(monkeypatch, in_place, tiles):
    """Tilings with partial steps: hidden not a multiple of the column blocks (combine sum,
    staging copy, dispatch receive and fp8 quantization), token counts not multiples of the
    token block, hidden split into segments (few tokens, many programs: three programs per
    rank), one unit per routing step; ranks with T = 0, all -1 routing; fp8 quantization tiles
    dealt to three programs: every combine and dispatch equals the reference bit for bit."""
    from ditron_ops.moe import _launch, buffer

    if tiles == "tails":
        monkeypatch.setattr(_launch, "combine_tiles", _forced(
            _launch.combine_tiles, BLOCK_T=4, BLOCK_H=16, UNITS=1, BLOCK_C=16, BLOCK_R=2, BLOCK_F=4,
            BLOCK_S=2))
        rule = _launch.dispatch_tiles  # fp8: whole 128-channel groups, 384 = 256 + a half step
        monkeypatch.setattr(_launch, "dispatch_tiles", lambda hidden, x_elem, fp8, gpu: dict(
            rule(hidden, x_elem, fp8, gpu), BLOCK_R=2, BLOCK_SR=2,
            **(dict(BLOCK_H=256, BLOCK_SH=256) if fp8 else dict(BLOCK_H=16, BLOCK_SH=16))))
    else:
        monkeypatch.setattr(_launch, "combine_tiles", _forced(
            _launch.combine_tiles, BLOCK_T=2, BLOCK_H=8, UNITS=2, SPREAD=64))
        rule = _launch.dispatch_tiles  # fp8: 2-row quantization tiles, 3 x 3 for 5 tokens: shares of 3
        monkeypatch.setattr(_launch, "dispatch_tiles", lambda hidden, x_elem, fp8, gpu: dict(
            rule(hidden, x_elem, fp8, gpu), **(dict(BLOCK_SR=2) if fp8 else {})))
        monkeypatch.setattr(buffer, "programs_per_rank", lambda group: 3)

    def body(group):
        with _buffer(group, max_tokens=7, hidden=40, in_place=in_place) as buf:
            for seed, (kind, layout, align) in enumerate([("random", "expert_padded", 1), ("skewed", "expert_contig", 4),
                                                          ("none", "expert_contig", 1), ("random", "expert_contig", 1)]):
                count = (7, 5, 0)[(group.rank + seed) % 3]
                idx, w = mc.routing(group, count, buf.num_experts, 3, kind, 40 + seed)
                x = mc.tokens(group, count, 40, F32, 40 + seed)
                mc.check_dispatch_combine(group, buf, x, idx, w if seed != 3 else None, layout, align)
                d = buf.dispatch(x, idx, w, layout=layout, expert_alignment=align, deterministic=False)
                y = (d.x * 3 - 1).reshape(-1, 40)
                got = buf.combine(y.reshape(d.x.shape), d.handle)
                used = d.handle.src_of_row >= 0
                assert torch.equal(got, mc.identity_combine(x * 3 - 1, d.handle.dest, w)) or not used.any()
                if layout == "expert_contig" and align == 1:  # zero copy: the same bits
                    buf.combine_input()[:y.shape[0]].copy_(y)
                    assert torch.equal(buf.combine(buf.combine_input()[:y.shape[0]], d.handle), got)
        # fp8 receive / quantization: tails, and (segments: three programs) tiles dealt to programs
        with _buffer(group, experts_per_rank=2, max_tokens=5, hidden=384, topk=2, dtype=F16, fp8=True,
                     in_place=in_place) as buf:
            idx, w = mc.routing(group, 5 - 2 * group.rank, buf.num_experts, 2, "random", 50)
            x = mc.tokens(group, 5 - 2 * group.rank, 384, F16, 50)
            mc.check_dispatch_combine(group, buf, x, idx, w, "expert_contig")
        return True
    run = programs_as_threads() if tiles == "segments" else contextlib.nullcontext()
    with run:
        assert ditron_ops.launch(body, 2, timeout_s=THREADED_TIMEOUT_S) == [True, True]


def test_buffer_exit_keeps_the_error_that_ended_the_block(monkeypatch):
    """A block that raises keeps its own error when closing fails too (a note names it)."""
    def body(group):
        def refuse(_):
            raise ditron_ops.DitronError("peer gone")
        with pytest.raises(ValueError, match="the block's own") as info:
            with Buffer(group, num_experts=2, max_tokens_per_rank=2, hidden=8, topk=1, dtype=F32) as buf:
                monkeypatch.setattr(group, "free_symmetric", refuse)
                raise ValueError("the block's own")
        assert buf.sym is None and any("peer gone" in n for n in info.value.__notes__)
        return True
    assert ditron_ops.launch(body, 1) == [True]


def test_unclosed_buffers_go_with_their_launch():
    """A Buffer never closed — its rank raised, or it skipped the collective ``close`` because
    a peer was gone (``combine_with_rank_1_missing``) — is dropped when its launch returns:
    unregistered, its memory freed with nothing else holding it."""
    import gc
    import weakref

    from ditron_ops.moe import buffer as buffer_module

    refs = []

    def body(group, fail):
        buf = _buffer(group)
        refs.append(weakref.ref(buf))
        if fail and group.rank == 0:
            raise ValueError("rank 0 failed")
        return mc.combine_with_rank_1_missing(group, buf, 3, F32, 6)

    assert ditron_ops.launch(body, 2, args=(False,), timeout_s=1.0)[1] == "skipped"
    with pytest.raises(ValueError, match="rank 0 failed"):
        ditron_ops.launch(body, 2, args=(True,), timeout_s=1.0)
    gc.collect()
    assert len(refs) == 4 and all(ref() is None for ref in refs)
    assert not [name for name in buffer_module._buffers if name.startswith("virtual")]


def test_buffers_go_with_their_launch_without_the_cycle_collector():
    """Nothing but reference counting frees a failed launch's Buffers: no error raised by
    ``check`` keeps its frame (and the caller's tensors) in a cycle; with the collector off,
    as it is between its runs."""
    import gc
    import weakref

    refs = []

    def body(group):
        buf = _buffer(group)
        refs.append(weakref.ref(buf))
        return mc.combine_with_rank_1_missing(group, buf, 3, F32, 6)

    gc.collect()
    gc.disable()
    try:
        assert ditron_ops.launch(body, 2, timeout_s=1.0)[1] == "skipped"
        alive = [ref() is not None for ref in refs]
    finally:
        gc.enable()
    assert len(refs) == 2 and not any(alive), alive


def test_dropped_buffer_refuses_calls():
    """``Buffer.drop`` (what a group ending with the Buffer open calls) leaves no usable
    Buffer behind, and a later ``close`` does nothing."""
    def body(group):
        buf = _buffer(group)
        buf.drop()
        with pytest.raises(ValueError, match="no open Buffer"):
            buf.dispatch(torch.zeros(1, 16), torch.zeros(1, 3, dtype=torch.int64))
        buf.close()
        return not group._owned
    assert ditron_ops.launch(body, 2) == [True, True]
