"""Fit and check the GEMM core's tile rule (``gemm._core_configs.select_config``) on measured data.

Reads the H200 CSVs that every candidate configuration was measured in (ratio = cuBLAS time /
ours, higher is better):

* ``benchmarks/results/gemm_configs-bf16-cuda.csv`` (``bench gemm_sweep --only configs``): 9
  configurations on the 48 seeded sweep shapes, bf16 out; the default mode's rule is scored here;
* ``benchmarks/probes/invariant_configs-bf16-cuda.csv`` (``benchmarks/probes/invariant_configs.py``): 8
  M-side tilings of the fp32-out GEMM at M 1-1024 on the six GEMM-RS model shapes; the
  deterministic mode's rule is scored here.

and prints, for the rule as committed (or with ``--set name=value`` overrides): its geo-mean
against the current configuration (128x256x64/s4/tail everywhere) and against the oracle (the
best measured configuration per shape), per M on the invariant data, the worst shapes, where it
loses most to the oracle, and how far each constant can move before a choice on the data
changes (``--scan``). A choice that has no measurement (a candidate the CSV lacks for that shape)
is reported, never guessed.

Split-K (``_core_configs.select_split``, default-mode ``matmul``): the report ends with what the
model PREDICTS for the sweep shapes it would split (from the configs CSV, which has no split
runs): per shape the unsplit choice's measured ratio, the split choice and its predicted
ratio, two ways (the model's absolute time against cuBLAS's measured one; and anchored, the
unsplit choice's measured time scaled by the model's split / unsplit times), and the sweep's
geo-mean with each. ``--splitk [CSV]`` reads ``bench gemm_sweep --only splitk``'s calibration
rows (default ``benchmarks/results/gemm_splitk-bf16-cuda.csv``), compares every measured
(configuration, S) with the model, fits the split-K constants (``STEP_US`` from the unsplit rows,
``SPLIT_STEP_US``, ``PARTIAL_BYTES_PER_S`` and ``SPLIT_LAUNCH_US`` by least squares on the split
ones) and scores the rule with them against the best measured S per shape.
``--split-sweep [CSV]`` reads ``bench gemm_sweep``'s own rows (default
``benchmarks/results/gemm_sweep-bf16-cuda.csv``): the runs the rule split, each against the
same tiles unsplit in the configs CSV (ratios: cuBLAS is the common reference of the two runs),
fits ``PARTIAL_BYTES_PER_S`` and ``SPLIT_LAUNCH_US`` to them by least squares (``SPLIT_STEP_US``
kept; also all three), checks the fit leaving one shape out, scans how far each constant can
move before the rule's splits on the sweep change, and predicts the sweep's geo-mean with the
committed constants.

Usage (CPU is enough)::

    PYTHONPATH=. python tools/gemm_rule_fit.py [--scan] [--set 64x128x64/s6=0.5 --set half=0.7]
    PYTHONPATH=. python tools/gemm_rule_fit.py --splitk [CSV] [--set split_step=0.8 --set bw=3.0]
    PYTHONPATH=. python tools/gemm_rule_fit.py --split-sweep [CSV]
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
INVARIANT_CSV = os.path.join(ROOT, "benchmarks", "probes", "invariant_configs-bf16-cuda.csv")
SPLITK_CSV = os.path.join(ROOT, "benchmarks", "results", "gemm_splitk-bf16-cuda.csv")
SWEEP_RUN_CSV = os.path.join(ROOT, "benchmarks", "results", "gemm_sweep-bf16-cuda.csv")
SPLIT_CONSTANTS = {"step": "STEP_US", "split_step": "SPLIT_STEP_US", "bw": "PARTIAL_BYTES_PER_S",
                   "launch": "SPLIT_LAUNCH_US"}
"""``--set`` names of the split-K constants (``bw`` in TB/s)."""
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
    """Set candidate efficiencies (``name=value``), ``half`` (``HALF_TILE_COST``) and the
    split-K constants (``SPLIT_CONSTANTS``)."""
    for key, attr in SPLIT_CONSTANTS.items():
        if key in overrides:
            setattr(rules, attr, overrides[key] * (1e12 if key == "bw" else 1))
    cands = []
    for c in rules.GPU_CANDIDATES:
        value = overrides.get(c.name)
        cands.append(c if value is None else dataclasses.replace(c, efficiency=value))
    rules.GPU_CANDIDATES = tuple(cands)
    if "half" in overrides:
        rules.HALF_TILE_COST = overrides["half"]


def step_fit(path: str) -> str:
    """``STEP_US`` and ``SPLIT_STEP_US`` as ``_core_configs`` derives them: the median of
    measured time / (``predicted_time`` x K steps) over the candidates' rows with fewer tiles
    than ``SMS``, and over the others."""
    cands = {c.name: c for c in rules.GPU_CANDIDATES}
    few, full = [], []
    for shape, (_, ours) in load_times(path, "configs bf16").items():
        m, n, k = shape
        for name, t in ours.items():
            if name in cands:
                c = cands[name]
                x = t / (rules.predicted_time(c, m, n, SMS) * -(-k // c.cfg.block_k))
                tiles = -(-m // c.cfg.block_m) * -(-n // c.cfg.block_n)
                (few if tiles < SMS else full).append(x)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return (f"{med(few):.3f} under one wave ({len(few)} rows; STEP_US {rules.STEP_US}), "
            f"{med(full):.3f} at one or more ({len(full)} rows; SPLIT_STEP_US "
            f"{rules.SPLIT_STEP_US})")


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


def load_times(path: str, case: str) -> dict:
    """``{(m, n, k): (cuBLAS us, {config name: our us})}`` of one case of a CSV."""
    data: dict = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("case") == case:
                shape = (int(row["m"]), int(row["n"]), int(row["k"]))
                base, ours = data.setdefault(shape, (float(row["baseline_us"]), {}))
                ours[row["impl"]] = float(row["time_us"])
    return data


def splitk_prediction(times: dict) -> list[tuple]:
    """The model's split choices on the sweep shapes of ``times`` (``load_times``, the configs
    CSV) with their predicted ratios; prints the table. Returns ``[(shape, unsplit ratio
    measured, predicted ratio absolute, anchored)]`` for the split shapes (a PREDICTION).

    Absolute: cuBLAS's measured time over the model's split time. Anchored: over the unsplit
    choice's measured time x (model split time / its model time); an unsplit choice without a
    measurement is replaced by the model's next measured candidate, unscaled (as ``report``'s
    "all 48 shapes" line counts it)."""
    out, ratios = [], {}
    print(f"\nsplit-K, PREDICTED by the model (no split runs here; STEP_US {rules.STEP_US}, "
          f"SPLIT_STEP_US {rules.SPLIT_STEP_US}, {rules.PARTIAL_BYTES_PER_S / 1e12:g} TB/s, "
          f"launch {rules.SPLIT_LAUNCH_US} us), {SMS} programs:")
    for shape, (base, ours) in sorted(times.items()):
        m, n, k = shape
        first = rules.select(m, n, SMS, CUDA, deterministic=False)
        chosen, split = rules.select_split(m, n, k, SMS, CUDA, deterministic=False)
        # the anchor: the unsplit choice, or where it has no measurement the model's next
        # measured candidate (as ``report`` counts it): its measured time, its model time
        anchor = first if first.name in ours else next(
            c for c in rules.GPU_CANDIDATES
            if c.name == fallback(shape, {x: base / t for x, t in ours.items()}, False)[0])
        t1_meas = ours[anchor.name]
        ratios[shape] = base / t1_meas
        if split == 1:
            continue
        t1 = rules.split_time_us(anchor, m, n, k, SMS, 1)
        ts = rules.split_time_us(chosen, m, n, k, SMS, split)
        absolute, anchored = base / ts, base / (t1_meas * ts / t1)
        out.append((shape, base / t1_meas, absolute, anchored))
        print(f"  {m}x{n}x{k}: unsplit {first.name}"
              + (f" (unmeasured; anchor {anchor.name})" if anchor is not first else "")
              + f" measured {base / t1_meas:.3f}x "
              f"(model {t1:.1f} us, measured {t1_meas:.1f}) -> {chosen.name} S={split}: "
              f"model {ts:.1f} us, cuBLAS {base:.1f} us: predicted {absolute:.3f}x absolute, "
              f"{anchored:.3f}x anchored")
    if out:
        split_shapes = {s for s, *_ in out}
        for label, col in (("absolute", 2), ("anchored", 3)):
            pred = {r[0]: r[col] for r in out}
            after = {s: pred.get(s, r) for s, r in ratios.items()}
            worst = sorted((r, s) for s, r in after.items())[:5]
            print(f"  sweep geo-mean, {label}: {geo(after.values()):.4f} (unsplit "
                  f"{geo(ratios.values()):.4f}); the {len(out)} split shapes "
                  f"{geo(pred[s] for s in split_shapes):.4f} (unsplit "
                  f"{geo(ratios[s] for s in split_shapes):.4f}); worst five then: "
                  + ", ".join(f"{s[0]}x{s[1]}x{s[2]} {r:.3f}" for r, s in worst))
    return out


def _split_terms(name: str, m: int, n: int, k: int, split: int) -> tuple[float, float, float]:
    """``(K-step term, partial bytes, 1)`` of ``split_time_us`` for a split run (the model's
    time is ``SPLIT_STEP_US x first + second / PARTIAL_BYTES_PER_S x 1e6 + SPLIT_LAUNCH_US``)."""
    c = next(c for c in rules.GPU_CANDIDATES if c.name == name)
    used, steps = rules.slices(k, c.cfg.block_k, split)
    tiles = -(-m // c.cfg.block_m) * -(-n // c.cfg.block_n)
    full, _ = rules.waves(tiles * used, SMS, dataclasses.replace(c.cfg, split_tail=False))
    area = c.cfg.block_m * c.cfg.block_n / (128 * 256)
    return full * area / c.efficiency * steps, used * m * n * 8.0, 1.0


def fit_splitk(rows: list[dict]) -> dict:
    """The split-K constants fitted to calibration rows (``bench gemm_sweep --only splitk``:
    dicts with m, n, k, config, split_k, time_us): ``step`` (``STEP_US``, the median over the
    unsplit rows of time / (``predicted_time`` x K steps)) and, by least squares over the split
    rows, ``split_step``, ``bw`` (TB/s) and ``launch`` (us)."""
    cands = {c.name: c for c in rules.GPU_CANDIDATES}
    unsplit, xs, ys = [], [], []
    for r in rows:
        m, n, k, s = int(r["m"]), int(r["n"]), int(r["k"]), int(r["split_k"])
        if s == 1:
            c = cands[r["config"]]
            unsplit.append(float(r["time_us"])
                           / (rules.predicted_time(c, m, n, SMS) * -(-k // c.cfg.block_k)))
        else:
            xs.append(_split_terms(r["config"], m, n, k, s))
            ys.append(float(r["time_us"]))
    got = {"step": sorted(unsplit)[len(unsplit) // 2] if unsplit else float("nan")}
    if len(xs) >= 3:
        a, b, c = _least_squares(xs, ys)
        got.update(split_step=a, bw=_tb_per_s(b), launch=c)
    return got


def _least_squares(xs: list, ys: list) -> list[float]:
    """The coefficients of ``ys ~ xs @ coef`` (columns scaled first: they differ by 1e7)."""
    x = torch.tensor(xs, dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1e-30)
    sol = torch.linalg.lstsq(x / scale, torch.tensor(ys, dtype=torch.float64)[:, None]).solution
    return (sol[:, 0] / scale).tolist()


def _tb_per_s(us_per_byte: float) -> float:
    """``PARTIAL_BYTES_PER_S`` in TB/s from the partial term's coefficient (us per byte)."""
    return 1e6 / us_per_byte / 1e12 if us_per_byte > 0 else float("inf")


def splitk_calibration(path: str) -> None:
    """``--splitk``: measured vs model per (shape, configuration, S), the fitted constants and
    the rule's score with them (against the unsplit choice and the best measured per shape)."""
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["case"].startswith("splitk")]
    if not rows:
        print(f"{path}: no splitk rows")
        return
    print(f"\nsplit-K calibration ({path}, {len(rows)} rows): measured us / model us")
    by_shape: dict = collections.defaultdict(dict)
    for r in rows:
        shape = (int(r["m"]), int(r["n"]), int(r["k"]))
        by_shape[shape][(r["config"], int(r["split_k"]))] = (float(r["time_us"]),
                                                             float(r["baseline_us"]))
    cands = {c.name: c for c in rules.GPU_CANDIDATES}
    for shape, runs in sorted(by_shape.items()):
        m, n, k = shape
        model = {run: rules.split_time_us(cands[run[0]], m, n, k, SMS, run[1]) for run in runs}
        print(f"  {m}x{n}x{k} (cuBLAS {next(iter(runs.values()))[1]:.1f} us): " + ", ".join(
            f"{name.split('x64')[0]} S={s} {t:.1f}/{model[(name, s)]:.1f}"
            for (name, s), (t, _) in sorted(runs.items())))
    fitted = fit_splitk(rows)
    print("  fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.items())
          + "  (apply: " + " ".join(f"--set {k}={v:.3g}" for k, v in fitted.items()) + ")")
    for label, overrides in (("committed constants", {}), ("fitted constants", fitted)):
        saved = {a: getattr(rules, a) for a in SPLIT_CONSTANTS.values()}
        apply({k: v for k, v in overrides.items() if v == v})
        rule, unsplit, oracle, missing = [], [], [], 0
        for shape, runs in by_shape.items():
            m, n, k = shape
            base = next(iter(runs.values()))[1]
            chosen, s = rules.select_split(m, n, k, SMS, CUDA, deterministic=False)
            first = rules.select(m, n, SMS, CUDA, deterministic=False)
            if (chosen.name, s) not in runs or (first.name, 1) not in runs:
                missing += 1
                continue
            rule.append(base / runs[(chosen.name, s)][0])
            unsplit.append(base / runs[(first.name, 1)][0])
            oracle.append(base / min(t for t, _ in runs.values()))
        for a, v in saved.items():
            setattr(rules, a, v)
        print(f"  {label}: rule {geo(rule):.4f}  unsplit {geo(unsplit):.4f}  best measured "
              f"{geo(oracle):.4f} over {len(rule)} shapes" + (f" ({missing} choices unmeasured)"
                                                                if missing else ""))


def sweep_split_points(path: str, configs: dict) -> list[dict]:
    """The split runs of a ``bench gemm_sweep`` CSV (``case = "sweep <dtype>"``, ``split_k``
    > 1; the rule's own choices, both dtypes): dicts with shape, dtype, config, split, time_us,
    base_us (cuBLAS in the same run) and same_us, the same tiles unsplit from ``configs``
    (``load_times`` of the configs CSV, another run: its ratio to cuBLAS times this run's
    cuBLAS time, cuBLAS being the common reference)."""
    points = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if not row["case"].startswith("sweep") or not row["m"] or int(row["split_k"]) < 2:
                continue
            shape = (int(row["m"]), int(row["n"]), int(row["k"]))
            base = float(row["baseline_us"])
            cfg_base, cfg_times = configs.get(shape, (None, {}))
            same = cfg_times.get(row["config"])
            points.append(dict(shape=shape, dtype=row["case"].split()[-1], config=row["config"],
                               split=int(row["split_k"]), time_us=float(row["time_us"]),
                               base_us=base,
                               same_us=base * same / cfg_base if same is not None else None))
    return points


def fit_split_sweep(points: list[dict], free_step: bool = False) -> dict:
    """The split-K constants fitted to measured split runs (``sweep_split_points``): by least
    squares of the measured time on ``split_time_us``'s terms, ``bw`` (TB/s) and ``launch``
    (us) with ``SPLIT_STEP_US`` as committed, or (``free_step``) ``split_step`` too."""
    xs = [_split_terms(p["config"], *p["shape"], p["split"]) for p in points]
    ys = [p["time_us"] for p in points]
    if free_step:
        a, b, c = _least_squares(xs, ys)
        return dict(split_step=a, bw=_tb_per_s(b), launch=c)
    step = rules.SPLIT_STEP_US
    b, c = _least_squares([x[1:] for x in xs], [y - step * x[0] for x, y in zip(xs, ys)])
    return dict(split_step=step, bw=_tb_per_s(b), launch=c)


def _model_us(p: dict, fitted: dict) -> float:
    """``split_time_us`` of point ``p`` with ``fitted`` constants."""
    first, part, one = _split_terms(p["config"], *p["shape"], p["split"])
    return fitted["split_step"] * first + part / (fitted["bw"] * 1e12) * 1e6 + fitted["launch"]


def _with_constants(fitted: dict, fn):
    """``fn()`` with the split-K constants set to ``fitted`` (``apply``'s names), then
    restored."""
    saved = {a: getattr(rules, a) for a in SPLIT_CONSTANTS.values()}
    apply(fitted)
    try:
        return fn()
    finally:
        for a, v in saved.items():
            setattr(rules, a, v)


def _rms_log(pairs) -> float:
    pairs = list(pairs)
    return math.sqrt(sum(math.log(a / b) ** 2 for a, b in pairs) / len(pairs))


def split_sweep_report(path: str) -> None:
    """``--split-sweep``: the split runs of a ``bench gemm_sweep`` CSV against the same tiles
    unsplit (the configs CSV), the split-K constants fitted to them (``fit_split_sweep``, with
    a leave-one-shape-out check of the times and of the rule's choice on the left-out shape),
    the rule's choices with the committed constants on every sweep row, and the sweep's
    geo-mean predicted with them (a PREDICTION until the sweep runs again)."""
    if not os.path.exists(path):
        print(f"\n{path}: missing (bench gemm_sweep writes it)")
        return
    configs = load_times(SWEEP_CSV, "configs bf16")
    points = sweep_split_points(path, configs)
    if not points:
        print(f"{path}: no split runs")
        return
    shapes = sorted({p["shape"] for p in points})
    print(f"\nsplit-K measured ({os.path.relpath(path, ROOT)}, {len(points)} split runs on "
          f"{len(shapes)} shapes, {SMS} programs): ratio to cuBLAS, split / the same tiles "
          "unsplit (configs CSV, bf16); time us measured / model with the committed constants")
    for shape in shapes:
        runs = [p for p in points if p["shape"] == shape]
        p = runs[0]
        c = next(c for c in rules.GPU_CANDIDATES if c.name == p["config"])
        tiles = -(-shape[0] // c.cfg.block_m) * -(-shape[1] // c.cfg.block_n)
        print(f"  {shape[0]}x{shape[1]}x{shape[2]} {p['config'].split('x64')[0]} x{tiles} "
              f"S={p['split']}: " + ", ".join(
                  f"{r['dtype']} {r['base_us'] / r['time_us']:.3f} / "
                  + (f"{r['base_us'] / r['same_us']:.3f}" if r["same_us"] else "-")
                  + f" ({r['time_us']:.1f} / "
                  f"{rules.split_time_us(c, *shape, SMS, r['split']):.1f} us)" for r in runs))
    fitted = fit_split_sweep(points)
    free = fit_split_sweep(points, free_step=True)
    committed = {"split_step": rules.SPLIT_STEP_US, "bw": rules.PARTIAL_BYTES_PER_S / 1e12,
                 "launch": rules.SPLIT_LAUNCH_US}
    for label, got in (("committed", committed), ("fitted, SPLIT_STEP_US kept", fitted),
                       ("fitted, all three", free)):
        print(f"  {label}: split_step {got['split_step']:.3f} us, bw {got['bw']:.3g} TB/s, "
              f"launch {got['launch']:.2f} us; rms log error "
              f"{_rms_log((_model_us(p, got), p['time_us']) for p in points):.3f}")
    # leave one shape (both dtypes) out: its times and the rule's choice on it
    loo, lines = [], []
    for shape in shapes:
        rest = [p for p in points if p["shape"] != shape]
        got = fit_split_sweep(rest)
        mine = [p for p in points if p["shape"] == shape]
        loo += [(_model_us(p, got), p["time_us"]) for p in mine]
        chosen, s = _with_constants(
            got, lambda: rules.select_split(*shape, SMS, CUDA, deterministic=False))
        same = [p["same_us"] for p in mine if p["same_us"]]
        won = bool(same) and geo(p["time_us"] for p in mine) < geo(same)
        lines.append(f"{shape[0]}x{shape[1]}x{shape[2]} bw {got['bw']:.2f} launch "
                     f"{got['launch']:.1f}: {chosen.name.split('x64')[0]} "
                     + (f"S={s}" if s > 1 else "unsplit")
                     + f" (split measured {'faster' if won else 'slower'} than the same tiles)")
    print(f"  leave one shape out (bw and launch fitted to the other {len(shapes) - 1}): rms log "
          f"error {_rms_log(loo):.3f}; the rule's choice on the left-out shape:")
    for line in lines:
        print("    " + line)
    split_scan(path)
    sweep_prediction(path, configs)


def _split_shapes(path: str) -> list[tuple]:
    """The distinct shapes of a ``bench gemm_sweep`` CSV's sweep rows that the rule splits."""
    with open(path, newline="") as fh:
        shapes = sorted({(int(r["m"]), int(r["n"]), int(r["k"])) for r in csv.DictReader(fh)
                         if r["case"].startswith("sweep") and r["m"]})
    return [s for s in shapes if rules.select_split(*s, SMS, CUDA, deterministic=False)[1] > 1]


def split_scan(path: str) -> None:
    """``bw`` and ``launch`` each alone over a range: the interval in which the shapes the rule
    splits on the sweep stay those it splits with the committed constants."""
    committed = {"bw": rules.PARTIAL_BYTES_PER_S / 1e12, "launch": rules.SPLIT_LAUNCH_US}
    ref = _split_shapes(path)
    print(f"  the sweep shapes split with the committed constants: {ref}; kept for")
    for key, values in (("bw", [x / 20 for x in range(10, 81)]),
                        ("launch", [x / 2 for x in range(0, 61)])):
        ok = [v for v in values
              if _with_constants({**committed, key: v}, lambda: _split_shapes(path)) == ref]
        print(f"    {key} = {committed[key]:g}: " + (f"{min(ok):g} .. {max(ok):g}" if ok else "none")
              + (" (gaps)" if ok and len(ok) != values.index(max(ok)) - values.index(min(ok)) + 1
                 else "") + f" (scanned {values[0]:g} .. {values[-1]:g})")


def sweep_prediction(path: str, configs: dict) -> None:
    """The rule's choices with the committed constants on every row of a ``bench gemm_sweep``
    CSV and the geo-mean per dtype they predict: a row whose choice did not change at its
    measured ratio; a new unsplit choice at the configs CSV's ratio (bf16, for both dtypes),
    or where that candidate is unmeasured at the model's next measured candidate's (as
    ``report`` counts it) or at cuBLAS over the model's time; a new split at cuBLAS over the
    model's time."""
    before, after, model_after = (collections.defaultdict(list) for _ in range(3))
    changed, new_splits = [], []
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["case"].startswith("sweep") and r["m"]]
    for row in rows:
        dtype = row["case"].split()[-1]
        m, n, k = shape = (int(row["m"]), int(row["n"]), int(row["k"]))
        base, ratio = float(row["baseline_us"]), float(row["ratio"])
        chosen, s = rules.select_split(m, n, k, SMS, CUDA, deterministic=False)
        before[dtype].append(ratio)
        if (chosen.name, s) == (row["config"], int(row["split_k"])):
            after[dtype].append(ratio)
            model_after[dtype].append(ratio)
            continue
        if s > 1 and int(row["split_k"]) == 1:
            new_splits.append(shape)
        model = base / rules.split_time_us(chosen, m, n, k, SMS, s)
        cfg_base, cfg_times = configs.get(shape, (None, {}))
        if s == 1 and chosen.name in cfg_times:
            got = model = cfg_base / cfg_times[chosen.name]
            note = f"{got:.3f} measured (configs)"
        elif s == 1:
            name, got = fallback(shape, {x: cfg_base / t for x, t in cfg_times.items()}, False)
            note = f"{got:.3f} at {name.split('x64')[0]} (unmeasured; model {model:.3f})"
        else:
            got, note = model, f"{model:.3f} model"
        after[dtype].append(got)
        model_after[dtype].append(model)
        changed.append(f"{dtype} {m}x{n}x{k}: {row['config'].split('x64')[0]} "
                       f"S={row['split_k']} {ratio:.3f} -> {chosen.name.split('x64')[0]}"
                       + (f" S={s}" if s > 1 else " unsplit") + f" {note}")
    print(f"\nthe rule with the committed constants (split_step {rules.SPLIT_STEP_US}, "
          f"{rules.PARTIAL_BYTES_PER_S / 1e12:g} TB/s, launch {rules.SPLIT_LAUNCH_US} us) on "
          f"the {len(rows)} rows of {os.path.relpath(path, ROOT)}: {len(changed)} choices "
          f"changed, {len(new_splits)} new splits" + (f" {new_splits}" if new_splits else ""))
    for line in changed:
        print("  " + line)
    for dtype in before:
        print(f"  sweep geo-mean {dtype} ({len(before[dtype])} shapes): measured "
              f"{geo(before[dtype]):.4f} -> PREDICTED {geo(after[dtype]):.4f} (unmeasured "
              f"choices at the next measured candidate), {geo(model_after[dtype]):.4f} (at the "
              "model's time)")


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
    p.add_argument("--split-sweep", nargs="?", const=SWEEP_RUN_CSV, default=None, metavar="CSV",
                   help="fit the split-K constants to the split runs of bench gemm_sweep's CSV "
                        f"(default {os.path.relpath(SWEEP_RUN_CSV, ROOT)})")
    p.add_argument("--splitk", nargs="?", const=SPLITK_CSV, default=None, metavar="CSV",
                   help="fit the split-K constants to bench gemm_sweep --only splitk's rows "
                        f"(default {os.path.relpath(SPLITK_CSV, ROOT)})")
    args = p.parse_args(argv)
    apply({k: float(v) for k, v in (item.split("=", 1) for item in args.set)})
    sweep = load(SWEEP_CSV, "configs bf16", "impl")
    inv = load(INVARIANT_CSV, None, "config", INVARIANT_NAMES)
    report(sweep, inv)
    print(f"\nSTEP_US on the sweep data (median of measured / model time, per K step): "
          f"{step_fit(SWEEP_CSV)}")
    splitk_prediction(load_times(SWEEP_CSV, "configs bf16"))
    if args.scan:
        scan(sweep, inv)
    if args.splitk:
        splitk_calibration(args.splitk)
    if args.split_sweep:
        split_sweep_report(args.split_sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
