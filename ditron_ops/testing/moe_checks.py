"""Checks of ``ditron_ops.moe`` shared by the CPU (interpreter) and GPU tests.

``check_dispatch_combine`` runs one deterministic dispatch and an identity-expert combine and
compares them with ``moe.reference`` (the all-to-all oracle) bit for bit; ``identity_combine``
is the expected combine of identity experts computed on this rank alone (the same fp32
operations in the same order), for cheap checks of long call sequences;
``quotient_mismatches`` checks the fp8 quotient against IEEE division (its kernel:
``_moe_check_kernels``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..moe import Buffer, reference
from ..runtime.group import Group
from ._moe_check_kernels import quotient_kernel


def routing(group: Group, tokens: int, num_experts: int, topk: int, kind: str, seed: int,
            dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [T, k], topk_weights fp32 [T, k])`` of this rank, on the group's device.

    ``kind``: ``"random"`` (distinct experts per token, about one slot in 7 set to -1),
    ``"skewed"`` (every token's experts among the first ``k + 2``: the first ranks get all),
    ``"one_expert"`` (every token to expert ``E - 1`` only), ``"none"`` (all -1).
    """
    gen = torch.Generator().manual_seed(seed * 1000 + group.rank)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)]) \
        if tokens else torch.empty(0, topk, dtype=torch.int64)
    if kind == "random":
        idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.15, -1, idx)
    elif kind == "skewed":
        idx = torch.stack([torch.randperm(min(num_experts, topk + 2), generator=gen)[:topk]
                           for _ in range(tokens)]) if tokens else idx
    elif kind == "one_expert":
        idx = torch.full_like(idx, -1)
        idx[:, 0] = num_experts - 1
    elif kind == "none":
        idx = torch.full_like(idx, -1)
    else:
        raise ValueError(kind)
    weights = torch.rand(tokens, topk, generator=gen)
    return idx.to(dtype).to(group.device), weights.to(group.device)


def tokens(group: Group, count: int, hidden: int, dtype: torch.dtype, seed: int,
           rank: Optional[int] = None) -> torch.Tensor:
    """Rank ``rank``'s (default: this rank's) random ``[count, hidden]`` tokens of ``seed``."""
    gen = torch.Generator().manual_seed(seed * 1000 + 500 + (group.rank if rank is None else rank))
    return torch.randn(count, hidden, generator=gen).to(dtype).to(group.device)


def identity_combine(x: torch.Tensor, dest: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """The combine of identity experts: ``sum_j w[t, j] * x[t]`` over kept slots, fp32, j in
    order, one rounding (bitwise what the kernel computes when every expert returns its input)."""
    t, k = dest.shape
    acc = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        w = weights[:, j:j + 1] if weights is not None else torch.ones(t, 1, device=x.device)
        acc = torch.where(dest[:, j:j + 1] >= 0, acc + w * x.float(), acc)
    return acc.to(x.dtype)


def row_experts(buf: Buffer, d) -> torch.Tensor:
    """Global expert of every received row (``int64 [R]``; rows past the last expert: its id)."""
    el, rank = buf.experts_local, buf.group.rank
    rows = d.handle.src_of_row.shape[0]
    at = torch.arange(rows, device=d.offsets.device)
    local = torch.bucketize(at, d.offsets[1:].long(), right=True).clamp(max=el - 1)
    return local + rank * el


def _settle(group: Group) -> None:
    """Every rank's kernels done before host reads (a device-to-host copy while a peer's kernel
    spins can stall a GPU virtual world)."""
    group.synchronize()
    group.barrier()


def check_dispatch_combine(group: Group, buf: Buffer, x: torch.Tensor, idx: torch.Tensor,
                           weights: Optional[torch.Tensor], layout: str, alignment: int = 1) -> None:
    """One deterministic dispatch + identity combine vs the reference, bitwise (AssertionError)."""
    d = buf.dispatch(x, idx, weights, layout=layout, expert_alignment=alignment, deterministic=True)
    _settle(group)
    buf.check()
    want = reference.dispatch_reference(x, idx, weights, group, num_experts=buf.num_experts,
                                        max_tokens=buf.max_tokens, layout=layout,
                                        expert_alignment=alignment, capacity=buf.capacity,
                                        fp8=buf.fp8, round_scale=buf.round_scale)
    rows = want["rows"].to(x.device)
    flat = d.x.reshape(-1, buf.hidden)
    what = f"rank {group.rank}, {layout}, alignment {alignment}"
    for name, got in (("counts", d.counts), ("offsets", d.offsets), ("cstart", d.handle.cstart),
                      ("dest", d.handle.dest), ("src_of_row", d.handle.src_of_row),
                      ("weights", d.weights.reshape(-1))):
        assert torch.equal(got, want[name]), f"{what}: {name} {got.tolist()} != {want[name].tolist()}"
    if buf.fp8:
        assert torch.equal(flat[rows].view(torch.uint8), want["x"][rows].view(torch.uint8)), what
        assert torch.equal(d.scales.reshape(-1, buf.hidden // 128)[rows], want["scales"][rows]), what
        y = (flat.float() * d.scales.reshape(-1, buf.hidden // 128).repeat_interleave(128, 1)).to(buf.dtype)
    else:
        assert torch.equal(flat[rows], want["x"][rows]), what
        y = flat
    out = buf.combine(y.reshape(d.x.shape), d.handle)
    _settle(group)
    expect = reference.combine_reference(y, want, weights, group, num_experts=buf.num_experts,
                                         max_tokens=buf.max_tokens, topk=buf.topk)
    assert torch.equal(out, expect), f"{what}: combine differs by {(out.float() - expect.float()).abs().max()}"
    if not buf.fp8:
        assert torch.equal(out, identity_combine(x, d.handle.dest, weights)), what


def combine_with_rank_1_missing(group: Group, buf: Buffer, count: int, dtype: torch.dtype,
                                seed: int):
    """Tests: every rank dispatches, then rank 1 skips the combine. Rank 1 returns
    ``"skipped"``; a peer returns its ``DitronTimeoutError``'s ``(op, rank, peer)``, or
    ``"no error"``. (The buffer is not closed: the skipping rank must not wait in a collective
    free.)"""
    from ..errors import DitronTimeoutError

    idx, w = routing(group, count, buf.num_experts, buf.topk, "random", seed)
    d = buf.dispatch(tokens(group, count, buf.hidden, dtype, seed), idx, w)
    _settle(group)
    if group.rank == 1:
        return "skipped"
    try:
        buf.combine(d.x, d.handle)
        group.synchronize()
    except DitronTimeoutError as exc:
        return (exc.op, exc.rank, exc.peer)
    return "no error"


def quotient_cases(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v fp32 [rows, 128], scale fp32 [rows])`` (rows a multiple of 128) that are hard for
    a quotient by a reciprocal: scales over 2^-24 .. 2^40 (a quarter ``amax / 448`` as the
    kernels make them, an eighth with all-ones mantissas, some powers of two), half the values
    one to four ulps around an e4m3 value or rounding midpoint times the scale, the others
    uniform in ``[-448, 448] x scale``; per row ``+-0``, subnormal and tiny values, NaN of
    both signs; the last 1/64 of the rows a group holding ``+-inf`` (scale ``+inf``, what the
    kernels compute for it), their other values finite."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.ldexp(1 + torch.rand(rows, generator=gen), torch.randint(-24, 40, (rows,), generator=gen)).float()
    n = rows // 8
    s[:n] = torch.ldexp(torch.full((n,), 2 - 2 ** -23), torch.randint(-24, 40, (n,), generator=gen)).float()
    s[n:n + n // 4] = torch.ldexp(torch.ones(n // 4), torch.randint(-24, 40, (n // 4,), generator=gen)).float()
    amax = torch.ldexp(1 + torch.rand(2 * n, generator=gen), torch.randint(-13, 20, (2 * n,), generator=gen)).float()
    s[2 * n:4 * n] = amax.clamp(min=1e-4) / torch.full_like(amax, 448.0)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    points = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])
    hard = points[torch.randint(0, len(points), (rows, 64), generator=gen)] * s[:, None]
    steps = torch.randint(-4, 5, (rows, 64), generator=gen).int()
    v = (torch.rand(rows, 128, generator=gen) * 2 - 1) * 448 * s[:, None]
    v[:, :64] = torch.where(hard > 0, (hard.view(torch.int32) + steps).view(torch.float32), hard)
    v[:, :64] *= torch.where(torch.rand(rows, 64, generator=gen) < 0.5, -1.0, 1.0)
    v[:, 64:68] = torch.tensor([0.0, -0.0, 1e-40, -3e-42])
    v[:, 68:72] *= 1e-7
    v[:, 72:74] = torch.tensor([float("nan"), -float("nan")])
    k = rows // 64
    v[-k:] = v[:k]  # finite values of all sizes, zeros and NaN
    v[-k:, 74:76] = torch.tensor([float("inf"), -float("inf")])
    s[-k:] = float("inf")
    return v, s


def quotient_mismatches(device: torch.device, quant: int, rows: int = 1024, seed: int = 0) -> int:
    """Values of ``quotient_cases`` whose ``_kernels._quotient`` differs from fp32 IEEE division
    (torch's, on ``device``): NaN where the division is NaN (any NaN bits), the fp32 bits where
    ``|v / s| >= 2^-20`` or ``s`` is ``+inf`` (``+-0`` of v's sign), the e4m3 codes everywhere,
    a NaN code of either sign where the division is NaN (torch's cast keeps the sign of its
    NaN, the GPU's may not)."""
    v, s = (t.to(device) for t in quotient_cases(rows, seed))
    want = v / s[:, None]
    q = torch.empty_like(v)
    c = torch.empty(v.shape, dtype=torch.uint8, device=device)
    quotient_kernel[(rows // 16,)](v, s, q, c, QUANT=quant, R=16)
    nan = want.isnan()
    bad = (q.isnan() != nan).sum()
    bad += torch.where(nan, (c & 0x7F) != 0x7F, c != want.to(torch.float8_e4m3fn).view(torch.uint8)).sum()
    exact = ~nan & ((want.abs() >= 2.0 ** -20) | s.isinf()[:, None])
    bad += (q[exact].view(torch.int32) != want[exact].view(torch.int32)).sum()
    return int(bad)
