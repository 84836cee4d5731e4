"""flash_decode on the CPU virtual world (interpreter) vs attention over the gathered KV."""
import pytest
import torch

import ditron_ops
from ditron_ops import reference

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _inputs(group, b, hq, hkv, d, s_max, dtype, lens, seed=0):
    gen_q = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=gen_q).to(dtype)
    gen = torch.Generator().manual_seed(seed * 100 + group.rank)
    k = torch.randn(b, s_max, hkv, d, generator=gen).to(dtype)
    v = torch.randn(b, s_max, hkv, d, generator=gen).to(dtype)
    return q, k, v, torch.tensor([lens(i, group.rank) for i in range(b)], dtype=torch.int32)


def _check(group, b, hq, hkv, d, s_max, dtype, lens):
    q, k, v, kv_lens = _inputs(group, b, hq, hkv, d, s_max, dtype, lens)
    out = ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=True)
    want = reference.flash_decode(q, k, v, kv_lens, group)
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err
    return err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world_size,b,hq,hkv,d", [(1, 1, 2, 2, 64), (2, 2, 4, 1, 64), (3, 3, 8, 2, 128),
                                                   (4, 2, 4, 4, 64)])
def test_matches_reference_uneven_lens(world_size, b, hq, hkv, d, dtype):
    lens = lambda i, r: (5 * i + 11 * r) % 23 if (i + r) % 3 else 0  # noqa: E731  (0 on some ranks)
    ditron_ops.launch(_check, world_size, args=(b, hq, hkv, d, 24, dtype, lens))


def test_long_cache_several_chunks():
    ditron_ops.launch(_check, 2, args=(1, 2, 1, 64, 1100, torch.float32, lambda i, r: 1100 - 77 * r))


def test_batch_invariance_and_run_to_run():
    def body(group):
        q, k, v, lens = _inputs(group, 4, 4, 2, 64, 40, torch.float32, lambda i, r: 9 + 7 * i + r, seed=3)
        full = ditron_ops.flash_decode(q, k, v, lens, group, deterministic=True)
        for _ in range(3):
            assert torch.equal(ditron_ops.flash_decode(q, k, v, lens, group, deterministic=True), full)
        for sel in ([0], [2], [1, 3], [3, 0]):
            part = ditron_ops.flash_decode(q[sel], k[sel], v[sel], lens[sel], group, deterministic=True)
            assert torch.equal(part, full[sel]), sel
        # a longer cache (more empty chunks) changes nothing
        pad = torch.cat([k, torch.randn(4, 600, 2, 64)], dim=1), torch.cat([v, torch.randn(4, 600, 2, 64)], dim=1)
        assert torch.equal(ditron_ops.flash_decode(q, *pad, lens, group, deterministic=True), full)
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


@pytest.mark.parametrize("bad,exc,match", [
    (dict(q=torch.zeros(2, 4, 32)), ValueError, "head_dim"),
    (dict(q=torch.zeros(2, 3, 64)), ValueError, "multiple of Hkv"),
    (dict(kv_lens=torch.zeros(2)), TypeError, "dtype"),
    (dict(kv_lens=torch.zeros(3, dtype=torch.int32)), ValueError, "disagree"),
    (dict(q=torch.zeros(2, 4, 64, dtype=torch.int32)), TypeError, "dtype"),
])
def test_validation(bad, exc, match):
    def body(group):
        args = dict(q=torch.zeros(2, 4, 64), k=torch.zeros(2, 8, 2, 64), v=torch.zeros(2, 8, 2, 64),
                    kv_lens=torch.zeros(2, dtype=torch.int32))
        args.update(bad)
        with pytest.raises(exc, match=match):
            ditron_ops.flash_decode(args["q"], args["k"], args["v"], args["kv_lens"], group)
        assert group._workspaces == {}
        return True
    assert ditron_ops.launch(body, 2) == [True, True]


def test_opcheck_and_compile():
    def body(group):
        q, k, v, lens = _inputs(group, 2, 4, 2, 64, 16, torch.float32, lambda i, r: 10 + i)
        utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.ditron.flash_decode.default,
                              (q, k, v, lens, group.group_name, 0.125, True), test_utils=utils)
        step = lambda x: ditron_ops.flash_decode(x * 1.0, k, v, lens, group, deterministic=True)  # noqa: E731
        torch._dynamo.reset()
        return torch.equal(torch.compile(step, fullgraph=True)(q), step(q))
    assert ditron_ops.launch(body, 1) == [True]


def test_programs_per_chunk_never_change_deterministic_bits(monkeypatch):
    """Deterministic partials are fixed 512-key chunks; how many chunks one program takes
    (chosen from the batch and the GPU) must not change a bit. A default-mode plan (one partial
    per program, uneven last split) matches the reference."""
    from ditron_ops.attention import flash_decode as api

    def body(group):
        q, k, v, lens = _inputs(group, 2, 2, 1, 64, 1100, torch.float32, lambda i, r: 1100 - 300 * i - 77 * r)
        return (ditron_ops.flash_decode(q, k, v, lens, group, deterministic=True),
                reference.flash_decode(q, k, v, lens, group))

    def run(plan):  # a fresh world per partition: a group's plan keeps the partition it chose
        monkeypatch.setattr(api, "partition", lambda *a: plan)
        return ditron_ops.launch(body, 2)

    det = [run(plan) for plan in [(512, 512, 3, 3), (512, 1024, 3, 2), (512, 1536, 3, 1)]]
    for rank in range(2):
        outs = [per_plan[rank][0] for per_plan in det]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
        assert (outs[0] - det[0][rank][1]).abs().max().item() < 1e-5
    for out, want in run((400, 400, 3, 3)):
        assert (out - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("deterministic", [True, False])
def test_one_rank_single_partial_writes_output_directly(monkeypatch, deterministic):
    """One rank, one partial per pair (short cache): split-KV writes the output itself (no
    combine runs). Its bits equal a two-rank merge whose second rank holds no keys (the merge
    of one real partial returns it unchanged); empty sequences give zeros."""
    from ditron_ops.attention import flash_decode as api

    lens = lambda i, r: (0, 5, 24, 17)[i] if r == 0 else 0  # noqa: E731

    def body(group):
        q, k, v, kv_lens = _inputs(group, 4, 4, 2, 64, 24, torch.float16, lens)
        return ditron_ops.flash_decode(q, k, v, kv_lens, group, deterministic=deterministic)

    two = ditron_ops.launch(body, 2)

    def no_combine(*args, **kwargs):
        raise AssertionError("the one-rank single-partial call ran the combine")
    monkeypatch.setattr(api, "_bound_combine", no_combine)
    (one,) = ditron_ops.launch(body, 1)
    assert torch.equal(one, two[0]) and torch.equal(one, two[1])
    assert torch.equal(one[0], torch.zeros_like(one[0]))
    ditron_ops.launch(_check, 1, args=(4, 4, 2, 64, 24, torch.float16, lens))  # asserts inside


def _lens_outside_cache(group, bad, through_op):
    """A 4-key view of an 8-key cache; ``bad`` keys on this rank's sequence 1."""
    q, k, v, lens = _inputs(group, 2, 4, 2, 64, 8, torch.float32, lambda i, r: 3)
    k, v = k[:, :4], v[:, :4]  # a view: keys 4..7 exist in memory but are not the cache
    lens[1] = bad
    if through_op:  # the op itself: no host check, the kernel records it
        want = reference.flash_decode(q, k, v, lens.clamp(0, 4), group, softmax_scale=0.125)
        out = []
        with pytest.raises(ditron_ops.DitronError) as info:  # at the call's own check (W > 1)
            out.append(torch.ops.ditron.flash_decode(q, k, v, lens, group.group_name, 0.125, True))
            group.synchronize()  # or at the next one
        for o in out:  # the clamped lengths: nothing past the view was read
            assert (o - want).abs().max().item() < 1e-5
    else:
        with pytest.raises(ditron_ops.DitronError) as info:
            ditron_ops.flash_decode(q, k, v, lens, group)
    err = info.value
    assert isinstance(err, ditron_ops.DitronInputError) and (err.index, err.value) == (1, bad), err
    assert "kv_lens[1]" in str(err), str(err)
    return True


@pytest.mark.parametrize("bad", [9, 5000, -1])
@pytest.mark.parametrize("through_op,world_size", [(False, 1), (True, 1), (True, 2)])
def test_kv_lens_outside_the_cache_raise(bad, through_op, world_size):
    assert ditron_ops.launch(_lens_outside_cache, world_size,
                             args=(bad, through_op)) == [True] * world_size
