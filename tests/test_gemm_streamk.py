"""CPU tier: stream-K in the default mode's plain ``matmul`` (``_core.StreamKGemm``; its layout
``_core_configs.streamk_layout``). The interpreter's budget is one program, so the kernels run
through ``StreamKGemm`` with a budget given; the rule is a pure function tested on the GPU's
candidates."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul
from triton.tools.tensor_descriptor import TensorDescriptor

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
CUDA = torch.device("cuda")  # only the type reaches the rule
TILES = rules.TileConfig(16, 16, 16, 4, 4, 1)


def _ints(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(torch.float32)


def _run(a, b, bias, out, programs):
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [TILES.block_m, TILES.block_k])
    core = _core.StreamKGemm(a_desc, b, out, bias, m=a.shape[0], cfg=TILES, a_varies=True,
                             programs=programs)
    core.run(a, b, out, bias)
    return core


@pytest.mark.parametrize("m,n,k,programs", [
    (40, 24, 100, 5),     # 6 tiles of 7 steps on 5 programs: every program cuts a tile
    (33, 50, 324, 7),     # 12 tiles of 21 steps: pieces of 36 steps, some tiles in 2-3
    (16, 16, 512, 9),     # one tile of 32 steps in 8 pieces (MAX_PIECES), 8 programs used
    (70, 48, 96, 4),      # 15 tiles: 2 waves data-parallel, 7 tiles stream-K
    (64, 64, 64, 16),     # 16 tiles on 16 programs: every tile whole, nothing to reduce
])
def test_streamk_is_exact_for_integer_inputs(m, n, k, programs):
    """Integer-valued inputs (every partial sum exact in fp32): stream-K equals the reference
    bitwise with and without bias, both B layouts, a strided (pointer-stored) out; twice the
    same plan gives the same bits."""
    for kind, with_bias in itertools.product(("kn", "nk"), (False, True)):
        a = _ints(m, k)
        b = _ints(k, n, seed=1) if kind == "kn" else _ints(n, k, seed=1).t()
        bias = _ints(n, seed=2) if with_bias else None
        want = a @ b + (bias if bias is not None else 0)
        out = torch.full((m, n), float("nan"))
        core = _run(a, b, bias, out, programs)
        assert torch.equal(out, want), (kind, with_bias)
        col = torch.full((n, m), float("nan")).t()  # column-major out
        _run(a, b, bias, col, programs)
        assert torch.equal(col, want)
    lay = core.layout
    assert lay.grid <= programs and lay.dp_tiles + lay.sk_tiles == -(-m // 16) * -(-n // 16)


def test_streamk_sums_pieces_in_k_order():
    """Pieces are summed in K order, rounded once: with values whose fp32 sum depends on the
    order, the result is the sequential sum of the pieces' partial products (the same bits as
    the K slices summed left to right), not another order."""
    m, n, k, programs = 16, 16, 256, 4  # one tile of 16 steps, 4 a program (MIN_SLICE_STEPS)
    a = torch.zeros(m, k)
    b = torch.zeros(k, n)
    vals = [1e8, 1.0, -1e8, 1.0]  # ((1e8 + 1) - 1e8) + 1 = 1 in fp32, not 2
    for s, v in enumerate(vals):
        a[:, s * 64] = v  # (one value in each program's piece)
        b[s * 64, :] = 1.0
    out = torch.empty(m, n)
    core = _run(a, b, None, out, programs)
    assert core.layout.pieces == 4
    want = torch.tensor(0.0)
    for v in vals:
        want = want + torch.tensor(v, dtype=torch.float32)
    assert torch.equal(out, torch.full((m, n), want.item()))


@pytest.mark.parametrize("tiles,steps,programs", [
    (21, 169, 132), (135, 117, 132), (1088, 163, 132), (264, 10, 132), (3, 5, 8), (1, 40, 132)])
def test_streamk_layout_covers_every_step_once(tiles, steps, programs):
    """``streamk_layout``: whole waves but one data-parallel, the rest shared out with no tile
    in more than ``MAX_PIECES`` pieces; the runs cover every stream-K step exactly once; the
    piece count is what the runs cut."""
    lay = rules.streamk_layout(tiles, steps, programs)
    assert lay.dp_tiles % programs == 0 and lay.dp_tiles + lay.sk_tiles == tiles
    assert lay.sk_tiles < 2 * programs or lay.dp_tiles == 0
    assert lay.grid <= programs and lay.run_steps >= rules.MIN_SLICE_STEPS
    total = lay.sk_tiles * steps
    covered = []
    pieces = 0
    for p in range(lay.grid):
        lo, hi = p * lay.run_steps, min((p + 1) * lay.run_steps, total)
        covered += range(lo, hi)
        for t in range(lo // steps, -(-hi // steps)) if lo < hi else ():
            part = max(lo, t * steps) > t * steps or min(hi, (t + 1) * steps) < (t + 1) * steps
            pieces += part
    assert covered == list(range(total))
    assert pieces == lay.pieces
    for t in range(lay.sk_tiles):
        first, last = t * steps // lay.run_steps, ((t + 1) * steps - 1) // lay.run_steps
        assert last - first + 1 <= rules.MAX_PIECES


def test_rule_never_streams_in_deterministic_mode_or_off_the_gpu():
    """``select_streamk``: None in deterministic mode, in the interpreter, and for the skinny
    and two-per-SM picks; a shape whose last wave is nearly empty gets stream-K on the GPU
    model where its time is clearly less."""
    for det in (True, False):
        for shape in [(800, 768, 10760), (3408, 1248, 7440), (8192, 4096, 4096)]:
            chosen = rules.select_split(*shape, 132, CUDA, deterministic=det)
            if det:
                assert rules.select_streamk(*shape, 132, CUDA, deterministic=True,
                                            chosen=chosen) is None
            assert rules.select_streamk(*shape, 1, torch.device("cpu"), deterministic=det,
                                        chosen=chosen) is None
    for m in (1, 16, 32):
        chosen = rules.select_split(m, 4096, 8192, 132, CUDA, deterministic=False)
        assert rules.select_streamk(m, 4096, 8192, 132, CUDA, deterministic=False,
                                    chosen=chosen) is None
    m, n = 128 * 66, 256 * 16  # 1056 tiles of 128x256: 8 whole waves, nothing to share out
    chosen = rules.select_split(m, n, 4096, 132, CUDA, deterministic=False)
    assert rules.select_streamk(m, n, 4096, 132, CUDA, deterministic=False, chosen=chosen) is None


def test_matmul_refuses_streamk_with_determinism_or_split():
    a, b = _ints(16, 32), _ints(32, 16)
    with pytest.raises(ValueError, match="stream_k"):
        matmul(a, b, stream_k=True, deterministic=True)
    with pytest.raises(ValueError, match="stream_k"):
        matmul(a, b, stream_k=True, split_k=2, deterministic=False)
    # forced in the interpreter (one program: every tile whole) still gives the product
    got = matmul(a, b, stream_k=True, deterministic=False)
    assert torch.equal(got, a @ b)
