"""CPU tier: operand rows copied onto 128-byte lines for the plain ``matmul`` (``_pad.RowPad``,
the rule ``_core_configs.pad_operands``, and ``select_split``'s ``lined``). The copy kernel and
the plan run in the interpreter (the rule pads only on the GPU, so the plan tests make it say
pad); the rule is tested as a pure function on the GPU's candidates."""
import itertools

import pytest
import torch

from ditron_ops.gemm import _core
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul
from ditron_ops.gemm._pad import LINE_BYTES, RowPad, off_sectors, read_rows, row_alignment

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
CUDA = torch.device("cuda")  # (only the type reaches the rule)
CPU = torch.device("cpu")


def _ints(*shape, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=gen).to(dtype)


def _rows(rows: int, cols: int, pitch: int, dtype=torch.float16, seed=0) -> torch.Tensor:
    """``[rows, cols]`` integer values in rows ``pitch`` elements apart, the first on a line."""
    e = torch.empty((), dtype=dtype).element_size()
    store = torch.zeros(rows * pitch + LINE_BYTES, dtype=dtype)
    skip = (-store.data_ptr() % LINE_BYTES) // e
    t = store[skip:skip + rows * pitch].view(rows, pitch)[:, :cols]
    return t.copy_(_ints(rows, cols, dtype=dtype, seed=seed))


def test_row_alignment_says_where_rows_start():
    """Lines (pitch a multiple of 128 bytes), sectors (32 or 64), 16 bytes; one row counts by its
    base only; a row-major B and a weight's ``w.t()`` are read as their row-major view."""
    assert row_alignment(_rows(4, 60, 64)) == 128    # 128-byte pitch
    assert row_alignment(_rows(4, 60, 80)) == 32     # 160 bytes
    assert row_alignment(_rows(4, 60, 96)) == 64     # 192 bytes
    assert row_alignment(_rows(4, 60, 72)) == 16     # 144 bytes
    assert row_alignment(_rows(1, 60, 72)) == 128
    assert row_alignment(_rows(4, 60, 72)[:, 8:]) == 16
    assert row_alignment(None) == 128                # (a padded copy: rows on lines)
    w = _rows(6, 72, 72)
    assert read_rows(w.t()).data_ptr() == w.data_ptr() and read_rows(w.t()).stride() == (72, 1)
    assert read_rows(w) is w and read_rows(_rows(6, 60, 71)) is None  # (142-byte pitch)
    assert off_sectors(_rows(4, 64, 72)) and not off_sectors(_rows(4, 60, 72))  # (120-byte rows)
    assert not off_sectors(_rows(4, 64, 80)) and not off_sectors(None)
    with pytest.raises(ValueError, match="16-byte"):
        RowPad(_rows(4, 60, 72))


@pytest.mark.parametrize("rows,cols,pitch", [(37, 264, 264), (5, 8, 8), (9, 40, 72), (3, 1032, 1048)])
def test_row_pad_copies_rows_onto_lines(rows, cols, pitch):
    """``RowPad`` (``pad_rows_kernel`` in the interpreter): the copy equals its source, its rows
    start on lines, and each call copies that call's rows (another tensor of the layout)."""
    for dtype in (torch.float16, torch.float32):
        src = _rows(rows, cols, pitch, dtype=dtype)
        pad = RowPad(src)
        got = pad(src)
        e = src.element_size()
        assert got.shape == src.shape and got.stride(0) * e % LINE_BYTES == 0
        assert got.stride(0) < src.stride(0) + LINE_BYTES // e
        assert torch.equal(got, src)
        other = _rows(rows, cols, pitch, dtype=dtype, seed=5)
        assert torch.equal(pad(other), other) and pad.buf.data_ptr() == got.data_ptr()


def test_pad_rule_picks_the_cheaper_copies():
    """Measured shapes (H200, ``benchmarks/probes/align_probe.py``): copying B (2560 rows) pays where A has
    16360; copying A pays where it has half B's rows; B's rows alone off sectors cost the
    128x256 tiles too little for a copy, the 128x128 tiles enough; operands on sectors, the
    skinny tiles' M, tiles with a strip and the interpreter never copy; either mode answers
    alike (a copy changes no bits)."""
    def pad(m, n, k, a_sectored=False, b_sectored=False, device=CUDA, det=False):
        return rules.pad_operands(m, n, k, 132, device, deterministic=det, out_bytes=2,
                                  a_sectored=a_sectored, b_sectored=b_sectored)
    assert pad(16360, 2560, 7528) == (False, True)
    assert pad(4232, 7976, 10392) == (True, False)
    assert pad(16360, 2560, 7528, a_sectored=True) == (False, False)  # (B alone: 5% of it)
    assert pad(9472, 856, 1864, a_sectored=True) == (False, True)  # (128x128: 25%)
    assert pad(16360, 2560, 7528, b_sectored=True) == (False, False)  # (A's copy: 246 MB)
    assert pad(16360, 2560, 7528, True, True) == (False, False)
    assert pad(16, 2560, 7528) == (False, False)
    assert pad(4024, 1280, 1576) == (False, False)  # (128x320 tiles)
    assert pad(16360, 2560, 7528, device=CPU) == (False, False)
    for shape in ((16360, 2560, 7528), (4232, 7976, 10392), (9472, 856, 1864)):
        assert pad(*shape) == pad(*shape, det=True)


def test_pad_rule_properties():
    """Over a grid of shapes: a copy only of an operand off sectors, and only where the model
    puts the call under ``PAD_MARGIN`` of its time without copies."""
    ms, ns = (64, 200, 1500, 6000, 16360), (256, 900, 2560, 9000)
    ks = (1000, 2456, 7528, 16360)
    copies = 0
    for m, n, k, (a_s, b_s) in itertools.product(ms, ns, ks, ((False, False), (False, True),
                                                              (True, False))):
        pad_a, pad_b = rules.pad_operands(m, n, k, 132, CUDA, deterministic=False, out_bytes=2,
                                          a_sectored=a_s, b_sectored=b_s)
        assert not (pad_a and a_s) and not (pad_b and b_s), (m, n, k)
        if not (pad_a or pad_b):
            continue
        copies += 1
        c, s = rules.select_split(m, n, k, 132, CUDA, deterministic=False, lined=True)
        t = rules.estimated_us(c, s, m, n, k, 132)
        cost = (t * rules.misaligned_slowdown(c, not (a_s or pad_a), not (b_s or pad_b))
                + sum(r * k * 4 / rules.COPY_BYTES_PER_S * 1e6 + rules.COPY_LAUNCH_US
                      for r, p in ((m, pad_a), (n, pad_b)) if p))
        assert cost < rules.PAD_MARGIN * t * rules.misaligned_slowdown(c, not a_s, not b_s)
    assert copies > 10


def test_select_split_keeps_narrow_tiles_to_lined_rows():
    """``lined`` False (rows left off lines): no two-program pairs and no 128x128 sliced tail
    where lined rows get them; the default reads K (a multiple of 64: lined)."""
    pairs = (5408, 3936, 768)
    assert rules.select_split(*pairs, 132, CUDA, deterministic=False)[0] == \
        rules.SHORT_K_CANDIDATE
    assert rules.select_split(*pairs, 132, CUDA, deterministic=False, lined=False)[0] != \
        rules.SHORT_K_CANDIDATE
    tail = (6520, 384, 11520)
    cand, _ = rules.select_split(*tail, 132, CUDA, deterministic=False)
    assert cand.cfg.block_n == 128 and cand.cfg.tail_slices
    cand, _ = rules.select_split(*tail, 132, CUDA, deterministic=False, lined=False)
    assert not (cand.cfg.block_n == 128 and cand.cfg.tail_slices)
    assert rules.select_split(5408, 3936, 776, 132, CUDA, deterministic=False)[0] != \
        rules.SHORT_K_CANDIDATE


class _Doubling(RowPad):
    """``RowPad`` whose copies hold twice the call's values: a product that shows them was
    read from the copy, not from the call's tensor."""

    def __call__(self, rows):
        return super().__call__(rows).mul_(2)


@pytest.mark.parametrize("pads", [(True, True), (True, False), (False, True)])
def test_plan_reads_the_copies_the_rule_names(monkeypatch, pads):
    """A plan whose rule says copy (patched: the rule pads on the GPU only) reads the copies it
    makes each call (a copy holding doubled values doubles that operand in the product): for
    both B layouts (a row-major ``[K, N]`` B is never copied: its rows are N long), with bias,
    A's rows 16 bytes off sectors; the next call's values are copied again; the copies' rows
    start on lines."""
    monkeypatch.setattr(_core, "pad_operands", lambda *a, **k: pads)
    monkeypatch.setattr(_core, "RowPad", _Doubling)
    monkeypatch.setattr(_core._MATMUL_PLANS, "cache", None, raising=False)  # (plans of other pads)
    m, k, n = 40, 64, 24
    for kn in (True, False):
        a = _rows(m, k, 72)                          # (144-byte pitch: off sectors)
        b = _rows(k, n, 40, seed=1) if kn else _rows(n, k, 72, seed=1).t()
        bias = _ints(n, seed=2)
        for step in range(2):
            got = matmul(a, b, bias=bias, out=torch.empty(m, n))
            plan = next(reversed(_core._MATMUL_PLANS.cache._plans.values()))
            copied = (pads[0], pads[1] and not kn)
            assert (plan.a_copy is not None, plan.b_copy is not None) == copied
            for copy in (plan.a_copy, plan.b_copy):
                if copy is not None:
                    assert copy.buf.stride(0) * 2 % LINE_BYTES == 0
            want = ((a.float() * (2 if copied[0] else 1)) @ (b.float() * (2 if copied[1] else 1))
                    + bias.float())
            assert torch.equal(got, want), (kn, step)
            a.copy_(a * 2)
            b.copy_(b - 1)


@pytest.mark.parametrize("pad_a", [False, True])
def test_a_in_columns_is_read_as_given(monkeypatch, pad_a):
    """A column-major A (``x.t()``: no descriptor over it, none over its transpose as A) is
    copied into a plan buffer of rows, whatever the rule says about copies: the exact product;
    plans of two views 16 bytes apart within a line are two plans."""
    monkeypatch.setattr(_core, "pad_operands", lambda *a, **k: (pad_a, False))
    monkeypatch.setattr(_core._MATMUL_PLANS, "cache", None, raising=False)
    m, k, n = 40, 64, 24
    a = _rows(k, m, m).t()
    b = _rows(k, n, n, seed=1)
    got = matmul(a, b, out=torch.empty(m, n))
    assert torch.equal(got, a.float() @ b.float())
    plan = next(reversed(_core._MATMUL_PLANS.cache._plans.values()))
    assert plan.a_copy is None and plan.a_pad is not None
    store = _rows(4, 2 * k, 2 * k)  # (256-byte pitch: rows on lines, then 16 bytes off them)
    first, second = store[:, :k], store[:, 8:8 + k]
    for view in (first, second):
        matmul(view, b, out=torch.empty(4, n))
    assert len(_core._MATMUL_PLANS.cache._plans) == 3
