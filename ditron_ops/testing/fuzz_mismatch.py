"""Disagreeing ranks for the randomized programs (``fuzz.programs(mismatch=True)``).

A ``Mismatch`` makes one rank call one op of a program with an argument that must agree
across ranks changed (``runtime.agreement``): the dtype, an agreed dimension (N and K of
ag_gemm, M and N of gemm_rs / gemm_ar, the trailing dims of the collectives, Hq, Hkv and D of
flash_decode, B, S_r and D of ulysses_attention, hidden and T_max of an MoE Buffer) or a flag
(deterministic, impl, algorithm, causal, MoE alignment and weights). Every rank must then get
``DitronMismatchError`` naming the op, the field and both ranks' values, before anything is
launched; the program then goes on, and its later calls must pass their checks
(``fuzz.run_program``).

The agreement checks a call's signature once, when the group first sees it: a rank whose
signature was agreed before is not checked again (its documented limit: the peers then time
out in the exchange). So the drawn call carries a *marker*, a value no other call of the
generator draws (a dimension one past its bound in ``fuzz.Sizes``, or MoE alignment 8), in a
field the disagreement leaves alone: both the peers' and the disagreeing rank's signatures are
new, and the outcome is the promised one. The module knows the ops' signatures (field names
and order) as ``runtime.agreement``'s callers define them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from ..attention.flash_decode import HEAD_DIMS  # (ulysses_attention's are the same)
from ..gemm.gemm_rs import ALGORITHMS, IMPLS  # (all_reduce's algorithms are the same)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Rank ``rank`` makes ``variant`` where the others make the program's call ``call``;
    the two differ in ``field`` only, ``values`` = (the others' value, ``rank``'s value), and
    ``op`` is what the error names (``"moe.Buffer"``, ``"moe.dispatch"``, else the op)."""
    rank: int
    call: int
    op: str
    field: str
    values: tuple
    variant: Any


def _det(mode: str) -> bool:
    return mode != "default"


def _flip(mode: str) -> str:
    return "default" if _det(mode) else "deterministic"


def _change(draw, call, fields: dict) -> tuple:
    """Draw one of ``fields`` (name -> (variant args or dtype, (value, variant value)) or
    None where not applicable) and return ``(field, variant call, values)``."""
    names = sorted(f for f, v in fields.items() if v is not None)
    field = draw(st.sampled_from(names))
    change, values = fields[field]
    if field == "dtype":
        return field, dataclasses.replace(call, dtype=change), values
    if field == "deterministic":
        return field, dataclasses.replace(call, mode=change), values
    return field, dataclasses.replace(call, args={**call.args, **change}), values


def _dtype(draw, call, dtypes) -> tuple:
    other = draw(st.sampled_from([d for d in dtypes if d != call.dtype]))
    return other, (call.dtype, other)


def _mode(call) -> tuple:
    return _flip(call.mode), (_det(call.mode), not _det(call.mode))


def draw_mismatch(draw, call, index: int, w: int, dtypes, sz, moe: dict) -> tuple:
    """``(marked call, Mismatch)`` for ``call`` (index ``index``) of a program on ``w`` ranks
    whose MoE Buffers are sized by ``moe``; the marked call replaces ``call`` in the program
    (see the module docstring)."""
    a, op = dict(call.args), call.op
    if op in ("all_gather", "reduce_scatter"):
        a["rest"] = tuple(a["rest"][:1]) + (sz.dim + 1,)  # marker: a trailing dim
        base = dataclasses.replace(call, args=a)
        if op == "all_gather":
            shape = tuple(a["rest"])
            fields = {"x.shape[1:]": (dict(rest=shape[:-1] + (shape[-1] + 1,)),
                                      (shape, shape[:-1] + (shape[-1] + 1,)))}
        else:
            shape = (a["rows"],) + tuple(a["rest"])
            fields = {"x.shape": (dict(rows=a["rows"] + 1), (shape, (a["rows"] + 1,) + shape[1:])),
                      "deterministic": _mode(call)}
    elif op == "all_reduce":
        a["shape"] = tuple(a["shape"][:2]) + (sz.dim + 1,)
        a["algorithm"] = draw(st.sampled_from(ALGORITHMS[1:]))  # explicit: the agreed value
        base, shape = dataclasses.replace(call, args=a), a["shape"]
        other = [x for x in ALGORITHMS[1:] if x != a["algorithm"]][0]
        fields = {"x.shape": (dict(shape=shape[:-1] + (shape[-1] + 1,)),
                              (shape, shape[:-1] + (shape[-1] + 1,))),
                  "algorithm": (dict(algorithm=other), (a["algorithm"], other)),
                  "deterministic": _mode(call)}
    elif op == "all_to_all":
        a["shape"] = tuple(a["shape"]) + (sz.a2a_dim + 1,)  # a trailing dim: scatter/gather stay
        base, shape = dataclasses.replace(call, args=a), a["shape"]
        fields = {"x.shape": (dict(shape=shape[:-1] + (shape[-1] + 1,)),
                              (shape, shape[:-1] + (shape[-1] + 1,)))}
    elif op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        a["n"] = n = sz.gemm_n + 1  # marker: N
        if op == "gemm_ar":
            a["algorithm"] = draw(st.sampled_from(ALGORITHMS))
        base = dataclasses.replace(call, args=a)
        impl = draw(st.sampled_from([i for i in IMPLS if i != a["impl"]]))
        fields = {"N": (dict(n=n + 1), (n, n + 1)), "impl": (dict(impl=impl), (a["impl"], impl))}
        if op == "ag_gemm":
            fields["K"] = (dict(k=a["k"] + 1), (a["k"], a["k"] + 1))
        else:
            fields["deterministic"] = _mode(call)
            if op == "gemm_ar" or a["shard_sizes"] is None:  # shard sizes must sum to M
                fields["M"] = (dict(m=a["m"] + 1), (a["m"], a["m"] + 1))
        if op == "gemm_ar":
            alg = draw(st.sampled_from([x for x in ALGORITHMS if x != a["algorithm"]]))
            fields["algorithm"] = (dict(algorithm=alg), (a["algorithm"], alg))
    elif op == "flash_decode":
        a["b"] = b = sz.fd_b + 1  # marker: B (each rank's kv_lens padded with its first)
        a["lens"] = [lens + lens[:1] * (b - len(lens)) for lens in a["lens"]]
        base, hq, hkv, d = dataclasses.replace(call, args=a), a["hq"], a["hkv"], a["d"]
        divisors = [h for h in range(1, hq + 1) if hq % h == 0 and h != hkv]
        other_hkv = draw(st.sampled_from(divisors)) if divisors else None
        other_d = [x for x in HEAD_DIMS if x != d][0]
        fields = {"Hq": (dict(hq=hq + hkv), (hq, hq + hkv)), "D": (dict(d=other_d), (d, other_d)),
                  "Hkv": (dict(hkv=other_hkv), (hkv, other_hkv)) if divisors else None,
                  "deterministic": _mode(call)}
    elif op == "ulysses_attention":
        a["s_r"] = s_r = sz.uly_s + 1  # marker: S_r
        base, b, d = dataclasses.replace(call, args=a), a["b"], a["d"]
        other_d = [x for x in HEAD_DIMS if x != d][0]
        fields = {"B": (dict(b=b + 1), (b, b + 1)), "S_r": (dict(s_r=s_r + 1), (s_r, s_r + 1)),
                  "D": (dict(d=other_d), (d, other_d)),
                  "causal": (dict(causal=not a["causal"]), (a["causal"], not a["causal"]))}
    elif op == "moe":
        return _draw_moe(draw, call, index, w, dtypes, sz, moe)
    else:
        raise ValueError(op)
    fields["dtype"] = _dtype(draw, base, dtypes)
    field, variant, values = _change(draw, base, fields)
    return base, Mismatch(draw(st.integers(0, w - 1)), index, op, field, values, variant)


def _draw_moe(draw, call, index: int, w: int, dtypes, sz, moe: dict) -> tuple:
    """Either the Buffer disagrees (a Buffer of its own, marked by its hidden size), or the
    dispatch does (marked by ``expert_alignment`` 8; the generator draws 1 and 4)."""
    a = dict(call.args)
    if draw(st.booleans()):
        hidden = max(sz.moe_hidden) + 8
        a.update(fp8=False, buffer=dict(hidden=hidden))  # (fp8 needs hidden % 128 == 0)
        base = dataclasses.replace(call, args=a)
        other = draw(st.sampled_from([d for d in dtypes if d != call.dtype]))
        t_max = moe["max_tokens"]
        fields = {"hidden": (dict(buffer=dict(hidden=hidden + 8)), (hidden, hidden + 8)),
                  "max_tokens_per_rank": (dict(buffer=dict(hidden=hidden, max_tokens=t_max + 1)),
                                          (t_max, t_max + 1)),
                  "dtype": (other, (call.dtype, other))}
        field, variant, values = _change(draw, base, fields)
        return base, Mismatch(draw(st.integers(0, w - 1)), index, "moe.Buffer", field, values,
                              variant)
    a.update(layout="expert_contig", alignment=8)
    base = dataclasses.replace(call, args=a)
    fields = {"expert_alignment": (dict(alignment=16), (8, 16)), "deterministic": _mode(call),
              "topk_weights given": (dict(weights=not a["weights"]),
                                     (a["weights"], not a["weights"]))}
    field, variant, values = _change(draw, base, fields)
    return base, Mismatch(draw(st.integers(0, w - 1)), index, "moe.dispatch", field, values,
                          variant)
