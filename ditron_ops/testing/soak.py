"""Soak: 10^4 calls of every op family, cycling through varied shapes, in ONE virtual world.

Usage (``tools/soak.py`` runs ``main``)::

    python tools/soak.py --out soak_out                  # GPU: W = 4, bf16, 10^4 calls
    python tools/soak.py --calls 40 --world-size 2       # CPU: tiny shapes, interpreter

A *cycle* makes every case once, back to back: a case is one call of one op family
(all_gather, reduce_scatter, all_reduce, all_to_all, ag_gemm, gemm_rs, gemm_ar, flash_decode,
ulysses_attention; MoE: a dispatch and its combine, two calls) with its own shapes, impl,
algorithm and mode (``cases``). Every rank runs the same cycles in one ``launch``, so the
workspaces, plans, epochs and signal pads of one group serve every call, and shapes change at
every call (DESIGN.md section 4: "test it with 10^4 consecutive calls of varying shapes").

Checks: each case has ``VARIANTS`` input sets (made once, on first use) and odd and even
cycles use different ones, so a call that returned a stale output (its previous call's, or
another case's) is wrong. The expected outputs of a (case, variant) are computed once, with
``ditron_ops.reference`` (collective; every rank reaches them at the same call) the first time
it is seen; every call is then compared on the device, bitwise where the op promises it
(gathers, all-to-all, the collectives' rank-ordered sums, deterministic gemm_rs / gemm_ar vs
the order-exact sum of our GEMM's products, deterministic flash_decode run to run, the MoE
counts, offsets and identity-expert combine), else within the tiers' relative tolerances; the
wrong calls are counted per case on the device (no host synchronization inside a cycle).

After each cycle every rank synchronizes and meets, and rank 0 records
``torch.cuda.memory_allocated()`` and the cycle's ``max_memory_allocated()`` (peak reset per
cycle). Every (case, variant) has been seen after cycle ``VARIANTS`` (its plans built, its
workspaces grown, its inputs and expectations stored); allocated memory growing after that is
a leak. Exit status 0 when no call was wrong and memory did not grow after that cycle; 1 when
it did; 2 when an op raised. Writes ``<out>/soak_cycles.csv`` (one row per cycle) and
``<out>/soak_summary.json``, and prints the summary.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import _env, reference
from ..attention.flash_decode import flash_decode
from ..attention.ulysses import ulysses_attention
from ..collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from ..gemm._core import matmul
from ..gemm.ag_gemm import ag_gemm
from ..gemm.gemm_rs import gemm_ar, gemm_rs
from ..moe import Buffer, reference as moe_reference
from ..runtime.group import Group
from ..runtime.split import split_sizes
from ..runtime.virtual import launch
from . import moe_checks
from .ag_gemm_checks import REL_TOL as GEMM_TOL
from .ulysses_checks import REL_TOL as ATTENTION_TOL

VARIANTS = 2
"""Input sets per case (cycle c uses set c % VARIANTS): consecutive calls of a case differ."""
FAMILIES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ag_gemm", "gemm_rs",
            "gemm_ar", "flash_decode", "ulysses_attention", "moe")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Case:
    """One entry of the cycle: ``op`` (a family) with parameters ``p``; ``calls`` op calls."""
    name: str
    op: str
    p: dict
    calls: int = 1


def cases(world_size: int, tiny: bool) -> list:
    """The cycle for ``world_size`` ranks: every family, two or three shapes each on a GPU
    (tiles crossed, odd sizes, uneven shards, both modes, every impl and algorithm), one tiny
    shape each in the interpreter (``tiny``)."""
    w = world_size
    if tiny:
        specs = [
            ("all_gather", dict(rows=[3 - r % 2 for r in range(w)], cols=5)),
            ("reduce_scatter", dict(rows=5, cols=3, det=True)),
            ("all_reduce", dict(shape=(7,), algorithm="one_shot", det=True)),
            ("all_reduce", dict(shape=(3, 4), algorithm="two_shot", det=False)),
            ("all_to_all", dict(shape=(2 * w, 3), dims=(0, 1))),
            ("ag_gemm", dict(rows=[3 - r % 2 for r in range(w)], k=8, n=8, impl="fused", bias=True)),
            ("gemm_rs", dict(m=6, k=4, n=8, impl="fused", det=True)),
            ("gemm_ar", dict(m=4, k=4, n=8, impl="fused", algorithm="one_shot", det=False)),
            ("flash_decode", dict(b=2, hq=2, hkv=1, d=64, s_max=5, det=True)),
            ("ulysses_attention", dict(b=1, s_r=2, hq=2 * w, hkv=w, d=64, causal=True)),
            ("moe", dict(tokens=[3 - r % 2 for r in range(w)], layout="expert_contig",
                         alignment=1, det=True, weights=True, routing="random")),
        ]
    else:
        specs = [
            ("all_gather", dict(rows=[256] * w, cols=512)),
            ("all_gather", dict(rows=[64 + 37 * r for r in range(w)], cols=1000)),
            ("all_gather", dict(rows=[1] * w, cols=7)),
            ("reduce_scatter", dict(rows=1024, cols=512, det=True)),
            ("reduce_scatter", dict(rows=333, cols=129, det=False)),
            ("all_reduce", dict(shape=(4096,), algorithm="one_shot", det=True)),
            ("all_reduce", dict(shape=(512, 1024), algorithm="two_shot", det=False)),
            ("all_reduce", dict(shape=(77, 33), algorithm="auto", det=True)),
            ("all_to_all", dict(shape=(64 * w, 256), dims=(0, 1))),
            ("all_to_all", dict(shape=(2, 33 * w, 8, 64), dims=(1, 2))),
            ("ag_gemm", dict(rows=[512] * w, k=1024, n=768, impl="fused", bias=False)),
            ("ag_gemm", dict(rows=[100 + 41 * r for r in range(w)], k=512, n=1000, impl="auto",
                             bias=True)),
            ("ag_gemm", dict(rows=[128] * w, k=256, n=256, impl="baseline", bias=False)),
            ("gemm_rs", dict(m=2048, k=512, n=1024, impl="fused", det=True)),
            ("gemm_rs", dict(m=700, k=300, n=520, impl="fused", det=False)),
            ("gemm_ar", dict(m=256, k=1024, n=1024, impl="fused", algorithm="one_shot", det=True)),
            ("gemm_ar", dict(m=130, k=256, n=700, impl="fused", algorithm="two_shot", det=False)),
            ("flash_decode", dict(b=4, hq=32, hkv=8, d=128, s_max=2048, det=True)),
            ("flash_decode", dict(b=3, hq=8, hkv=2, d=64, s_max=777, det=False)),
            ("ulysses_attention", dict(b=1, s_r=512, hq=4 * w, hkv=w, d=128, causal=True)),
            ("ulysses_attention", dict(b=2, s_r=130, hq=2 * w, hkv=1, d=64, causal=False)),
            ("moe", dict(tokens=[max(0, 256 - 40 * r) for r in range(w)], layout="expert_padded",
                         alignment=1, det=True, weights=True, routing="random")),
            ("moe", dict(tokens=[(50 * r) % 257 for r in range(w)], layout="expert_contig",
                         alignment=16, det=False, weights=False, routing="skewed")),
        ]
    return [Case(f"{op} {_describe(p)}", op, p, 2 if op == "moe" else 1) for op, p in specs]


def moe_config(world_size: int, tiny: bool) -> dict:
    """The one MoE Buffer of the soak (every MoE case shares it, as a model's layers do)."""
    if tiny:
        return dict(num_experts=2 * world_size, max_tokens_per_rank=3, hidden=8, topk=2)
    return dict(num_experts=4 * world_size, max_tokens_per_rank=256, hidden=1024, topk=4)


def _describe(p: dict) -> str:
    """``k=v ...`` of a case's parameters (a per-rank list with one value: that value)."""
    def show(v):
        if isinstance(v, list):
            return str(v[0]) if len(set(v)) == 1 else "/".join(map(str, v))
        return str(v).replace(" ", "")
    return " ".join(f"{k}={show(v)}" for k, v in p.items())


# -- inputs, calls and expectations per family ------------------------------------------------
# inputs(group, case, variant, dtype) -> dict of this rank's tensors (made once per variant)
# call(group, case, inputs, buf) -> (outputs, [(got, want)] compared bitwise on this call)
# expect(group, case, inputs, outputs) -> [(output index, "exact" | "close", want, bound)]

def _rand(shape, dtype, device, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=gen) * scale).to(dtype).to(device)


def _seed(case: Case, variant: int, rank: Optional[int], salt: int = 0) -> int:
    """A seed per (case, variant, rank, salt); ``rank=None``: shared by every rank."""
    base = sum(map(ord, case.name)) * 7919 + variant * 131 + salt * 17
    return base * 64 + (63 if rank is None else rank)


def _inputs(group: Group, case: Case, variant: int, dtype: torch.dtype) -> dict:
    p, r, dev, op = case.p, group.rank, group.device, case.op

    def rand(shape, salt=0, shared=False, scale=1.0):
        return _rand(shape, dtype, dev, _seed(case, variant, None if shared else r, salt), scale)

    if op == "all_gather":
        return dict(x=rand((p["rows"][r], p["cols"])))
    if op == "reduce_scatter":
        return dict(x=rand((p["rows"], p["cols"])))
    if op in ("all_reduce", "all_to_all"):
        return dict(x=rand(p["shape"]))
    if op == "ag_gemm":
        s = p["k"] ** -0.25
        return dict(a=rand((p["rows"][r], p["k"]), scale=s), b=rand((p["k"], p["n"]), 1, True, s),
                    bias=rand((p["n"],), 2, True) if p["bias"] else None)
    if op in ("gemm_rs", "gemm_ar"):
        s = p["k"] ** -0.25
        return dict(a=rand((p["m"], p["k"]), scale=s), b=rand((p["k"], p["n"]), 1, scale=s))
    if op == "flash_decode":
        b, s_max = p["b"], p["s_max"]
        lens = [0 if (i + r) % 5 == 4 else s_max - (97 * (i + r + variant)) % max(1, s_max)
                for i in range(b)]  # a sequence with no keys on some rank, the others uneven
        return dict(q=rand((b, p["hq"], p["d"]), shared=True),
                    k=rand((b, s_max, p["hkv"], p["d"]), 1), v=rand((b, s_max, p["hkv"], p["d"]), 2),
                    lens=torch.tensor(lens, dtype=torch.int32, device=dev))
    if op == "ulysses_attention":
        return {name: rand((p["b"], p["s_r"], h, p["d"]), salt)
                for salt, (name, h) in enumerate((("q", p["hq"]), ("k", p["hkv"]), ("v", p["hkv"])))}
    if op == "moe":
        cfg, count = moe_config(group.world_size, p["_tiny"]), p["tokens"][r]
        seed = _seed(case, variant, None) % 100_000
        idx, w = moe_checks.routing(group, count, cfg["num_experts"], cfg["topk"], p["routing"], seed)
        return dict(x=moe_checks.tokens(group, count, cfg["hidden"], dtype, seed), idx=idx,
                    w=w if p["weights"] else None)
    raise ValueError(op)


def _call(group: Group, case: Case, t: dict, buf: Optional[Buffer]) -> tuple:
    p, op = case.p, case.op
    if op == "all_gather":
        return [all_gather(t["x"], group, shard_sizes=p["rows"])], []
    if op == "reduce_scatter":
        return [reduce_scatter(t["x"], group, deterministic=p["det"])], []
    if op == "all_reduce":
        return [all_reduce(t["x"], group, algorithm=p["algorithm"], deterministic=p["det"])], []
    if op == "all_to_all":
        return [all_to_all(t["x"], *p["dims"], group)], []
    if op == "ag_gemm":
        return [ag_gemm(t["a"], t["b"], group, bias=t["bias"], impl=p["impl"],
                        shard_sizes=p["rows"])], []
    if op == "gemm_rs":
        return [gemm_rs(t["a"], t["b"], group, deterministic=p["det"], impl=p["impl"])], []
    if op == "gemm_ar":
        return [gemm_ar(t["a"], t["b"], group, deterministic=p["det"], impl=p["impl"],
                        algorithm=p["algorithm"])], []
    if op == "flash_decode":
        return [flash_decode(t["q"], t["k"], t["v"], t["lens"], group, deterministic=p["det"])], []
    if op == "ulysses_attention":
        return [ulysses_attention(t["q"], t["k"], t["v"], group, causal=p["causal"])], []
    if op == "moe":
        d = buf.dispatch(t["x"], t["idx"], t["w"], layout=p["layout"],
                         expert_alignment=p["alignment"], deterministic=p["det"])
        out = buf.combine(d.x, d.handle)
        # identity experts: the combine is placement independent, so its expected value comes
        # from this call's ``dest`` (which slots were kept) in either mode
        return [d.counts, d.offsets], [(out, moe_checks.identity_combine(t["x"], d.handle.dest,
                                                                          t["w"]))]
    raise ValueError(op)


def _order_exact(a: torch.Tensor, b: torch.Tensor, group: Group) -> torch.Tensor:
    """``sum_r a_r @ b_r``: our GEMM's fp32 products summed in rank order, rounded once. The
    products come from a batch-invariant tiling (``deterministic=True``), as deterministic
    gemm_rs / gemm_ar's do: default mode's rule may pick a tiling whose bits differ."""
    part = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    if a.shape[1]:
        matmul(a, b, out=part, deterministic=True)
    return reference.rank_ordered_sum(reference.gather_tensors(part, group), a.dtype)


def _close(want: torch.Tensor, bound: torch.Tensor, tol: float) -> tuple:
    scale = bound.max().item() if bound.numel() else 0.0
    return want.float(), tol * max(scale, 1.0)


def _expect(group: Group, case: Case, t: dict, outs: list, buf: Optional[Buffer]) -> list:
    p, op, dtype = case.p, case.op, outs[0].dtype if outs else None
    if op == "all_gather":
        return [(0, "exact", reference.all_gather(t["x"], group), None)]
    if op == "reduce_scatter":  # both modes: rank-ordered fp32 sums, one rounding
        return [(0, "exact", reference.reduce_scatter(t["x"], group), None)]
    if op == "all_reduce":
        return [(0, "exact", reference.all_reduce(t["x"], group), None)]
    if op == "all_to_all":
        return [(0, "exact", reference.all_to_all(t["x"], group, *p["dims"]), None)]
    if op == "ag_gemm":
        full, b = reference.all_gather(t["a"], group).float(), t["b"].float()
        want, bound = full @ b, full.abs() @ b.abs()
        if t["bias"] is not None:
            want, bound = want + t["bias"].float(), bound + t["bias"].float().abs()
        return [(0, "close", *_close(want, bound, GEMM_TOL[dtype]))]
    if op in ("gemm_rs", "gemm_ar"):
        rows = slice(None)
        if op == "gemm_rs":
            sizes = split_sizes(p["m"], group.world_size)
            start = sum(sizes[:group.rank])
            rows = slice(start, start + sizes[group.rank])
        if p["det"]:
            return [(0, "exact", _order_exact(t["a"], t["b"], group)[rows], None)]
        a, b = t["a"].float(), t["b"].float()
        want = reference.all_reduce(a @ b, group)[rows]
        bound = reference.all_reduce(a.abs() @ b.abs(), group)[rows]
        return [(0, "close", *_close(want, bound, GEMM_TOL[dtype]))]
    if op == "flash_decode":
        want = reference.flash_decode(t["q"], t["k"], t["v"], t["lens"], group).float()
        checks = [(0, "close", *_close(want, want.abs(), ATTENTION_TOL[dtype]))]
        if p["det"]:  # deterministic: every later call bit for bit this one
            checks.append((0, "exact", outs[0].clone(), None))
        return checks
    if op == "ulysses_attention":
        want = reference.ulysses_attention(t["q"], t["k"], t["v"], group, causal=p["causal"])
        return [(0, "close", *_close(want.float(), want.float().abs(), ATTENTION_TOL[dtype]))]
    if op == "moe":
        want = moe_reference.dispatch_reference(
            t["x"], t["idx"], t["w"], group, num_experts=buf.num_experts,
            max_tokens=buf.max_tokens, layout=p["layout"], expert_alignment=p["alignment"],
            capacity=buf.capacity)
        return [(0, "exact", want["counts"], None), (1, "exact", want["offsets"], None)]
    raise ValueError(op)


def _bad(got: torch.Tensor, kind: str, want: torch.Tensor, bound) -> torch.Tensor:
    """A 0-dim bool tensor on the device: ``got`` is wrong (no host synchronization)."""
    if tuple(got.shape) != tuple(want.shape) or (kind == "exact" and got.dtype != want.dtype):
        return torch.ones((), dtype=torch.bool, device=got.device)
    if kind == "exact":
        return (got != want).any()
    return ((got.float() - want).abs() > bound).any()


# -- the run ----------------------------------------------------------------------------------

def _record_memory(group: Group, high: int) -> tuple:
    """(allocated, this cycle's peak) bytes on the device, read by rank 0 while every rank
    waits (their tensors of the cycle are freed); (0, 0) on a CPU. A value above ``high``
    (the most allocated so far) is read again after Python's cycle collector ran: garbage it
    frees is no leak, only late (it runs on object counts, not bytes); collecting only then
    keeps its cost out of most cycles."""
    if group.device.type != "cuda":
        return 0, 0
    allocated = torch.cuda.memory_allocated(group.device)
    if allocated > high:
        gc.collect()
        allocated = torch.cuda.memory_allocated(group.device)
    peak = torch.cuda.max_memory_allocated(group.device)
    torch.cuda.reset_peak_memory_stats(group.device)
    return allocated, peak


def _soak(group: Group, todo: list, cycles: int, dtype: torch.dtype, tiny: bool) -> dict:
    """One rank's soak: ``cycles`` cycles of ``todo``; per cycle its wrong counts so far (and
    on rank 0 the memory)."""
    needs_moe = any(c.op == "moe" for c in todo)
    buf = Buffer(group, dtype=dtype, **moe_config(group.world_size, tiny)) if needs_moe else None
    inputs, expects = {}, {}
    wrong = torch.zeros(len(todo), dtype=torch.int64, device=group.device)
    log, busy = [], 0.0  # busy: seconds in the cycles, not in the memory records between them
    group.synchronize()
    group.barrier()
    for cycle in range(cycles):
        start = time.perf_counter()
        variant = cycle % VARIANTS
        for ci, case in enumerate(todo):
            key = (ci, variant)
            if key not in inputs:
                inputs[key] = _inputs(group, case, variant, dtype)
            outs, live = _call(group, case, inputs[key], buf)
            if key not in expects:  # first sight: the collective references (every rank here)
                expects[key] = _expect(group, case, inputs[key], outs, buf)
            for index, kind, want, bound in expects[key]:
                wrong[ci] += _bad(outs[index], kind, want, bound)
            for got, want in live:
                wrong[ci] += _bad(got, "exact", want, None)
            del outs, live
        group.synchronize()
        if buf is not None:
            buf.check()  # an error the dispatch recorded on the device (overflow, bad ids)
        group.barrier()
        busy += time.perf_counter() - start
        high = max([row["allocated"] for row in log], default=0)
        allocated, peak = _record_memory(group, high) if group.rank == 0 else (0, 0)
        log.append(dict(seconds=busy, allocated=allocated, peak=peak, wrong=wrong.tolist()))
        group.barrier()  # rank 0 read the memory with every rank's cycle done
    if buf is not None:
        buf.close()
    return dict(log=log)


def analyze(allocated: Sequence[int], seen: int) -> tuple:
    """``(last_growth, grew_after_seen)`` of per-cycle allocated bytes (cycle 1 first): the
    last cycle whose value exceeds every earlier one (1 when none does), and whether that
    cycle comes after ``seen``, the cycle by which every shape was seen."""
    last, high = 1, None
    for cycle, value in enumerate(allocated, 1):
        if high is not None and value > high:
            last = cycle
        high = value if high is None else max(high, value)
    return last, last > seen


def run(world_size: int, calls: int, dtype: torch.dtype, tiny: bool, device: str,
        only: Sequence[str] = (), timeout_s: Optional[float] = None) -> dict:
    """Run the soak and return its summary (``main`` writes and prints it)."""
    todo = [c for c in cases(world_size, tiny) if not only or c.op in only]
    todo = [dataclasses.replace(c, p={**c.p, "_tiny": tiny}) if c.op == "moe" else c for c in todo]
    per_cycle = sum(c.calls for c in todo)
    cycles = max(VARIANTS + 1, math.ceil(calls / per_cycle))  # at least one cycle after seen
    t0 = time.perf_counter()
    ranks = launch(_soak, world_size, device=device, args=(todo, cycles, dtype, tiny),
                   timeout_s=timeout_s)
    wall = time.perf_counter() - t0
    log = ranks[0]["log"]
    wrong_per_cycle = [sum(sum(r["log"][c]["wrong"]) for r in ranks) for c in range(cycles)]
    by_case = [sum(r["log"][-1]["wrong"][i] for r in ranks) for i in range(len(todo))]
    allocated = [row["allocated"] for row in log]
    measured = any(allocated)  # (a CPU records zeros)
    last_growth, grew = analyze(allocated, VARIANTS) if measured else (None, False)
    steady = log[-1]["seconds"] - log[VARIANTS - 1]["seconds"]
    peaks = [row["peak"] for row in log]
    return dict(
        world_size=world_size, dtype=str(dtype).replace("torch.", ""), tiny=tiny,
        families=sorted({c.op for c in todo}), cases=[c.name for c in todo],
        calls_per_cycle=per_cycle, cycles=cycles, calls=cycles * per_cycle,
        seen_after_cycle=VARIANTS, wall_s=round(wall, 3), busy_s=round(log[-1]["seconds"], 3),
        calls_per_s=round(cycles * per_cycle / log[-1]["seconds"], 1),
        steady_calls_per_s=round((cycles - VARIANTS) * per_cycle / steady, 1) if steady > 0 else None,
        wrong=wrong_per_cycle[-1], wrong_by_case={todo[i].name: n for i, n in enumerate(by_case) if n},
        memory_measured=measured,
        high_water_bytes=max(peaks), high_water_cycle=peaks.index(max(peaks)) + 1,
        allocated_first_bytes=allocated[0], allocated_last_bytes=allocated[-1],
        allocated_max_bytes=max(allocated), memory_stops_growing_after_cycle=last_growth,
        memory_grew_after_seen=grew,
        cycle_rows=[dict(cycle=i + 1, calls=(i + 1) * per_cycle, seconds=round(row["seconds"], 4),
                         allocated_bytes=row["allocated"], cycle_peak_bytes=row["peak"],
                         wrong=wrong_per_cycle[i]) for i, row in enumerate(log)])


def _write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = summary["cycle_rows"]
    with open(out / "soak_cycles.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(out / "soak_summary.json", "w") as fh:
        json.dump({k: v for k, v in summary.items() if k != "cycle_rows"}, fh, indent=1)


def _print(summary: dict, out: Path) -> None:
    mib = 1 / 2**20
    s = summary
    print(f"soak: W={s['world_size']} {s['dtype']}{' (tiny shapes)' if s['tiny'] else ''}, "
          f"{len(s['cases'])} cases of {len(s['families'])} families, {s['calls_per_cycle']} calls "
          f"per cycle, {s['cycles']} cycles = {s['calls']} calls per rank in {s['busy_s']:.1f} s "
          f"({s['wall_s']:.1f} s with start-up and the memory records)")
    print(f"  calls/s: {s['calls_per_s']} overall, {s['steady_calls_per_s']} after cycle "
          f"{s['seen_after_cycle']} (every shape seen)")
    print(f"  wrong results: {s['wrong']}" + "".join(f"\n    {name}: {n}" for name, n in
                                                     s["wrong_by_case"].items()))
    if s["memory_measured"]:
        print(f"  memory: high-water {s['high_water_bytes'] * mib:.1f} MiB (cycle "
              f"{s['high_water_cycle']}); allocated {s['allocated_first_bytes'] * mib:.1f} MiB "
              f"after cycle 1, {s['allocated_last_bytes'] * mib:.1f} MiB at the end, max "
              f"{s['allocated_max_bytes'] * mib:.1f} MiB; stops growing after cycle "
              f"{s['memory_stops_growing_after_cycle']}"
              f"{' -- GREW after every shape was seen' if s['memory_grew_after_seen'] else ''}")
    else:
        print("  memory: not measured (CPU)")
    print(f"  wrote {out / 'soak_cycles.csv'} and {out / 'soak_summary.json'}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The CLI (``tools/soak.py``); returns the exit status (0 pass, 1 fail, 2 error)."""
    parser = argparse.ArgumentParser(prog="tools/soak.py", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000,
                        help="calls per rank, rounded up to whole cycles (default 10000)")
    parser.add_argument("--world-size", type=int, default=4, help="virtual ranks (default 4)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the default on a CPU)")
    parser.add_argument("--only", default="", help=f"comma list of families ({','.join(FAMILIES)})")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="bound of every wait (default DITRON_TIMEOUT_S or 10 s)")
    parser.add_argument("--out", type=Path, default=Path("soak_out"),
                        help="folder for soak_cycles.csv and soak_summary.json")
    parser.add_argument("--commit", default=None, help="commit to record (default: git)")
    args = parser.parse_args(argv)
    _env.prepare_cuda_for_virtual_ranks()
    gpu = torch.cuda.is_available() and not _env.use_interpreter()
    device = "cuda" if gpu else "cpu"
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    if dtype == torch.bfloat16 and not gpu:
        parser.error("--dtype bf16 needs a GPU (the interpreter's bf16 arithmetic is wrong)")
    only = tuple(s for s in args.only.split(",") if s)
    unknown = set(only) - set(FAMILIES)
    if unknown or args.world_size < 1 or args.calls < 1:
        parser.error(f"unknown families {sorted(unknown)}" if unknown else
                     "--world-size and --calls must be positive")
    from ..bench import harness  # (machine and commit columns, as the benches write them)

    harness.COMMIT = args.commit or harness.COMMIT
    try:
        summary = run(args.world_size, args.calls, dtype, args.tiny or not gpu, device, only,
                      args.timeout_s)
    except Exception as exc:  # noqa: BLE001 - an op raised: report it, exit 2
        args.out.mkdir(parents=True, exist_ok=True)
        error = f"{type(exc).__name__}: {exc}"
        (args.out / "soak_summary.json").write_text(json.dumps(dict(error=error), indent=1))
        print(f"soak: an op raised: {error}", file=sys.stderr)
        return 2
    summary["machine"] = harness.machine_info(torch.device(device))
    _write(summary, args.out)
    _print(summary, args.out)
    failed = summary["wrong"] > 0 or summary["memory_grew_after_seen"]
    print("soak: FAIL" if failed else "soak: PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
