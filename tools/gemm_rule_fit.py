"""Fit and check the GEMM core's tile rule (``gemm._core_configs.select_config``) on measured data.

Reads the H200 CSVs that every candidate configuration was measured in (ratio = cuBLAS time /
ours, higher is better):

* ``benchmarks/results/gemm_configs-bf16-cuda.csv`` (``bench gemm_sweep --only configs``): 9
  configurations on the 48 seeded sweep shapes, bf16 out; the default mode's rule is scored here;
* ``benchmarks/results/invariant_configs-bf16-cuda.csv`` (``tools/invariant_configs.py``): 8
  M-side tilings of the fp32-out GEMM at M 1-1024 on the six GEMM-RS model shapes; the
  deterministic mode's rule is scored here.

and prints, for the rule as committed (or with ``--set name=value`` overrides): its geo-mean
against the current configuration (128x256x64/s4/tail everywhere) and against the oracle (the
best measured configuration per shape), per M on the invariant data, the worst shapes, where it
loses most to the oracle, and how far each constant can move before a choice on the data
changes (``--scan``). A choice that has no measurement (a candidate the CSV lacks for that shape)
is reported, never guessed.

Usage (CPU is enough)::

    PYTHONPATH=. python tools/gemm_rule_fit.py [--scan] [--set 64x128x64/s6=0.5 --set half=0.7]
"""
from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import math
import os
import sys

import torch

from ditron_ops.gemm import _core_configs as rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_CSV = os.path.join(ROOT, "benchmarks", "results", "gemm_configs-bf16-cuda.csv")
INVARIANT_CSV = os.path.join(ROOT, "benchmarks", "results", "invariant_configs-bf16-cuda.csv")
SMS = 132
"""The H200's SMs (the program budget of a one-rank call)."""
CURRENT = rules.GPU_CONFIG
INVARIANT_NAMES = {"current": CURRENT, "64x256/s4": "64x256x64/s4", "64x128/s6": "64x128x64/s6",
                   "128x128/s4": "128x128x64/s4 (w8)", "64x64/s8": "64x64x64/s8",
                   "64x64/s6": "64x64x64/s6", "64x32/s8": "64x32x64/s8", "128x64/s6": "128x64x64/s6"}
"""The invariant CSV's names as candidate names (its 128x128 is 8 warps, 4 stages: not the
rule's 128x128x64/s5/w4, which deterministic mode does not pick)."""
CUDA = torch.device("cuda")  # only its type reaches the rule: no GPU needed


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def load(path: str, case: str | None, name_col: str, names=None) -> dict:
    """``{(m, n, k): {config name: ratio}}``."""
    data: dict = collections.defaultdict(dict)
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if case is not None and row.get("case") != case:
                continue
            name = row[name_col] if names is None else names.get(row[name_col], row[name_col])
            data[(int(row["m"]), int(row["n"]), int(row["k"]))][name] = float(row["ratio"])
    return data


def choose(data: dict, deterministic: bool) -> dict:
    """``{shape: (chosen candidate name, its measured ratio or None)}``."""
    out = {}
    for (m, n, k), measured in data.items():
        name = rules.select(m, n, SMS, CUDA, deterministic=deterministic).name
        out[(m, n, k)] = (name, measured.get(name))
    return out


def fallback(shape: tuple, measured: dict, deterministic: bool) -> tuple[str, float]:
    """The model's best candidate that was measured on ``shape`` (the rule's choice when that
    one has a measurement): what an unmeasured choice is at least worth if it is no slower than
    the model's next choice."""
    m, n, _ = shape
    cands = rules.candidates(CUDA, deterministic)
    if m <= max(c.cfg.block_m for c in cands):
        cands = tuple(c for c in cands if c.cfg.block_m == min(d.cfg.block_m for d in cands))
    ranked = sorted(cands, key=lambda c: rules.predicted_time(c, m, n, SMS))
    name = next(c.name for c in ranked if c.name in measured)
    return name, measured[name]


def score(data: dict, deterministic: bool) -> tuple[float, int]:
    """Geo-mean of the rule's measured choices, and how many choices had no measurement."""
    picks = choose(data, deterministic).values()
    return geo(r for _, r in picks if r is not None), sum(r is None for _, r in picks)


def apply(overrides: dict) -> None:
    """Set candidate efficiencies (``name=value``) and ``half`` (``HALF_TILE_COST``)."""
    cands = []
    for c in rules.GPU_CANDIDATES:
        value = overrides.get(c.name)
        cands.append(c if value is None else dataclasses.replace(c, efficiency=value))
    rules.GPU_CANDIDATES = tuple(cands)
    if "half" in overrides:
        rules.HALF_TILE_COST = overrides["half"]


def _time(name: str, shape: tuple) -> float:
    c = next(c for c in rules.GPU_CANDIDATES if c.name == name)
    return rules.predicted_time(c, shape[0], shape[1], SMS)


def report(sweep: dict, inv: dict) -> None:
    print("constants: " + ", ".join(f"{c.name} {c.efficiency}" for c in rules.GPU_CANDIDATES)
          + f", half tile {rules.HALF_TILE_COST}")
    # default mode on the sweep
    picks = choose(sweep, False)
    got = [r for _, r in picks.values() if r is not None]
    cur = [m[CURRENT] for m in sweep.values()]
    oracle = [max(m.values()) for m in sweep.values()]
    cand_names = [c.name for c in rules.GPU_CANDIDATES]
    best_cands = [max((m[c] for c in cand_names if c in m), default=float("nan"))
                  for m in sweep.values()]
    missing = [s for s, (_, r) in picks.items() if r is None]
    print(f"\nsweep (bf16, {len(sweep)} shapes, default mode): rule {geo(got):.4f}  current "
          f"{geo(cur):.4f}  oracle of the {len(next(iter(sweep.values())))} measured "
          f"{geo(oracle):.4f}  oracle of the measured candidates {geo(best_cands):.4f}"
          + (f"  ({len(missing)} choices unmeasured: {missing})" if missing else ""))
    if missing:
        filled = [r if r is not None else fallback(s, sweep[s], False)[1]
                  for s, (_, r) in picks.items()]
        nexts = ", ".join(sorted({fallback(s, sweep[s], False)[0] for s in missing}))
        print(f"  all {len(sweep)} shapes, an unmeasured choice counted at the model's next "
              f"measured one ({nexts}): "
              f"{geo(filled):.4f}; current on the same {len(got)} measured: "
              f"{geo(sweep[s][CURRENT] for s, (_, r) in picks.items() if r is not None):.4f}")
        print("  unmeasured choices (model time, theirs / next measured's): " + ", ".join(
            f"{s[0]}x{s[1]}x{s[2]} {picks[s][0]} "
            f"{_time(picks[s][0], s) / _time(fallback(s, sweep[s], False)[0], s):.2f} "
            f"(next {fallback(s, sweep[s], False)[0]} at {fallback(s, sweep[s], False)[1]:.3f})"
            for s in missing))
    counts = collections.Counter(name for name, _ in picks.values())
    print("  choices: " + ", ".join(f"{n} x{c}" for n, c in counts.most_common()))
    rows = sorted(((r, s, n) for s, (n, r) in picks.items() if r is not None))
    print("  worst five: " + ", ".join(f"{s[0]}x{s[1]}x{s[2]} {r:.3f} ({n})"
                                       for r, s, n in rows[:5]))
    gaps = sorted(((max(sweep[s].values()) / r, s, n) for s, (n, r) in picks.items() if r),
                  reverse=True)[:5]
    print("  most below the oracle: " + ", ".join(
        f"{s[0]}x{s[1]}x{s[2]} {sweep[s][n]:.3f} vs {max(sweep[s].values()):.3f} "
        f"({max(sweep[s], key=sweep[s].get)})" for _, s, n in gaps))
    changed = sorted(((picks[s][1] / sweep[s][CURRENT], s, picks[s][0]) for s in sweep
                      if picks[s][0] != CURRENT and picks[s][1]), reverse=True)
    print("  changed from the current: " + ", ".join(
        f"{s[0]}x{s[1]}x{s[2]} {sweep[s][CURRENT]:.3f}->{sweep[s][n]:.3f} ({n})"
        for _, s, n in changed))
    # deterministic mode on the invariant data
    print(f"\ninvariant GEMM (fp32 out, {len(inv)} shapes, deterministic mode): per M, rule / "
          "current / oracle of the 8 measured (choices)")
    picks = choose(inv, True)
    by_m = collections.defaultdict(list)
    for s in inv:
        by_m[s[0]].append(s)
    for m in sorted(by_m):
        shapes = by_m[m]
        rule = geo(picks[s][1] for s in shapes if picks[s][1] is not None)
        print(f"  M={m:5d}: {rule:.3f} / {geo(inv[s][CURRENT] for s in shapes):.3f} / "
              f"{geo(max(inv[s].values()) for s in shapes):.3f}  ("
              + ", ".join(f"N={s[1]}: {picks[s][0]}" for s in shapes) + ")")
    got = [r for _, r in picks.values() if r is not None]
    missing = [s for s, (_, r) in picks.items() if r is None]
    print(f"  all M: rule {geo(got):.4f}  current {geo(m[CURRENT] for m in inv.values()):.4f}  "
          f"oracle {geo(max(m.values()) for m in inv.values()):.4f}"
          + (f"  ({len(missing)} choices unmeasured)" if missing else ""))
    five = [s for s in inv if s[0] in (1, 16, 128, 1024)]
    print(f"  the issue's M in {{1, 16, 128, 1024}} (8192 not in this data): rule "
          f"{geo(picks[s][1] for s in five if picks[s][1]):.4f}")


def scan(sweep: dict, inv: dict) -> None:
    """Each constant alone over a range: the interval where both scores stay at the committed
    constants' values (the choices on the data do not change)."""
    base = {c.name: c.efficiency for c in rules.GPU_CANDIDATES if c.name != CURRENT}
    base["half"] = rules.HALF_TILE_COST
    ref = (score(sweep, False), score(inv, True))
    print("\nscan (one constant at a time; the interval keeps both scores at "
          f"{ref[0][0]:.4f} / {ref[1][0]:.4f}):")
    saved = (rules.GPU_CANDIDATES, rules.HALF_TILE_COST)
    for name, value in base.items():
        ok = []
        for step in range(5, 151):
            v = step / 100
            apply({**base, name: v})
            if (score(sweep, False), score(inv, True)) == ref:
                ok.append(v)
            rules.GPU_CANDIDATES, rules.HALF_TILE_COST = saved
        print(f"  {name:>18s} = {value}: "
              + (f"{min(ok):.2f} .. {max(ok):.2f}" if ok else "no interval")
              + ("" if not ok or len(ok) == round(100 * (max(ok) - min(ok))) + 1 else " (gaps)"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a candidate's efficiency, or half=<HALF_TILE_COST>")
    p.add_argument("--scan", action="store_true", help="the interval of each constant")
    args = p.parse_args(argv)
    apply({k: float(v) for k, v in (item.split("=", 1) for item in args.set)})
    sweep = load(SWEEP_CSV, "configs bf16", "impl")
    inv = load(INVARIANT_CSV, None, "config", INVARIANT_NAMES)
    report(sweep, inv)
    if args.scan:
        scan(sweep, inv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
