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
from .testing.checks import make_input

Check = Callable[[Group, torch.dtype], tuple]
_checks: dict[str, Check] = {}


def register_check(name: str, check: Check) -> None:
    _checks[name] = check


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
    for i, (name, check) in enumerate(_checks.items()):
        if group.rank == 0:
            _show_progress(i, len(_checks), name)
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
        _show_progress(len(_checks), len(_checks), "done")
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
