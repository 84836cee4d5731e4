"""GPU tier (H200): the plain ``matmul`` copies operands whose rows start off 32-byte sectors
onto 128-byte lines where the rule says (``_core_configs.pad_operands``, ``_pad.RowPad``): the
plan makes exactly the rule's copies, the product is exact on integer inputs (both B layouts,
bias), each call copies that call's values, a CUDA-graph replay copies too, and deterministic
mode's rows keep their bits."""
import pytest
import torch

from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, program_budget
from ditron_ops.gemm._pad import off_sectors, read_rows, row_alignment
from gemm_helpers import integer_cases, ints as _ints, last_plan as _plan  # (tests/gpu/)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES = ((9472, 856, 1864), (1024, 8192, 2056), (13080, 5248, 1160))
"""K 8 past a multiple of 16; the rule copies B, A and both for a weight's ``w.t()`` on 132
SMs (``test_gemm_pad.py``)."""


def _rule(a, b):
    """The rule's copies for ``a @ b`` (B's rows weighed only as a ``w.t()``: K long)."""
    m, k = a.shape
    b_k = None if read_rows(b) is b else read_rows(b)
    return rules.pad_operands(m, b.shape[1], k, program_budget(DEV, None), DEV,
                              deterministic=False, out_bytes=2,
                              a_sectored=not off_sectors(read_rows(a)),
                              b_sectored=not off_sectors(b_k))


@pytest.mark.parametrize("shape", SHAPES)
def test_copies_are_the_rules_and_exact(shape):
    """Each layout's plan makes the rule's copies (at least one for ``w.t()``), into rows on
    lines; integer inputs give the exact product rounded once; new values at the same
    addresses give the new product (the copy runs every call)."""
    m, n, k = shape
    a, bias = _ints(m, k, seed=1), _ints(n, seed=3)
    for layout, with_bias, b, want in integer_cases(a, bias, k, n):
        got = matmul(a, b, bias=bias if with_bias else None, deterministic=False, core="tl")
        plan = _plan()
        pads = (plan.a_copy is not None, plan.b_copy is not None)
        assert pads == _rule(a, b), (shape, layout)
        assert layout == "kn" or any(pads), shape
        for copy in (plan.a_copy, plan.b_copy):
            assert copy is None or copy.buf.stride(0) * 2 % 128 == 0
        assert torch.equal(got, want.to(torch.bfloat16)), (shape, layout, with_bias)
    a2 = _ints(m, k, seed=7)
    a.copy_(a2)
    got = matmul(a, b, bias=bias, deterministic=False, core="tl")
    assert torch.equal(got, (a2.double() @ b.double() + bias.double()).to(torch.bfloat16))


def test_copies_replay_from_a_cuda_graph_and_keep_deterministic_bits():
    """Captured after an eager call, the copies and the GEMM replay to the eager call's bits with
    new input values at the same addresses; deterministic mode's product (the same copies, the
    same K order) equals a padded-by-hand call's bits."""
    m, n, k = SHAPES[0]
    gen = torch.Generator(device="cpu").manual_seed(4)
    a = torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, k, generator=gen).to(dtype=torch.bfloat16, device=DEV).t()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    matmul(a, b, out=out, deterministic=False, core="tl")
    assert _plan().b_copy is not None
    ref = a.float() @ b.float()
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        matmul(a, b, out=out, deterministic=False, core="tl")
    a.copy_(torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device=DEV))
    b.copy_(torch.randn(k, n, generator=gen).to(dtype=torch.bfloat16, device=DEV))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul(a, b, deterministic=False, core="tl"))
    det = matmul(a, b, deterministic=True)
    w = b.t()
    lined = w.new_empty(n, -(-k // 64) * 64)[:, :k].copy_(w)
    assert row_alignment(read_rows(lined.t())) == 128
    assert torch.equal(det, matmul(a, lined.t(), deterministic=True))


def test_deterministic_rows_do_not_depend_on_copies_or_m():
    """Deterministic mode with the rule's copies (B copied at the full M): the rows of calls on
    row slices of A (views starting off lines; M 1, 17, 255, where other tiles and no copies
    run) are bitwise the full call's rows."""
    m, n, k = SHAPES[0]
    gen = torch.Generator(device="cpu").manual_seed(6)
    a = torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, k, generator=gen).to(dtype=torch.bfloat16, device=DEV).t()
    full = matmul(a, b, deterministic=True)
    assert _plan().b_copy is not None
    for lo, rows in ((3, 17), (1000, 255), (77, 1)):
        part = matmul(a[lo:lo + rows], b, deterministic=True)
        assert torch.equal(part, full[lo:lo + rows]), (lo, rows)
