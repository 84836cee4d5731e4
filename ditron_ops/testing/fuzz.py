"""Randomized programs of ops on one virtual world: Hypothesis strategies, a runner, its checks.

A ``Program`` is a world size W and 3-30 ``Call``s drawn from every op of the package
(all_gather, reduce_scatter, all_reduce with each algorithm, all_to_all, ag_gemm, gemm_rs and
gemm_ar with each impl and algorithm, flash_decode, ulysses_attention, MoE dispatch -> combine),
each with its own shapes: zero rows or keys on some ranks, uneven shards, sizes that are not
multiples of the tiles, non-contiguous, transposed and misaligned inputs where the API takes
them, every dtype of the device, default and deterministic mode (as an argument or through
``ditron_ops.deterministic()``). ``run_program`` runs the whole program inside one
``ditron_ops.launch`` and checks every result against the plain-torch references:

- bitwise where the op promises it: gathers, all-to-all, the collectives' rank-ordered fp32
  sums (both modes), deterministic gemm_rs / gemm_ar against the order-exact sum of our GEMM's
  fp32 products, deterministic MoE dispatch/combine against ``moe.reference``, the default-mode
  combine of identity experts, and deterministic flash_decode's batch invariance;
- else within a relative tolerance of the fp32 reference (GEMMs: relative to ``|A| @ |B|``, the
  bound of a dot product's rounding error, so cancelling sums do not fail).

Every rank runs the same program; a call's per-rank data comes from its seed and the rank, so
arguments that must agree do agree, except in the one call of a ``Mismatch``
(``programs(mismatch=True)``, ``fuzz_mismatch``): one rank changes the dtype, an agreed
dimension or a flag there, every rank must get ``DitronMismatchError`` naming the op, the field
and both values, and the program goes on (its other calls are checked). A rank runs its calls
back to back (no host synchronization between them: the protocol's state lives in such
sequences), then synchronizes once (a recorded device error is raised as itself, not seen as a
wrong result), then checks every call.

A ``Fault`` makes one rank raise before a call, or skip it and every later one; the other ranks
must then get a ``DitronError`` (``DitronTimeoutError``) within ``FAULT_BOUND`` waits
(``run_faulty_program``). A hang is a failure: every wait is bounded by the launch's timeout.
A ``delay`` fault makes one rank late to a call instead (its stream sleeps on a GPU): every
result must still be right (``run_program``).

Sizes: ``CPU_SIZES`` (tiny) for the interpreter, ``GPU_SIZES`` (shapes across the kernels'
tiles) with ``dtypes=GPU_DTYPES`` and ``max_world=6`` on a GPU. Cost in the CPU interpreter
(2 cores): a call takes 10-120 ms at W = 2, 40-450 ms at W = 4 and 90 ms-1.3 s at W = 6
(ulysses_attention, flash_decode and the MoE exchange are the dearest); 150 programs of W in
1..4 take about 2.5 minutes, hence ``programs()``'s default ``max_world=4``. Needs
``hypothesis`` (the dev extra).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Optional

import torch
from hypothesis import strategies as st

from .. import reference
from ..attention.flash_decode import flash_decode
from ..attention.ulysses import ulysses_attention
from ..collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from ..deterministic import deterministic as deterministic_mode
from ..errors import DitronError, DitronMismatchError, clear_frames
from ..gemm.ag_gemm import ag_gemm
from ..gemm.gemm_rs import gemm_ar, gemm_rs
from ..gemm._core import matmul
from ..moe import Buffer, reference as moe_reference
from ..runtime.group import Group
from ..runtime.split import split_sizes
from ..runtime.virtual import launch
from . import moe_checks
from .ag_gemm_checks import REL_TOL as GEMM_TOL
from .fuzz_mismatch import Mismatch, draw_mismatch
from .ulysses_checks import REL_TOL as ATTENTION_TOL

CPU_DTYPES = (torch.float32, torch.float16)  # bf16 arithmetic is wrong in the interpreter
GPU_DTYPES = (torch.bfloat16, torch.float16)
MODES = ("default", "deterministic", "context")  # context: inside ``ditron_ops.deterministic()``
LAYOUTS = ("contiguous", "padded", "strided", "transposed", "offset")
"""How an input is laid out: ``padded`` rows of a wider buffer, ``strided`` every other element
of the last dim, ``transposed`` the last two dims swapped, ``offset`` one element past an
aligned base (misaligned)."""
ROW_LAYOUTS = ("contiguous", "padded", "offset")  # the last dim contiguous (flash_decode's rule)
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ag_gemm", "gemm_rs", "gemm_ar",
       "flash_decode", "ulysses_attention", "moe")
PREFIX_TIMEOUT_S = 10.0
"""Wait bound of the calls no fault touches: peers that are merely slow (a loaded CPU
running the interpreter) must not look like a fault."""
FAULT_BOUND = 2
"""A survivor's error may take this many timeouts after the faulty call began. Issue 23,
deliverable 2 brings ag_gemm, gemm_ar and flash_decode (measured at 2x) down to 1."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One op call: the same on every rank; ``args`` are the op's drawn shapes and flags."""
    op: str
    dtype: torch.dtype
    mode: str
    seed: int
    args: dict


@dataclasses.dataclass(frozen=True)
class Fault:
    """Rank ``rank`` raises (``kind="raise"``) before call ``call``, or returns there
    (``"skip"``: that call and every later one are never made), or is late to it
    (``"delay"``: its stream sleeps ``cycles`` GPU clock cycles first, ``cycles`` ns of host
    time in the interpreter; the program must still give correct results)."""
    rank: int
    call: int
    kind: str
    cycles: int = 0


@dataclasses.dataclass(frozen=True)
class Program:
    """``calls`` on a virtual world of ``world_size`` ranks; ``moe`` sizes its MoE Buffers
    (``experts_per_rank``, ``max_tokens``, ``hidden``, ``topk``), one per (dtype, fp8);
    at most one of ``fault`` and ``mismatch`` (a rank that disagrees, ``fuzz_mismatch``)."""
    world_size: int
    calls: tuple
    moe: dict
    fault: Optional[Fault] = None
    mismatch: Optional[Mismatch] = None


class InjectedFault(Exception):
    """Raised by the faulty rank of a ``Fault(kind="raise")``."""


# -- strategies -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Sizes:
    """Upper bounds of the drawn shapes (all lower bounds are 0 or 1). ``CPU_SIZES``: tiny,
    for the interpreter; ``GPU_SIZES``: shapes that cross the GPU kernels' tiles with partial
    ones (the GEMMs' 128 x 256 x 64 tiles: N to 320, K to 320, M to 400; flash_decode's
    512-key deterministic chunks: 600 keys per rank), yet small enough for 2000 programs in
    minutes. With the GEMM core's shape-aware rule (``gemm._core_configs.select_config``)
    most of these products fit one wave of 64 x 128 tiles, which the rule then picks: gemm_rs /
    gemm_ar always, ag_gemm about 94% of the time (128 x 128 about 6%, 128 x 256 rarely, at a
    large gathered M; estimated from the draws' bounds on 132 SMs, W 1-6).
    ``fd_dims``/``uly_dims``: head dims drawn (a repeated one weighs more)."""
    rows: int = 6              # all_gather rows per rank
    dim: int = 5               # a trailing dim of the collectives' inputs
    rs_rows: int = 3           # reduce_scatter: up to rs_rows * W + 2 rows
    a2a_dim: int = 4           # all_to_all dims (the scattered one: W x 1..a2a_mult)
    a2a_mult: int = 3
    gemm_n: int = 24           # N of every GEMM
    ag_rows: int = 20          # ag_gemm M_r
    ag_k: int = 24             # ag_gemm K
    rs_m: int = 24             # gemm_rs / gemm_ar M
    rs_k: int = 20             # gemm_rs / gemm_ar K_r
    fd_b: int = 3              # flash_decode batch, keys per rank, KV heads, Hq / Hkv
    fd_keys: int = 20
    fd_hkv: int = 2
    fd_group: int = 2
    fd_dims: tuple = (64, 64, 64, 128)  # 128 costs twice as much in the interpreter
    uly_b: int = 2             # ulysses batch and S_r
    uly_s: int = 6
    uly_dims: tuple = (64,)
    moe_experts: int = 3       # MoE experts per rank, T_max, top-k, hidden (fp8: fp8_hidden)
    moe_tokens: int = 6
    moe_topk: int = 3
    moe_hidden: tuple = (8, 16, 24)
    fp8_hidden: int = 128


CPU_SIZES = Sizes()
GPU_SIZES = Sizes(rows=160, dim=48, rs_rows=40, a2a_dim=16, a2a_mult=8, gemm_n=320, ag_rows=200,
                  ag_k=320, rs_m=400, rs_k=200, fd_b=4, fd_keys=600, fd_hkv=4, fd_group=4,
                  fd_dims=(64, 128), uly_b=2, uly_s=96, uly_dims=(64, 128), moe_experts=4,
                  moe_tokens=48, moe_topk=4, moe_hidden=(64, 256, 520), fp8_hidden=256)


def _per_rank(w: int, values) -> st.SearchStrategy:
    return st.lists(values, min_size=w, max_size=w)


def _rest(max_dims: int, sz: Sizes) -> st.SearchStrategy:
    """Trailing dims of a tensor (0 allowed: empty rows)."""
    return st.lists(st.integers(0, sz.dim), min_size=0, max_size=max_dims).map(tuple)


def _draw_all_gather(draw, w: int, sz: Sizes) -> dict:
    rows = draw(_per_rank(w, st.integers(0, sz.rows)))
    even = draw(st.booleans())
    rows = [rows[0]] * w if even else rows
    return dict(rows=rows, rest=draw(_rest(2, sz)), layout=draw(st.sampled_from(LAYOUTS)),
                pass_sizes=not even or draw(st.booleans()))


def _draw_reduce_scatter(draw, w: int, sz: Sizes) -> dict:
    return dict(rows=draw(st.integers(0, sz.rs_rows * w + 2)), rest=draw(_rest(2, sz)),
                layout=draw(st.sampled_from(LAYOUTS)))


def _draw_all_reduce(draw, w: int, sz: Sizes) -> dict:
    return dict(shape=draw(_rest(3, sz)), layout=draw(st.sampled_from(LAYOUTS)),
                algorithm=draw(st.sampled_from(("auto", "one_shot", "two_shot"))))


def _draw_all_to_all(draw, w: int, sz: Sizes) -> dict:
    shape = list(draw(st.lists(st.integers(1, sz.a2a_dim), min_size=1, max_size=4)))
    scatter = draw(st.integers(0, len(shape) - 1))
    shape[scatter] = w * draw(st.integers(1, sz.a2a_mult))
    return dict(shape=tuple(shape), scatter_dim=scatter,
                gather_dim=draw(st.integers(0, len(shape) - 1)), layout=draw(st.sampled_from(LAYOUTS)))


def _draw_gemm_common(draw, sz: Sizes) -> dict:
    return dict(n=draw(st.integers(0, sz.gemm_n)), a_layout=draw(st.sampled_from(LAYOUTS)),
                b_layout=draw(st.sampled_from(LAYOUTS)),
                impl=draw(st.sampled_from(("auto", "fused", "baseline"))))


def _draw_ag_gemm(draw, w: int, sz: Sizes) -> dict:
    rows = draw(_per_rank(w, st.integers(0, sz.ag_rows)))
    even = draw(st.booleans())
    return dict(_draw_gemm_common(draw, sz), rows=[rows[0]] * w if even else rows,
                pass_sizes=not even or draw(st.booleans()), k=draw(st.integers(0, sz.ag_k)),
                bias=draw(st.booleans()), out=draw(st.booleans()),
                return_gathered=draw(st.booleans()))


def _draw_shards(draw, m: int, w: int) -> Optional[list]:
    """None (the default split) or ``w`` row counts summing to ``m`` (zeros allowed)."""
    if draw(st.booleans()):
        return None
    cuts = sorted(draw(_per_rank(w - 1, st.integers(0, m))))
    return [b - a for a, b in zip([0] + cuts, cuts + [m])]


def _draw_gemm_rs(draw, w: int, sz: Sizes) -> dict:
    m = draw(st.integers(0, sz.rs_m))
    return dict(_draw_gemm_common(draw, sz), m=m, k=draw(_per_rank(w, st.integers(0, sz.rs_k))),
                shard_sizes=_draw_shards(draw, m, w))


def _draw_gemm_ar(draw, w: int, sz: Sizes) -> dict:
    return dict(_draw_gemm_common(draw, sz), m=draw(st.integers(0, sz.rs_m)),
                k=draw(_per_rank(w, st.integers(0, sz.rs_k))),
                algorithm=draw(st.sampled_from(("auto", "one_shot", "two_shot"))))


def _draw_flash_decode(draw, w: int, sz: Sizes) -> dict:
    b = draw(st.integers(1, sz.fd_b))
    s_max = draw(_per_rank(w, st.integers(0, sz.fd_keys)))
    empty = draw(_per_rank(w, st.booleans()))  # ranks holding no keys at all
    lens = [[0 if empty[r] else draw(st.integers(0, s_max[r])) for _ in range(b)] for r in range(w)]
    hkv = draw(st.integers(1, sz.fd_hkv))
    return dict(b=b, hkv=hkv, hq=hkv * draw(st.integers(1, sz.fd_group)),
                d=draw(st.sampled_from(sz.fd_dims)),
                s_max=s_max, lens=lens, layout=draw(st.sampled_from(ROW_LAYOUTS)),
                lens_dtype=draw(st.sampled_from(("int32", "int64"))),
                slice=draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b, unique=True)))


def _draw_ulysses_attention(draw, w: int, sz: Sizes) -> dict:
    hkv = draw(st.sampled_from([d for d in range(1, w + 1) if w % d == 0] + [2 * w]))
    hq = math.lcm(hkv, w) * draw(st.integers(1, 2))
    b, s_r = draw(st.integers(1, sz.uly_b)), draw(st.integers(1, sz.uly_s))
    # one head dim draws nothing (the CPU tier's programs stay the ones it always drew)
    d = sz.uly_dims[0] if len(sz.uly_dims) == 1 else draw(st.sampled_from(sz.uly_dims))
    return dict(b=b, s_r=s_r, hq=hq, hkv=hkv, d=d,
                causal=draw(st.booleans()), layout=draw(st.sampled_from(LAYOUTS)))


def _draw_moe(draw, w: int, sz: Sizes, cfg: dict) -> dict:
    layout = draw(st.sampled_from(("expert_padded", "expert_contig")))
    return dict(tokens=draw(_per_rank(w, st.integers(0, cfg["max_tokens"]))),
                routing=draw(st.sampled_from(("random", "random", "skewed", "one_expert", "none"))),
                idx_dtype=draw(st.sampled_from(("int32", "int64"))), weights=draw(st.booleans()),
                layout=layout,
                alignment=1 if layout == "expert_padded" else draw(st.sampled_from((1, 4))),
                fp8=draw(st.sampled_from((False, False, False, True))),
                reuse_handle=draw(st.booleans()), x_layout=draw(st.sampled_from(LAYOUTS)))


_DRAW = {op: globals()[f"_draw_{op}"] for op in OPS}


@st.composite
def calls(draw, world_size: int, moe: dict, dtypes=CPU_DTYPES, ops=OPS,
          sizes: Sizes = CPU_SIZES) -> Call:
    """One ``Call`` of an op in ``ops`` for a world of ``world_size`` ranks."""
    op = draw(st.sampled_from(ops))
    args = (_DRAW[op](draw, world_size, sizes, moe) if op == "moe" else
            _DRAW[op](draw, world_size, sizes))
    return Call(op, draw(st.sampled_from(dtypes)), draw(st.sampled_from(MODES)),
                draw(st.integers(0, 2**16)), args)


DELAY_CYCLES = (10**4, 10**6, 2 * 10**7)
"""A late rank's sleep: about 5 us, 0.5 ms and 10 ms of an H200's clock. The wait bounds are
seconds, so lateness must never turn into an error or a wrong result."""


@st.composite
def programs(draw, min_world: int = 1, max_world: int = 4, min_calls: int = 3, max_calls: int = 30,
             dtypes=CPU_DTYPES, ops=OPS, faults: tuple = (), mismatch: bool = False,
             sizes: Sizes = CPU_SIZES) -> Program:
    """A ``Program`` (see the module docstring) of shapes bounded by ``sizes``. ``faults``:
    the ``Fault`` kinds to draw one of (``"raise"``, ``"skip"``, ``"delay"``), none when
    empty; ``mismatch``: one call where a rank disagrees (``fuzz_mismatch``; ``dtypes`` must
    hold two dtypes). Either makes W >= 2. Both are drawn after the calls, so the programs
    drawn without them stay the programs they were."""
    assert not (faults and mismatch), "a fault or a mismatch, not both"
    w = draw(st.integers(max(min_world, 2 if faults or mismatch else 1), max_world))
    moe = dict(experts_per_rank=draw(st.integers(1, sizes.moe_experts)),
               max_tokens=draw(st.integers(1, sizes.moe_tokens)),
               hidden=draw(st.sampled_from(sizes.moe_hidden)), fp8_hidden=sizes.fp8_hidden)
    moe["topk"] = draw(st.integers(1, min(sizes.moe_topk, moe["experts_per_rank"] * w)))
    body = tuple(draw(st.lists(calls(w, moe, dtypes, ops, sizes), min_size=min_calls,
                               max_size=max_calls)))
    fault = disagree = None
    if faults:
        rank, at, kind = (draw(st.integers(0, w - 1)), draw(st.integers(0, len(body) - 1)),
                          draw(st.sampled_from(faults)))
        fault = Fault(rank, at, kind, draw(st.sampled_from(DELAY_CYCLES)) if kind == "delay" else 0)
    if mismatch:
        at = draw(st.integers(0, len(body) - 1))
        marked, disagree = draw_mismatch(draw, body[at], at, w, dtypes, sizes, moe)
        body = body[:at] + (marked,) + body[at + 1:]
    return Program(w, body, moe, fault, disagree)


# -- inputs ---------------------------------------------------------------------------------------

def _generator(call: Call, rank: Optional[int], salt: int = 0) -> torch.Generator:
    """This rank's (``rank=None``: every rank's shared) random stream of ``call``."""
    return torch.Generator().manual_seed((call.seed * 8 + salt) * 64 + (63 if rank is None else rank))


def _tensor(shape, call: Call, rank: Optional[int], group: Group, layout: str = "contiguous",
            salt: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Random ``shape`` in ``call.dtype`` laid out as ``layout`` (``LAYOUTS``; layouts that need
    more dims than ``shape`` has fall back to contiguous)."""
    gen, shape = _generator(call, rank, salt), tuple(shape)
    values = (torch.randn(shape, generator=gen) * scale).to(call.dtype)
    if not shape or (layout == "transposed" and len(shape) < 2):
        layout = "contiguous"
    if layout == "padded":
        base = torch.zeros(*shape[:-1], shape[-1] + 3, dtype=call.dtype)[..., :shape[-1]]
    elif layout == "strided":
        base = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=call.dtype)[..., ::2]
    elif layout == "transposed":
        base = torch.zeros(*shape[:-2], shape[-1], shape[-2], dtype=call.dtype).transpose(-1, -2)
    elif layout == "offset":
        base = torch.zeros(values.numel() + 1, dtype=call.dtype)[1:].view(shape)
    else:
        base = torch.empty(shape, dtype=call.dtype)
    return base.copy_(values).to(group.device)


# -- checks ---------------------------------------------------------------------------------------

def _equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{name}: not bitwise equal; {int((diff != 0).sum())} elements differ, "
                             f"max {diff.max().item():.3e}")


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, scale: float) -> None:
    """``|got - want| <= tol * max(scale, 1)`` elementwise (``want`` fp32)."""
    assert tuple(got.shape) == tuple(want.shape), f"{name}: {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel():
        err = (got.float() - want.float()).abs().max().item()
        bound = tol * max(scale, 1.0)
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def _mode(call: Call) -> tuple[Optional[bool], Any]:
    """(the op's ``deterministic`` argument, the context the call runs in)."""
    if call.mode == "context":
        return None, deterministic_mode()
    return call.mode == "deterministic", contextlib.nullcontext()


def _det(call: Call) -> bool:
    return call.mode != "default"


# -- runners: run the call and return its check (compare with the reference: AssertionError) ---
# The check runs after ``group.synchronize()``, so an error the call recorded on the device is
# raised as itself, not seen as a wrong result.

def _run_all_gather(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    x = _tensor((a["rows"][r], *a["rest"]), call, r, group, a["layout"])
    got = all_gather(x, group, shard_sizes=a["rows"] if a["pass_sizes"] else None)
    return lambda: _equal("all_gather", got, reference.all_gather(x, group))


def _run_reduce_scatter(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    x = _tensor((a["rows"], *a["rest"]), call, r, group, a["layout"])
    det, mode = _mode(call)
    with mode:
        got = reduce_scatter(x, group, deterministic=det)
    # both modes sum in rank order in fp32 and round once
    return lambda: _equal("reduce_scatter", got, reference.reduce_scatter(x, group))


def _run_all_reduce(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    x = _tensor(a["shape"], call, r, group, a["layout"])
    det, mode = _mode(call)
    with mode:
        got = all_reduce(x, group, algorithm=a["algorithm"], deterministic=det)
    return lambda: _equal(f"all_reduce {a['algorithm']}", got, reference.all_reduce(x, group))


def _run_all_to_all(group: Group, call: Call, ctx) -> Callable[[], None]:
    a = call.args
    x = _tensor(a["shape"], call, group.rank, group, a["layout"])
    got = all_to_all(x, a["scatter_dim"], a["gather_dim"], group)
    return lambda: _equal("all_to_all", got,
                          reference.all_to_all(x, group, a["scatter_dim"], a["gather_dim"]))


def _operands(group: Group, call: Call, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [m, k] of this rank, b [k, N]; ``b`` shared by all ranks for ag_gemm)."""
    a, scale = call.args, max(k, 1) ** -0.25
    x = _tensor((m, k), call, group.rank, group, a["a_layout"], scale=scale)
    shared = call.op == "ag_gemm"
    w = _tensor((k, a["n"]), call, None if shared else group.rank, group, a["b_layout"], 1, scale)
    return x, w


def _run_ag_gemm(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    x, w = _operands(group, call, a["rows"][r], a["k"])
    bias = _tensor((a["n"],), call, None, group, salt=2) if a["bias"] else None
    out = _tensor((sum(a["rows"]), a["n"]), call, r, group, "strided", 3) if a["out"] else None
    res = ag_gemm(x, w, group, bias=bias, out=out, return_gathered=a["return_gathered"],
                  impl=a["impl"], shard_sizes=a["rows"] if a["pass_sizes"] else None)
    got, gathered = res if a["return_gathered"] else (res, None)

    def check() -> None:
        full = reference.all_gather(x, group)
        want, bound = full.float() @ w.float(), full.float().abs() @ w.float().abs()
        if bias is not None:
            want, bound = want + bias.float(), bound + bias.float().abs()
        if out is not None:
            assert got.data_ptr() == out.data_ptr(), "ag_gemm: out was not written"
        if gathered is not None:
            _equal("ag_gemm gathered", gathered, full)
        _close("ag_gemm", got, want, GEMM_TOL[call.dtype], bound.max().item() if bound.numel() else 0.0)
    return check


def _order_exact(x: torch.Tensor, w: torch.Tensor, group: Group) -> torch.Tensor:
    """``Σ_r x_r @ w_r``: fp32 products of our GEMM summed in rank order, rounded once."""
    part = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[1]:  # no K columns on this rank: its product is 0
        matmul(x, w, out=part, deterministic=True)
    return reference.rank_ordered_sum(reference.gather_tensors(part, group), x.dtype)


def _check_gemm(x, w, group, call: Call, got: torch.Tensor, rows: slice) -> None:
    """Deterministic: bitwise the order-exact sum; default: within tolerance of fp32."""
    name = f"{call.op} {call.args['impl']} {call.args.get('algorithm', '')}".strip()
    if _det(call):
        _equal(name, got, _order_exact(x, w, group)[rows])
        return
    want = reference.all_reduce(x.float() @ w.float(), group)[rows]
    bound = reference.all_reduce(x.float().abs() @ w.float().abs(), group)[rows]
    _close(name, got, want, GEMM_TOL[call.dtype], bound.max().item() if bound.numel() else 0.0)


def _run_gemm_rs(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    x, w = _operands(group, call, a["m"], a["k"][r])
    det, mode = _mode(call)
    with mode:
        got = gemm_rs(x, w, group, deterministic=det, impl=a["impl"], shard_sizes=a["shard_sizes"])
    sizes = a["shard_sizes"] or split_sizes(a["m"], group.world_size)
    start = sum(sizes[:r])
    return lambda: _check_gemm(x, w, group, call, got, slice(start, start + sizes[r]))


def _run_gemm_ar(group: Group, call: Call, ctx) -> Callable[[], None]:
    a = call.args
    x, w = _operands(group, call, a["m"], a["k"][group.rank])
    det, mode = _mode(call)
    with mode:
        got = gemm_ar(x, w, group, deterministic=det, impl=a["impl"], algorithm=a["algorithm"])
    return lambda: _check_gemm(x, w, group, call, got, slice(None))


def _run_flash_decode(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    q = _tensor((a["b"], a["hq"], a["d"]), call, None, group, a["layout"])
    k, v = (_tensor((a["b"], a["s_max"][r], a["hkv"], a["d"]), call, r, group, a["layout"], salt)
            for salt in (1, 2))
    lens = torch.tensor(a["lens"][r], dtype=getattr(torch, a["lens_dtype"]), device=group.device)
    det, mode = _mode(call)
    sel = a["slice"]
    with mode:
        got = flash_decode(q, k, v, lens, group, deterministic=det)
        part = (flash_decode(q[sel], k[sel], v[sel], lens[sel], group, deterministic=det)
                if _det(call) else None)

    def check() -> None:
        want = reference.flash_decode(q, k, v, lens, group).float()
        _close("flash_decode", got, want, ATTENTION_TOL[call.dtype], want.abs().max().item())
        if part is not None:  # batch invariance: a slice's rows are the full batch's, bit for bit
            _equal(f"flash_decode batch slice {sel}", part, got[sel])
    return check


def _run_ulysses_attention(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    q, k, v = (_tensor((a["b"], a["s_r"], h, a["d"]), call, r, group, a["layout"], salt)
               for salt, h in ((0, a["hq"]), (1, a["hkv"]), (2, a["hkv"])))
    det, mode = _mode(call)
    with mode:
        got = ulysses_attention(q, k, v, group, causal=a["causal"], deterministic=det)

    def check() -> None:
        want = reference.ulysses_attention(q, k, v, group, causal=a["causal"]).float()
        _close("ulysses_attention", got, want, ATTENTION_TOL[call.dtype], want.abs().max().item())
    return check


def _run_moe(group: Group, call: Call, ctx) -> Callable[[], None]:
    a, r = call.args, group.rank
    buf = ctx.buffer(call)
    # both combine paths: in place (the virtual world's) and staged (every other backend's);
    # the seed is the same on every rank, so the ranks agree
    buf.combine_in_place = call.seed % 2 == 0
    count = a["tokens"][r]
    idx, weights = moe_checks.routing(group, count, buf.num_experts, buf.topk, a["routing"],
                                      call.seed, getattr(torch, a["idx_dtype"]))
    weights = weights if a["weights"] else None
    x = _tensor((count, buf.hidden), call, r, group, a["x_layout"])
    det, mode = _mode(call)
    out = again = None
    with mode:
        d = buf.dispatch(x, idx, weights, layout=a["layout"], expert_alignment=a["alignment"],
                         deterministic=det)
        if not buf.fp8:  # fp8 rows are combined after dequantization: the deterministic check
            out = buf.combine(d.x, d.handle)
            if a["reuse_handle"]:
                again = buf.combine(buf.dispatch(x, handle=d.handle).x, d.handle)

    def check() -> None:
        buf.check()
        if _det(call):  # one more dispatch + combine: positions, rows, weights, combine bitwise
            moe_checks.check_dispatch_combine(group, buf, x, idx, weights, a["layout"], a["alignment"])
        want = moe_reference.dispatch_reference(
            x, idx, weights, group, num_experts=buf.num_experts, max_tokens=buf.max_tokens,
            layout=a["layout"], expert_alignment=a["alignment"], capacity=buf.capacity, fp8=buf.fp8)
        _equal("moe counts", d.counts, want["counts"])
        _equal("moe offsets", d.offsets, want["offsets"])
        if out is not None:  # identity experts: independent of placement (fp32, k order, one rounding)
            _equal("moe combine", out, moe_checks.identity_combine(x, d.handle.dest, weights))
        if again is not None:
            _equal("moe combine (reused handle)", again, out)
    return check


_RUN = {op: globals()[f"_run_{op}"] for op in OPS}


class _Context:
    """Per-rank state of one program run: its MoE Buffers, made on first use (collective)."""

    def __init__(self, group: Group, program: Program):
        self.group, self.cfg, self.buffers = group, program.moe, {}

    def buffer(self, call: Call) -> Buffer:
        """The Buffer of the call's (dtype, fp8), sized by the program, or by the call's
        ``buffer`` overrides (a disagreeing rank's own Buffer, ``fuzz_mismatch``)."""
        fp8, extra = call.args["fp8"], call.args.get("buffer", {})
        key = (call.dtype, fp8, tuple(sorted(extra.items())))
        if key not in self.buffers:
            c, w = {**self.cfg, **extra}, self.group.world_size
            self.buffers[key] = Buffer(self.group, num_experts=c["experts_per_rank"] * w,
                                       max_tokens_per_rank=c["max_tokens"],
                                       hidden=c.get("fp8_hidden", 128) if fp8 else c["hidden"],
                                       topk=c["topk"], dtype=call.dtype, fp8=fp8)
        return self.buffers[key]

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()


# -- runner ---------------------------------------------------------------------------------------

def _noting(group: Group, index: int, call: Call, fn: Callable[[], Any]) -> Any:
    """``fn()``, its error naming the rank and the call."""
    try:
        return fn()
    except AssertionError as exc:
        raise AssertionError(f"rank {group.rank}, call {index} ({call}): {exc}") from None
    except Exception as exc:
        exc.add_note(f"rank {group.rank}, call {index}: {call}")
        raise


def _delay(group: Group, cycles: int) -> None:
    """Make this rank late: its stream sleeps (GPU), or its thread (the interpreter, whose
    kernels run on the calling thread)."""
    if group.device.type == "cuda":
        torch.cuda._sleep(cycles)
    else:
        time.sleep(cycles * 1e-9)


def _disagree(group: Group, mm: Mismatch, call: Call, ctx: "_Context") -> None:
    """Make this rank's side of the disagreeing call: it must raise ``DitronMismatchError``
    naming the op, the field, this rank's value and the named peer's (AssertionError if not)."""
    mine = mm.variant if group.rank == mm.rank else call
    try:
        _RUN[mine.op](group, mine, ctx)
    except DitronMismatchError as err:
        def value(rank: int):
            return mm.values[1] if rank == mm.rank else mm.values[0]
        got = (err.op, err.field, err.mine, err.theirs)
        want = (mm.op, mm.field, value(group.rank), value(err.peer))
        assert got == want and err.peer != group.rank and err.rank == group.rank, \
            f"rank {group.rank}: {err} ({got} != {want})"
        assert err.peer == mm.rank or group.rank == mm.rank, f"peer {err.peer} of {mm}"
        return
    raise AssertionError(f"rank {group.rank}: no DitronMismatchError for {mm}")


def _rank_body(group: Group, program: Program, outcomes: dict,
               fault_timeout_s: Optional[float] = None) -> str:
    """Run ``program`` on this rank: every call back to back (no host synchronization between
    them, where the protocol's state lives), then one ``synchronize`` (a recorded device error
    is raised as itself, not seen as a wrong result), then every call's check. A ``raise`` or
    ``skip`` fault: no checks; the survivors' outcomes go to ``outcomes`` (``_survive``), their
    waits from the faulty call on bounded by ``fault_timeout_s`` (the calls before it keep the
    launch's bound: a peer slow to finish them, e.g. in a loaded interpreter, is no fault). A
    mismatch: the disagreeing call must raise on every rank (``_disagree``), then the program
    goes on and every other call is checked."""
    ctx, fault, mm, checks = _Context(group, program), program.fault, program.mismatch, []
    for i, call in enumerate(program.calls):
        if fault is not None and i == fault.call and fault.kind != "delay":
            if group.rank == fault.rank:
                if fault.kind == "raise":
                    raise InjectedFault(f"rank {group.rank} raised before call {i}")
                return "skipped"
            if fault_timeout_s is not None:
                group.timeout_s = fault_timeout_s
            outcomes[group.rank] = _survive(group, program.calls[i:], ctx, i)
            return "survived"
        if fault is not None and i == fault.call and group.rank == fault.rank:
            _delay(group, fault.cycles)
        if mm is not None and i == mm.call:
            _noting(group, i, call, lambda: _disagree(group, mm, call, ctx))
            continue
        checks.append((i, call, _noting(group, i, call, lambda: _RUN[call.op](group, call, ctx))))
    group.synchronize()
    for i, call, check in checks:
        _noting(group, i, call, check)
    ctx.close()
    return "ok"


def _survive(group: Group, rest: tuple, ctx: _Context, first: int):
    """Run the calls from the faulty one on, then one all_reduce that needs every rank;
    returns ``(error, seconds until it)``, or None when none came."""
    t0 = time.monotonic()
    try:
        for i, call in enumerate(rest):
            _noting(group, first + i, call, lambda: _RUN[call.op](group, call, ctx))
        all_reduce(torch.ones(1, device=group.device), group)
        group.synchronize()
    except DitronError as exc:  # its frames' locals (the rank's tensors, Buffers) go now
        clear_frames(exc)
        return exc, time.monotonic() - t0
    return None


def run_program(program: Program, timeout_s: float = PREFIX_TIMEOUT_S) -> list:
    """Run ``program`` (no fault but a ``delay``; a mismatch allowed) in one ``launch``; every
    call checked (AssertionError). Returns the ranks' results (``"ok"``)."""
    assert program.fault is None or program.fault.kind == "delay", program.fault
    return launch(_rank_body, program.world_size, args=(program, {}), timeout_s=timeout_s)


def fault_free(program: Program) -> Program:
    """The calls of ``program`` up to its faulty (or disagreeing) one, without the fault."""
    last = program.fault.call if program.fault is not None else program.mismatch.call
    return dataclasses.replace(program, calls=program.calls[:last + 1], fault=None, mismatch=None)


def run_faulty_program(program: Program, timeout_s: float = 0.5, relaunch: bool = True) -> dict:
    """Run ``program`` with its ``raise`` or ``skip`` ``Fault``: assert that every other rank
    got a ``DitronError`` within ``FAULT_BOUND`` timeouts of the faulty call (+1 s of host
    work; ``timeout_s`` bounds the waits from that call on, the calls before it have
    ``run_program``'s bound), that the launch raised the injected error (``raise``) or returned
    (``skip``), and
    (``relaunch``) that a new launch of ``fault_free(program)`` then passes its checks.
    Returns ``{rank: (error, seconds)}`` of the survivors (errors without their frames'
    locals, ``errors.clear_frames``: nothing of the launch outlives it)."""
    fault, outcomes = program.fault, {}
    assert fault is not None and fault.kind in ("raise", "skip"), fault
    raised = ""
    try:
        launch(_rank_body, program.world_size, args=(program, outcomes, timeout_s),
               timeout_s=PREFIX_TIMEOUT_S)
    except InjectedFault as exc:  # (kept as text: the exception's frames would hold this one)
        raised = repr(exc)
    assert bool(raised) == (fault.kind == "raise"), f"launch raised {raised or None} for {fault}"
    survivors = [r for r in range(program.world_size) if r != fault.rank]
    for r in survivors:
        got = outcomes.get(r)
        assert got is not None, f"rank {r} got no DitronError after {fault}"
        assert got[1] <= FAULT_BOUND * timeout_s + 1.0, \
            f"rank {r}: {type(got[0]).__name__} after {got[1]:.1f} s > bound ({got[0]})"
    if relaunch:
        assert run_program(fault_free(program)) == ["ok"] * program.world_size
    return {r: outcomes[r] for r in survivors}
