"""Self-check of every registered op on a virtual world (``python -m ditron_ops``).

Each op family registers ``check(group, dtype) -> (ours, reference, run_ours[, rel_tol])`` with
``register_check``; the self-check compares (bitwise when ``rel_tol`` is absent, else
``max|ours - ref| <= rel_tol * max|ref|``), then times ``run_ours`` (median of a few calls, max
over ranks) and prints one row per op.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch

from . import reference
from .collectives import all_gather, all_reduce, reduce_scatter
from .runtime.group import Group
from .testing.checks import make_input, paged_cache

Check = Callable[[Group, torch.dtype], tuple]
_checks: dict[str, Check] = {}
_needs_symmetric: set[str] = set()


def register_check(name: str, check: Check, needs_symmetric: bool = False) -> None:
    """Register ``check``; ``needs_symmetric``: run only on groups with symmetric memory (a
    ``moe.Buffer``; a torch-backend group has no such path)."""
    _checks[name] = check
    if needs_symmetric:
        _needs_symmetric.add(name)


def _collective_checks() -> None:
    def inp(group, dtype, rows=None, cols=None):
        gpu = group.device.type == "cuda"  # the interpreter is slow: small odd sizes on CPU
        rows = rows if rows is not None else (4099 if gpu else 67)
        cols = cols if cols is not None else (1001 if gpu else 33)
        return make_input((rows, cols), dtype, group.device, group.rank)

    def ag(group, dtype):
        x = inp(group, dtype)
        return all_gather(x, group), reference.all_gather(x, group), lambda: all_gather(x, group)

    def ag_uneven(group, dtype):
        sizes = [(1000 if group.device.type == "cuda" else 10) + 37 * q for q in range(group.world_size)]
        x = inp(group, dtype, rows=sizes[group.rank])
        run = lambda: all_gather(x, group, shard_sizes=sizes)  # noqa: E731
        return run(), reference.all_gather(x, group), run

    def rs(group, dtype):
        x = inp(group, dtype)
        return reduce_scatter(x, group), reference.reduce_scatter(x, group), lambda: reduce_scatter(x, group)

    def ar(algorithm):
        def check(group, dtype):
            x = inp(group, dtype)
            run = lambda: all_reduce(x, group, algorithm=algorithm)  # noqa: E731
            return run(), reference.all_reduce(x, group), run
        return check

    register_check("all_gather", ag)
    register_check("all_gather (uneven)", ag_uneven)
    register_check("reduce_scatter", rs)
    register_check("all_reduce one_shot", ar("one_shot"))
    register_check("all_reduce two_shot", ar("two_shot"))


_collective_checks()


def _ag_gemm_check(group: Group, dtype: torch.dtype) -> tuple:
    from .gemm.ag_gemm import ag_gemm
    from .testing.ag_gemm_checks import REL_TOL, ag_gemm_inputs

    gpu = group.device.type == "cuda"
    sizes = [(1024 if gpu else 10) + (37 if gpu else 3) * q for q in range(group.world_size)]
    n, k = (1792, 4096) if gpu else (21, 19)  # GPU: LLaMA-3.1-8B layer, N / 8
    a, b, bias = ag_gemm_inputs(group, sizes, n, k, dtype, weight_layout=True)
    run = lambda: ag_gemm(a, b, group, bias=bias, impl="fused", shard_sizes=sizes)  # noqa: E731
    full = reference.all_gather(a, group, sizes)
    ref = (full.float() @ b.float() + bias.float()).to(dtype)
    return run(), ref, run, REL_TOL[dtype]


register_check("ag_gemm", _ag_gemm_check)


def _gemm_reduce_check(op: str, algorithm: str = "auto"):
    def check(group: Group, dtype: torch.dtype) -> tuple:
        from .gemm.gemm_rs import gemm_ar, gemm_rs
        from .runtime.split import split_sizes
        from .testing.gemm_rs_checks import gemm_rs_inputs, order_exact

        gpu = group.device.type == "cuda"
        m, n, k = (4096, 4096, 1792) if gpu else (13, 11, 9)  # GPU: LLaMA-3.1-8B GEMM-RS, N / 8
        a, b = gemm_rs_inputs(group, m, n, k, dtype)
        if op == "gemm_rs":
            run = lambda: gemm_rs(a, b, group, deterministic=True)  # noqa: E731
            start = sum(split_sizes(m, group.world_size)[:group.rank])
            want = order_exact(a, b, group)[start:start + split_sizes(m, group.world_size)[group.rank]]
        else:
            run = lambda: gemm_ar(a, b, group, deterministic=True, algorithm=algorithm)  # noqa: E731
            want = order_exact(a, b, group)
        return run(), want, run
    return check


def _flash_decode_check(group: Group, dtype: torch.dtype) -> tuple:
    from .attention.flash_decode import flash_decode
    from .reference import flash_decode as reference_decode

    gpu = group.device.type == "cuda"
    b, hq, hkv, d, s_max = (4, 32, 8, 128, 4096) if gpu else (2, 4, 2, 64, 40)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, d, generator=gen).to(dtype=dtype, device=group.device)
    gen = torch.Generator().manual_seed(1 + group.rank)
    k = torch.randn(b, s_max, hkv, d, generator=gen).to(dtype=dtype, device=group.device)
    v = torch.randn(b, s_max, hkv, d, generator=gen).to(dtype=dtype, device=group.device)
    # valid lengths in [0, S_max] at any world size (0 on some ranks)
    lens = torch.tensor([(s_max - 13 * (i + group.rank)) % (s_max + 1) * ((i + group.rank) % 3 != 2)
                         for i in range(b)], dtype=torch.int32, device=group.device)
    run = lambda: flash_decode(q, k, v, lens, group, deterministic=True)  # noqa: E731
    tol = 2e-2 if gpu else 1e-5 if dtype == torch.float32 else 2e-3  # the output's rounding
    return run(), reference_decode(q, k, v, lens, group), run, tol


register_check("flash_decode", _flash_decode_check)


def _paged_decode_check(group: Group, dtype: torch.dtype) -> tuple:
    """The paged cache (pages shuffled over the cache) in deterministic mode: bitwise the
    contiguous call over the same keys."""
    from .attention.flash_decode import flash_decode

    gpu = group.device.type == "cuda"
    b, hq, hkv, d, s_max, page = (4, 32, 8, 128, 4096, 16) if gpu else (2, 4, 2, 64, 40, 16)
    dev = group.device
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, d, generator=gen).to(dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(1 + group.rank)
    k, v = (torch.randn(b, s_max, hkv, d, generator=gen).to(dtype=dtype, device=dev)
            for _ in range(2))
    k_pages, v_pages, table = paged_cache(k, v, page, gen)
    lens = torch.tensor([(s_max - 11 * (i + group.rank)) % (s_max + 1) for i in range(b)],
                        dtype=torch.int32, device=dev)
    run = lambda: flash_decode(q, k_pages, v_pages, lens, group, deterministic=True,  # noqa: E731
                               block_table=table)
    return run(), flash_decode(q, k, v, lens, group, deterministic=True), run


register_check("flash_decode paged", _paged_decode_check)


def _norm_check(group: Group, dtype: torch.dtype) -> tuple:
    """``all_reduce_rmsnorm`` (deterministic) against the fp32 reference: rank-ordered sum
    rounded once, residual add, RMSNorm."""
    from .collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
    from .reference.norm import all_reduce_rmsnorm as reference_norm

    gpu = group.device.type == "cuda"
    t, h = (32, 4096) if gpu else (5, 64)
    x = make_input((t, h), dtype, group.device, 10 + group.rank)
    residual = make_input((t, h), dtype, group.device, 3)
    weight = make_input((h,), dtype, group.device, 4)
    run = lambda: all_reduce_rmsnorm(x, residual, weight, group=group,  # noqa: E731
                                     deterministic=True)[0]
    want = reference_norm(x, residual, weight, 1e-6, group, deterministic=True)[0]
    return run(), want, run, 2e-2 if dtype == torch.bfloat16 else 4e-3


register_check("all_reduce_rmsnorm", _norm_check)


def _scaled_check(op: str):
    """fp8 e4m3 operands with row-wise scales (``out_dtype`` fp16 in the interpreter) against
    the float64 product of the dequantized operands; ``gemm_rs_scaled`` deterministic."""
    def check(group: Group, dtype: torch.dtype) -> tuple:
        from .gemm.scaled import ag_gemm_scaled, gemm_rs_scaled
        from .runtime.split import split_sizes
        from .testing.scaled_checks import (dequantized, reduce_inputs, reduce_operands,
                                             scaled_inputs)

        gpu, w, r = group.device.type == "cuda", group.world_size, group.rank
        out_dtype = torch.bfloat16 if gpu else torch.float16
        m, n, k = (1024, 1792, 4096) if gpu else (8, 24, 48)
        if op == "ag_gemm_scaled":
            a_list, sa_list, b, sb = scaled_inputs([m] * w, k, n, "row", group.device)
            run = lambda: ag_gemm_scaled(a_list[r], b, sa_list[r], sb, group,  # noqa: E731
                                         out_dtype=out_dtype, impl="fused")
            a64, b64 = dequantized(a_list, sa_list, b, sb, "row")
        else:
            parts = reduce_inputs(m * w, [k] * w, n, "row", group.device)
            a, sa, b, sb = parts[r]
            run = lambda: gemm_rs_scaled(a, b, sa, sb, group, out_dtype=out_dtype,  # noqa: E731
                                         deterministic=True, impl="fused")
            rows = split_sizes(m * w, w)
            a64, b64 = reduce_operands(parts, "row", slice(sum(rows[:r]), sum(rows[:r + 1])))
        return run(), (a64 @ b64).to(group.device), run, 1e-2
    return check


register_check("ag_gemm_scaled (e4m3)", _scaled_check("ag_gemm_scaled"))
register_check("gemm_rs_scaled (e4m3)", _scaled_check("gemm_rs_scaled"))


def _moe_check(group: Group, dtype: torch.dtype) -> tuple:
    """``moe.Buffer`` dispatch (deterministic) and combine through identity experts: bitwise
    the fp32 top-k weighted sum of each token's kept slots, rounded once. The Buffer stays open
    for the timed calls (the world's end frees it)."""
    from .moe import Buffer
    from .testing.moe_checks import identity_combine, routing, tokens

    gpu = group.device.type == "cuda"
    t, h, e, k = (512, 4096, 64, 8) if gpu else (6, 128, 8, 2)
    x = tokens(group, t, h, dtype, seed=0)
    idx, w = routing(group, t, e, k, "random", seed=0)
    buf = Buffer(group, num_experts=e, max_tokens_per_rank=t, hidden=h, topk=k, dtype=dtype)

    def run():
        d = buf.dispatch(x, idx, w, layout="expert_contig", deterministic=True)
        return buf.combine(d.x, d.handle)
    return run(), identity_combine(x, idx, w), run


register_check("moe dispatch + combine", _moe_check, needs_symmetric=True)


def _ulysses_check(group: Group, dtype: torch.dtype) -> tuple:
    from .attention.ulysses import ulysses_attention

    w, gpu = group.world_size, group.device.type == "cuda"
    s_r, hq, hkv, d = (1024, 8 * w, 2 * w, 128) if gpu else (7, 2 * w, w, 64)
    full = [make_input((1, s_r * w, h, d), dtype, group.device, seed)
            for seed, h in ((1, hq), (2, hkv), (3, hkv))]  # the same on every rank
    start = group.rank * s_r
    q, k, v = (x[:, start:start + s_r].contiguous() for x in full)
    run = lambda: ulysses_attention(q, k, v, group, causal=True)  # noqa: E731
    want = reference.attention(*full, causal=True)[:, start:start + s_r]
    return run(), want, run, 2e-2 if dtype == torch.bfloat16 else 4e-3


register_check("ulysses_attention", _ulysses_check)
register_check("gemm_rs (determ.)", _gemm_reduce_check("gemm_rs"))
register_check("gemm_ar one_shot", _gemm_reduce_check("gemm_ar", "one_shot"))
register_check("gemm_ar two_shot", _gemm_reduce_check("gemm_ar", "two_shot"))


def _time_us(group: Group, run: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        group.barrier()
        if group.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        run()
        if group.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_checks(group: Group, dtype: torch.dtype, reps: int) -> list[tuple[str, float, float, bool]]:
    """Per registered op: (name, max abs error, median time in µs (max over ranks), ok)."""
    rows = []
    checks = {name: check for name, check in _checks.items()
              if name not in _needs_symmetric or group.has_symmetric_memory}
    for i, (name, check) in enumerate(checks.items()):
        if group.rank == 0:
            _show_progress(i, len(checks), name)
        ours, ref, run, *tol = check(group, dtype)
        if group.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        err = (ours.float() - ref.float()).abs().max().item() if ours.numel() else 0.0
        if tol:
            scale = ref.float().abs().max().item() if ref.numel() else 0.0
            exact = err <= tol[0] * max(scale, 1e-6)
        else:
            exact = bool(torch.equal(ours, ref))
        t = max(group.all_gather_object(_time_us(group, run, reps)))
        err = max(group.all_gather_object(err))
        exact = all(group.all_gather_object(exact))
        rows.append((name, err, t, exact))
    if group.rank == 0:
        _show_progress(len(checks), len(checks), "done")
    group.synchronize()
    return rows


def _show_progress(done: int, total: int, name: str, out=None) -> None:
    """``[###---] done/total name`` on stderr: redrawn in place on a terminal, a line per
    check elsewhere."""
    out = sys.stderr if out is None else out
    bar = "#" * done + "-" * (total - done)
    text = f"ditron self-check [{bar}] {done}/{total} {name}"
    if getattr(out, "isatty", lambda: False)():
        out.write("\r" + text.ljust(79) + ("\n" if done == total else ""))
    else:
        out.write(text + "\n")
    out.flush()
