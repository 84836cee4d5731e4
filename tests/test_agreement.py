"""Cross-rank agreement (``runtime.agreement``): ranks that call a collective with disagreeing
dtype, dimensions or flags get ``DitronMismatchError`` on every rank, naming the op, the field and
both values, before anything is launched (CPU virtual world, interpreter)."""
from types import SimpleNamespace

import pytest
import torch

import ditron_ops
from ditron_ops.moe import Buffer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
W = 3


def _dt(group):
    """fp16 on rank 1, fp32 elsewhere."""
    return torch.float16 if group.rank == 1 else torch.float32


def _n(group, n=8):
    """``n`` on every rank but rank 2, which has ``n + 8``."""
    return n + 8 * (group.rank == 2)


CASES = {  # name: (fn(group), field, value on rank r)
    "all_gather dtype": (lambda g: ditron_ops.all_gather(torch.ones(2, 8, dtype=_dt(g))),
                         "dtype", _dt),
    "reduce_scatter dtype": (lambda g: ditron_ops.reduce_scatter(torch.ones(6, 8, dtype=_dt(g))),
                             "dtype", _dt),
    "all_reduce dtype": (lambda g: ditron_ops.all_reduce(torch.ones(6, dtype=_dt(g))), "dtype", _dt),
    "all_reduce algorithm": (lambda g: ditron_ops.all_reduce(
        torch.ones(6), algorithm="two_shot" if g.rank == 2 else "one_shot"), "algorithm",
        lambda g: "two_shot" if g.rank == 2 else "one_shot"),
    "all_to_all dtype": (lambda g: ditron_ops.all_to_all(torch.ones(6, 8, dtype=_dt(g)), 0, 1),
                         "dtype", _dt),
    "ag_gemm dtype": (lambda g: ditron_ops.ag_gemm(torch.ones(2, 8, dtype=_dt(g)),
                                                   torch.ones(8, 8, dtype=_dt(g)), impl="fused"),
                      "dtype", _dt),
    "ag_gemm K": (lambda g: ditron_ops.ag_gemm(torch.ones(2, _n(g)), torch.ones(_n(g), 8),
                                               impl="fused"), "K", _n),
    "ag_gemm N": (lambda g: ditron_ops.ag_gemm(torch.ones(2, 8), torch.ones(8, _n(g)),
                                               impl="fused"), "N", _n),
    "gemm_rs dtype": (lambda g: ditron_ops.gemm_rs(torch.ones(6, 8, dtype=_dt(g)),
                                                   torch.ones(8, 8, dtype=_dt(g)), impl="fused"),
                      "dtype", _dt),
    "gemm_rs N": (lambda g: ditron_ops.gemm_rs(torch.ones(6, 8), torch.ones(8, _n(g)),
                                               impl="fused"), "N", _n),
    "gemm_ar dtype": (lambda g: ditron_ops.gemm_ar(torch.ones(6, 8, dtype=_dt(g)),
                                                   torch.ones(8, 8, dtype=_dt(g)), impl="fused"),
                      "dtype", _dt),
    "gemm_ar N": (lambda g: ditron_ops.gemm_ar(torch.ones(6, 8), torch.ones(8, _n(g)),
                                               impl="fused"), "N", _n),
    "gemm_rs deterministic": (lambda g: ditron_ops.gemm_rs(
        torch.ones(6, 8), torch.ones(8, 8), deterministic=g.rank == 0), "deterministic",
        lambda g: g.rank == 0),
    "flash_decode dtype": (lambda g: ditron_ops.flash_decode(
        torch.ones(2, 4, 64, dtype=_dt(g)), *[torch.ones(2, 5, 2, 64, dtype=_dt(g))] * 2,
        torch.full((2,), 5)), "dtype", _dt),
    "flash_decode Hkv": (lambda g: ditron_ops.flash_decode(
        torch.ones(2, 4, 64), *[torch.ones(2, 5, 4 if g.rank == 2 else 2, 64)] * 2,
        torch.full((2,), 5)), "Hkv", lambda g: 4 if g.rank == 2 else 2),
    "ulysses dtype": (lambda g: ditron_ops.ulysses_attention(
        *[torch.ones(1, 4, 3, 64, dtype=_dt(g))] * 3), "dtype", _dt),
    "moe Buffer dtype": (lambda g: Buffer(g, num_experts=W, max_tokens_per_rank=4, hidden=8,
                                          topk=1, dtype=_dt(g)), "dtype", _dt),
}


def _disagree(group, name):
    fn, field, value = CASES[name]
    with pytest.raises(ditron_ops.DitronMismatchError) as info:
        fn(group)
    err = info.value
    assert err.field == field and err.mine == value(group), (err.field, err.mine)
    assert err.theirs != err.mine and err.theirs == value(SimpleNamespace(rank=err.peer)), str(err)
    assert err.op.split(".")[-1].split("_attention")[0] in name.replace(" ", "_"), err.op
    assert f"rank {group.rank} passed" in str(err) and "-1" not in str(err), str(err)
    assert not group._workspaces  # nothing was allocated or launched
    return err.peer


@pytest.mark.parametrize("name", sorted(CASES))
def test_disagreement_raises_on_every_rank(name):
    peers = ditron_ops.launch(_disagree, W, args=(name,), timeout_s=5.0)
    assert all(p != r for r, p in enumerate(peers))


def _moe_layouts(group):
    buf = Buffer(group, num_experts=W, max_tokens_per_rank=4, hidden=8, topk=1,
                 dtype=torch.float32)
    x, idx = torch.ones(2, 8), torch.zeros(2, 1, dtype=torch.int64)
    layout = "expert_contig" if group.rank == 0 else "expert_padded"
    with pytest.raises(ditron_ops.DitronMismatchError, match="disagree on layout"):
        buf.dispatch(x, idx, layout=layout)
    return True


def test_moe_dispatch_layout_disagreement():
    assert ditron_ops.launch(_moe_layouts, W, timeout_s=5.0) == [True] * W


def _agreed_once(group):
    """A repeated call agrees with nobody again (its validation is remembered); a new
    signature does."""
    exchanges = []
    gather = group.all_gather_object
    group.all_gather_object = lambda obj: exchanges.append(obj) or gather(obj)
    x = torch.ones(4, 8)
    for _ in range(3):
        ditron_ops.all_reduce(x)
    ditron_ops.all_reduce(x[:2])  # a new shape: a new signature
    ditron_ops.all_reduce(torch.ones(8, 4).t())  # new strides, same signature: not exchanged
    return [s for s in exchanges if isinstance(s, tuple) and s[0] == "all_reduce"]


def test_signature_exchanged_once_per_signature():
    got = ditron_ops.launch(_agreed_once, 2)
    assert got[0] == got[1] and [dict(s[1])["x.shape"] for s in got[0]] == [(4, 8), (2, 8)]
