"""CPU tier: the stream-K experiment (``matmul(..., stream_k=True)``, ``_core.StreamKGemm``,
``_core_kernels.streamk_gemm_kernel``). The interpreter runs a grid's programs one after the
other in ticket order, so an owner's partials are there when it reads them; the programs are
forced above the interpreter's one (``INTERPRETER_PROGRAMS``) so tiles are cut between them."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm._core import matmul, streamk_split

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


def _plan():
    return next(reversed(_core._MATMUL_PLANS.cache._plans.values()))


def _ints(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


def test_streamk_split_rule():
    """Whole waves data-parallel but the last; that wave and the partial one stream-K; nothing
    for a whole number of waves or fewer iterations than programs."""
    assert streamk_split(21, 169, 132) == (0, 21)          # under a wave: all stream-K
    assert streamk_split(160, 15, 132) == (0, 160)         # 1.2 waves
    assert streamk_split(300, 10, 132) == (132, 168)       # 2.3 waves: one wave data-parallel
    assert streamk_split(264, 10, 132) is None             # whole waves
    assert streamk_split(3, 10, 132) is None               # 30 iterations for 132 programs
    for tiles, steps, p in itertools.product(range(1, 40), (1, 2, 7), (1, 3, 5, 8)):
        split = streamk_split(tiles, steps, p)
        if split is None:
            assert tiles % p == 0 or tiles * steps < p
            continue
        dp, sk = split
        assert dp % p == 0 and dp + sk == tiles and sk * steps >= p and (dp == 0 or sk >= p)


@pytest.mark.parametrize("programs", [2, 3, 5, 7])
def test_streamk_is_exact_for_integer_inputs(monkeypatch, programs):
    """Integer-valued inputs (every product and partial sum exact in fp32): stream-K equals the
    reference and the plain GEMM bitwise over programs that cut tiles anywhere (runs shorter
    and longer than a tile's K, whole waves data-parallel before the stream-K part), with
    bias, both B layouts, fp16 and fp32; the flags and the ticket are zero after each call
    (the next call, and a graph replay, start clean)."""
    monkeypatch.setattr(_core, "INTERPRETER_PROGRAMS", programs)
    _core._MATMUL_PLANS.__dict__.pop("cache", None)  # plans are keyed without the budget
    small = _core.TileConfig(16, 16, 16, 2, 4, 1)  # many tiles and K steps
    shapes = [(40, 40, 100), (33, 50, 327), (70, 48, 96), (50, 70, 200), (97, 60, 96), (120, 30, 64),
              (20, 20, 400)]  # the last: 4 tiles of 25 steps, runs inside one tile
    ran = 0
    for (m, n, k), dtype, kind, with_bias in itertools.product(
            shapes, (torch.float32, torch.float16), ("kn", "nk"), (False, True)):
        a = _ints(m, k, dtype=dtype)
        b = _ints(k, n, dtype=dtype, seed=1) if kind == "kn" else _ints(n, k, dtype=dtype, seed=1).t()
        bias = _ints(n, dtype=dtype, seed=2) if with_bias else None
        tiles = -(-m // 16) * -(-n // 16)
        if streamk_split(tiles, -(-k // 16), programs) is None:
            with pytest.raises(ValueError, match="stream_k"):
                matmul(a, b, bias=bias, cfg=small, stream_k=True, deterministic=False)
            continue
        got = matmul(a, b, bias=bias, cfg=small, stream_k=True, deterministic=False)
        core = _plan().core
        assert isinstance(core, _core.StreamKGemm) and core.sk_tiles > 0
        want = a.float() @ b.float() + (bias.float() if with_bias else 0)
        assert got.dtype == dtype and torch.equal(got.float(), want), (m, n, k, dtype, kind)
        assert int(core.flags.abs().sum()) == 0 and int(core.ticket) == 0
        assert torch.equal(matmul(a, b, bias=bias, cfg=small, stream_k=True, deterministic=False), got)
        ran += 1
    assert ran >= 8


def test_streamk_refuses_deterministic_and_split():
    a, b = _ints(8, 16), _ints(16, 8)
    with pytest.raises(ValueError, match="default mode only"):
        matmul(a, b, stream_k=True, deterministic=True)
    with pytest.raises(ValueError, match="default mode only"):
        matmul(a, b, stream_k=True, split_k=2, deterministic=False)


def test_bench_streamk_quick_writes_rows(monkeypatch, tmp_path):
    """``bench gemm_sweep --quick --only streamk`` (three programs in the interpreter): the
    rule's row, stream-K rows where the tiles leave a partial wave, a best row per shape and
    geo-mean rows, every result within fp16 rounding of the fp32 product."""
    import csv

    from ditron_ops.bench.__main__ import main

    monkeypatch.setattr(_core, "INTERPRETER_PROGRAMS", 3)
    _core._MATMUL_PLANS.__dict__.pop("cache", None)
    assert main(["gemm_sweep", "--quick", "--only", "streamk", "--rounds", "1",
                 "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("gemm_sweep-*.csv")))))
    assert {r["case"] for r in rows} == {"streamk fp16"}
    per_shape = [r for r in rows if r["shape"] != "geo-mean"]
    assert [r["impl"] for r in per_shape].count("rule") == 3
    assert [r["impl"] for r in per_shape].count("sk best") == 3
    sk = [r for r in per_shape if r["impl"].startswith("sk ") and r["impl"] != "sk best"]
    assert sk and all(int(r["sk_tiles"]) > 0 for r in sk)
    assert all(float(r["rel_err"]) < 1e-2 for r in per_shape)
    assert sorted(r["impl"] for r in rows if r["shape"] == "geo-mean") == ["rule", "sk best"]
