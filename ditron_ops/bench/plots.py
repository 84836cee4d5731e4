"""Bench figures: ``ratio = baseline / ours`` of ``Result`` rows, a panel per op and measured variable.

``plan_panels`` (a pure function of the rows) decides what each panel shows; ``draw`` renders it.
The rules, each with its reason:

* A panel holds one impl against one baseline: a ratio compares nothing across baselines.
* The x variables are read from the case labels: ``name=int`` tokens (``M=128``, ``T=4096``,
  ``KV=32768``) and byte sizes (``4KiB``); a ``W=`` token equal to the row's world size is not one,
  world sizes are the series.
* Sweep: a variable taking >= 3 values along one line (rows equal but for it: rest of the label,
  model, world size, other variables) is drawn as lines over a log2 x axis: a trend over a size is
  the question there, and two points are a comparison, not a trend. Of several such variables the
  one with most values wins, then the last in the label (the bench's inner loop: KV in
  ``B=8 KV=4096``). Only lines of >= 2 points are drawn; geo-mean rows become a dotted level.
* Everything else (model layers, op names, cases with two sizes) is categorical: grouped bars
  around the 1.0 line, since the cases have no order a line could follow. Where a case has a row per
  model shape, a group per shape (geo-mean last) and a bar per case; otherwise a group per case and
  a bar per world size. When the rest of an impl's rows all sit at one value of its sweep
  variable, the sweep's row at that value joins them (every model at ``M=8192``).
* Panels of a single bar that share a baseline merge into one bar per impl (the overhead bench);
  single-series bar panels of one op's variants (impls sharing a first word and a baseline) merge
  into a bar per variant (moe ``dispatch det/default/cached``): a lone bar keeps a panel only
  where its baseline is unique.
* The ratio axis is linear from 0 with plain tick labels: equal distances read as equal ratios.
  Labels and the constants of a panel (shared label words) go to the panel's subtitle; the footer
  names the machine, versions and commit.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import textwrap
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["Panel", "plan_panels", "draw", "plot_ratios", "plot_title", "footer"]

_PARAM = re.compile(r"([A-Za-z][\w/]*)=(\d+)")
_BYTES = re.compile(r"(\d+)([KMGT]?)i?B")
_AXIS = {"bytes": "message size", "M": "M (rows)", "T": "tokens T", "KV": "KV length",
         "S": "sequence length S", "B": "batch B"}


@dataclasses.dataclass
class Panel:
    """One subplot: ``kind`` ``"bars"`` (``xs`` labels, points ``(index, ratio)``) or ``"lines"``
    (``xs`` numbers on a log2 axis, points ``(x, ratio)``); ``levels`` dotted horizontal lines."""

    impl: str
    baseline: str
    kind: str
    xlabel: str
    xs: list
    series: dict[str, list[tuple[Any, float]]]
    note: str = ""
    levels: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.impl}\nvs {self.baseline}".lstrip("\n")


def _parse(r) -> tuple[dict[str, int], str]:
    """``({variable: value}, rest of the case label without them and the model names)``."""
    params, rest, models = {}, [], set(r.model.split(",")) if r.model else set()
    for tok in r.case.split():
        if tok in models:  # model names first: "LLaMA-70B" is not 70 bytes
            continue
        p, b = _PARAM.fullmatch(tok), _BYTES.fullmatch(tok)
        if p and not (p[1] == "W" and int(p[2]) == r.world_size):
            params[p[1]] = int(p[2])
        elif b:
            params["bytes"] = int(b[1]) * 1024 ** " KMGT".index(b[2] or " ")
        else:
            rest.append(tok)
    return params, " ".join(rest)


def _line(r, params, rest, var) -> tuple:
    return rest, r.model, r.world_size, tuple(sorted((k, v) for k, v in params.items() if k != var))


def _sweep_variable(parsed) -> Optional[str]:
    best, most = None, 2
    for var in dict.fromkeys(k for _, p, _ in parsed for k in p):  # label order: later wins ties
        lines: dict[tuple, set] = {}
        for r, p, rest in parsed:
            if var in p:
                lines.setdefault(_line(r, p, rest, var), set()).add(p[var])
        n = max(map(len, lines.values()))
        if n >= most:
            best, most = var, n
    return best if most >= 3 else None


def _varying(parts: list[tuple]) -> list[list[str]]:
    """Per item, the parts that differ between items (all non-empty parts when none differ)."""
    keep = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    keep = keep or [i for i in range(len(parts[0])) if parts[0][i]]
    return [[p[i] for i in keep if p[i]] for p in parts]


def _strip_shared(labels: list[str]) -> tuple[list[str], list[str]]:
    """``labels`` without the words all of them share (none stripped if a label would empty),
    and those words in the first label's order. Lines of multi-line labels are kept."""
    lines = [[ln.split() for ln in lab.split("\n")] for lab in labels]
    shared = set.intersection(*({w for ln in x for w in ln} for x in lines)) if len(labels) > 1 else set()
    short = ["\n".join(" ".join(w for w in ln if w not in shared) for ln in x
                       if any(w not in shared for w in ln)) for x in lines]
    if not shared or not all(short):
        return labels, []
    return short, [w for ln in lines[0] for w in ln if w in shared]


def _shorten(pan: Panel) -> Panel:
    """Words every bar label or every series name shares, and a lone series' name, move to the
    panel's note (said once above the panel instead of on every tick or legend entry)."""
    xs, moved = _strip_shared(pan.xs) if pan.kind == "bars" else (pan.xs, [])
    names, shared = _strip_shared(list(pan.series))
    if len(names) == 1:
        names, shared = [""], names[0].split()
    note = " ".join(dict.fromkeys([*moved, *shared, *pan.note.split()]))
    series = dict(zip(names, pan.series.values()))
    return dataclasses.replace(pan, xs=xs, series=series, note=note)


def _sweep_panel(items, var, levels) -> Panel:
    lines: dict[tuple, list] = {}
    for r, p, rest in items:
        lines.setdefault(_line(r, p, rest, var), []).append((p[var], r.ratio))
    keys = list(lines)
    parts = [(" ".join(f"{k}={v}" for k, v in others), rest, model.replace(",", ", "), f"W={w}")
             for rest, model, w, others in keys]
    names = [" ".join(n) for n in _varying(parts)]
    xs = sorted({x for pts in lines.values() for x, _ in pts})
    series = {name: sorted(lines[k]) for name, k in zip(names, keys)}
    r = items[0][0]
    return Panel(r.impl, r.baseline, "lines", _AXIS.get(var, var), xs, series, levels=levels)


def _bar_panel(rows) -> Panel:
    per_shape = len({(r.case, r.world_size) for r in rows}) < len(rows)
    if per_shape:  # shared words of the keys (one world size: its W=) go to the note
        xs = [(r.model or r.shape).replace(",", "\n") for r in rows]
        keys = [f"{r.case} W={r.world_size}" for r in rows]
    else:
        xs = ["\n".join([r.case] + [m for m in r.model.split(",") if m and m not in r.case])
              for r in rows]
        keys = [f"W={r.world_size}" for r in rows]
    labels = list(dict.fromkeys(xs))
    series: dict[str, list] = {}
    for r, x, key in sorted(zip(rows, xs, keys), key=lambda t: t[0].world_size):
        series.setdefault(key, []).append((labels.index(x), r.ratio))
    return Panel(rows[0].impl, rows[0].baseline, "bars", "", labels, series)


def _impl_panels(rows) -> list[Panel]:
    parsed = [(r, *_parse(r)) for r in rows]
    var = _sweep_variable([t for t in parsed if t[0].shape != "geo-mean"])
    if var is None:
        return [_bar_panel(rows)]
    counts: dict[tuple, int] = {}
    for key in (_line(r, p, rest, var) for r, p, rest in parsed if var in p):
        counts[key] = counts.get(key, 0) + 1
    on = [var in p and counts[_line(r, p, rest, var)] >= 2 for r, p, rest in parsed]
    levels = {f"{r.case} geo-mean {r.ratio:.2f}".strip(): r.ratio for r in rows if r.shape == "geo-mean"}
    off = [t for t, o in zip(parsed, on) if not o and t[0].shape != "geo-mean"]
    at = {t[1].get(var) for t in off}
    panels = [_sweep_panel([t for t, o in zip(parsed, on) if o], var, levels)]
    if off:
        join = len(at) == 1 and None not in at
        cat = [t[0] for t, o in zip(parsed, on) if (not o and t[0].shape != "geo-mean")
               or (o and join and t[1][var] in at)]
        panels.insert(0 if not on[0] else 1, _bar_panel(cat))
    return panels


def _merge(panels: list[Panel]) -> list[Panel]:
    """Single-bar panels of one baseline -> a bar per impl; then single-series bar panels of one
    op's variants -> a bar per variant (see the module docstring). First panel's place kept."""
    for key_of in (_single_bar_key, _variant_key):
        out: list = []
        groups: dict[Any, list[Panel]] = {}
        for pan in panels:
            k = key_of(pan) if pan.kind == "bars" and len(pan.series) == 1 else None
            if k is None:
                out.append(pan)
            elif k not in groups:
                groups[k] = [pan]
                out.append(groups[k])
            else:
                groups[k].append(pan)
        panels = [_combine(p) if isinstance(p, list) else p for p in out]
    return panels


def _single_bar_key(pan: Panel):
    return pan.baseline if len(pan.xs) == 1 and pan.impl else None


def _variant_key(pan: Panel):
    return (pan.impl.split()[0], pan.baseline) if pan.impl else None


def _combine(group: list[Panel]) -> Panel:
    if len(group) == 1:
        return group[0]
    impls = [p.impl for p in group]
    notes = " ".join(dict.fromkeys(n for p in group for n in [p.note, *p.series] if n))
    if all(len(p.xs) == 1 for p in group):  # a bar per impl
        pts = [(i, next(iter(p.series.values()))[0][1]) for i, p in enumerate(group)]
        xs_note = " ".join(dict.fromkeys(p.xs[0] for p in group))
        note = " ".join(dict.fromkeys(n for n in (xs_note, notes) if n))
        return Panel("", group[0].baseline, "bars", "", impls, {"": pts}, note)
    xs = list(dict.fromkeys(x for p in group for x in p.xs))
    series = {impl: [(xs.index(p.xs[i]), y) for i, y in next(iter(p.series.values()))]
              for impl, p in zip(impls, group)}
    return Panel(impls[0].split()[0], group[0].baseline, "bars", "", xs, series, notes)


def plan_panels(results: Sequence) -> list[Panel]:
    """The panels of one bench's rows (rules in the module docstring), in the CSV's order."""
    keys = list(dict.fromkeys((r.impl, r.baseline) for r in results))
    panels = [p for key in keys
              for p in _impl_panels([r for r in results if (r.impl, r.baseline) == key])]
    return [_shorten(p) for p in _merge(panels)]


def _tick(x: float, var_bytes: bool) -> str:
    x = int(x)
    if var_bytes:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if x >= size and x % size == 0:
                return f"{x // size} {unit}"
        return f"{x} B"
    return f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x)


_W_COLOR = {1: 0, 2: 1, 4: 2, 8: 3, 3: 4, 5: 5, 6: 6, 7: 7}
"""Color index per world size: the powers of two the benches use first, then the rest."""


def _colors(names) -> dict[str, Any]:
    """``W=n`` series keep one color per world size across panels; others take the cycle."""
    out = {}
    for i, name in enumerate(names):
        w = re.fullmatch(r"W=(\d+)", name)
        out[name] = f"C{_W_COLOR.get(int(w[1]), int(w[1])) % 10}" if w else f"C{i % 10}"
    return out


def _draw_panel(ax, pan: Panel) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, ScalarFormatter

    colors = _colors(pan.series)
    ys = [y for pts in pan.series.values() for _, y in pts if y == y] + list(pan.levels.values())
    if pan.kind == "lines":
        for name, pts in pan.series.items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colors[name],
                    label=name or None)
        for name, y in pan.levels.items():
            ax.axhline(y, color="black", linewidth=0.9, linestyle=":", label=name)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(pan.xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _tick(x, pan.xlabel == _AXIS["bytes"])))
        ax.set_xlim(pan.xs[0] / 1.4, pan.xs[-1] * 1.4)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlabel(pan.xlabel, fontsize=8)
    else:
        width = 0.8 / len(pan.series)
        few = len(pan.series) * len(pan.xs) <= 24
        for i, (name, pts) in enumerate(pan.series.items()):
            xs = [x - 0.4 + width * (i + 0.5) for x, _ in pts]
            bars = ax.bar(xs, [y for _, y in pts], width * 0.92, color=colors[name], label=name or None)
            if few:
                ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1,
                             bbox=dict(facecolor="white", edgecolor="none", pad=0.2, alpha=0.8))
        ax.set_xticks(range(len(pan.xs)))
        long = max(len(max(x.split("\n"), key=len)) for x in pan.xs) * len(pan.xs) > 70
        ax.set_xticklabels(pan.xs, fontsize=7, rotation=25 if long else 0, ha="right" if long else "center")
        pad = max(0.0, (3 - len(pan.xs)) / 2)  # one or two groups: bars no wider than in three
        ax.set_xlim(-0.6 - pad, len(pan.xs) - 0.4 + pad)
    ax.axhline(1.0, color="grey", linewidth=0.9, linestyle="--", zorder=0.5)
    named = [n for n in pan.series if n] + list(pan.levels)
    ncol = min(len(named), 3)
    legend_rows = math.ceil(len(named) / ncol) if named else 0
    ax.set_ylim(0, max(1.0, max(ys, default=1.0)) * (1.15 + 0.1 * legend_rows))  # room for legend
    fmt = ScalarFormatter(useOffset=False)
    fmt.set_scientific(False)
    ax.yaxis.set_major_formatter(fmt)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylabel("baseline / ours", fontsize=8)
    ax.set_title(pan.title + (f"\n{pan.note}" if pan.note else ""), fontsize=8)
    if named:
        ax.legend(fontsize=6, framealpha=0.8, loc="upper center", ncol=ncol)
    ax.grid(axis="y", linewidth=0.3, alpha=0.5)


def footer(machine: dict[str, str]) -> str:
    """One line: device, versions, commit and time of the run (the CSV's machine columns)."""
    m = machine
    dev = m.get("device_name", "?") + (f" ({m['device_detail']})" if m.get("device_detail") else "")
    parts = [dev] + [f"{k} {m[k]}" for k in ("torch", "triton", "python") if m.get(k)]
    parts += [f"commit {m.get('git_commit', '?')}"] + ([m["timestamp"]] if m.get("timestamp") else [])
    return " | ".join(parts)


def draw(panels: Sequence[Panel], title: str, foot: str = ""):
    """A matplotlib figure of ``panels`` (two per row) with ``title`` on top and ``foot`` below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.0 * cols, 3.9 * rows + 0.6), squeeze=False,
                             layout="constrained")
    for ax, pan in zip(axes.flat, panels):
        _draw_panel(ax, pan)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    if foot:  # wrapped to the figure's width (about 16 characters of 7 pt text per inch)
        fig.supxlabel(textwrap.fill(foot, int(7.0 * cols * 16)), fontsize=7, color="dimgrey")
    return fig


def plot_title(bench: str, dtype_name: str, device_name: str, results: Sequence = ()) -> str:
    """The figure title: bench, dtype, device and what the ratio means (baselines: per panel)."""
    return (f"{bench} ({dtype_name}, {device_name}): ratio = baseline time / our time "
            f"(>1: ours faster)")


def plot_ratios(results: Sequence, path: Path, title: str,
                machine: Optional[dict[str, str]] = None) -> Optional[Path]:
    """PNG of ``ratio`` per ``plan_panels`` with ``machine`` in the footer (None: no matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib.pyplot as plt

    fig = draw(plan_panels(results), title, footer(machine) if machine else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
