"""Benchmark harness: bench registry, SPMD timing, result rows, CSV / table output (PNG: ``plots``).

Timing inside a virtual world (every rank runs the same code)::

    rank r:  warm-up call | estimate (max over ranks) -> iters per round
             round i:  sync stream | host barrier | event/clock | iters x fn() | event/clock
             all_gather_object(per-round times) -> per round: max over ranks -> median over rounds

On CUDA the clock is a pair of CUDA events on the rank's current stream (the device time of the
``iters`` calls, as in ``triton.testing.do_bench``); on CPU (Triton interpreter) it is
``time.perf_counter``. The max across ranks is what a synchronous step of the model would see
(flashinfer ``aggregate_gpu_time_across_ranks``). L2 is not flushed between calls: the
collectives read each input once per call.

Benches register with one decorator and are found by importing every module of this package::

    @register("ag_gemm", help="all_gather + GEMM vs torch", world_sizes=(2, 4, 8))
    def run(cfg: BenchConfig) -> list[Result]: ...
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib
import math
import os
import pkgutil
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..runtime.torchrun import started_by_torchrun
from .plots import plot_ratios, plot_title

__all__ = ["Bench", "BenchConfig", "Result", "BENCHES", "register", "discover", "time_spmd", "warm_gpu",
           "host_time_spmd", "paired_graph_times", "rows_over_worlds", "machine_info", "write_csv",
           "read_csv", "plot_title", "plot_ratios", "format_table", "finish", "DTYPES"]

CAPTURE_LOCK = threading.Lock()
"""Virtual ranks capture CUDA graphs one at a time (concurrent captures crashed)."""
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16,
                                  "fp32": torch.float32}


# -- configuration, rows, registry ---------------------------------------------------------------

@dataclasses.dataclass
class BenchConfig:
    """What the CLI hands to a bench function.

    Attributes
    ----------
    world_sizes : tuple of int
        Virtual world sizes to run.
    dtype : torch.dtype
    dtype_name : str
        ``"bf16"``, ``"fp16"`` or ``"fp32"`` (as written to the CSV).
    quick : bool
        Tiny sizes and few repetitions (CPU smoke run).
    device : torch.device
    out_dir : pathlib.Path
    rounds, target_ms : int, float
        Timed rounds per measurement (median reported) and the duration one round aims for.
    only : tuple of str
        Cases a bench narrows itself to (``--only``; empty: all), e.g. ``tp``'s ops.
    timing : str
        ``"graph"`` (CUDA-graph replays, the default) or ``"eager"`` (``--timing``), for the
        benches that offer both.
    lowp_partials : bool
        ``--lowp-partials``: gemm_rs/gemm_ar partials in the input dtype (experimental,
        ``gemm._rs_launch.LOWP_PARTIALS``), for the benches that run them.
    """

    world_sizes: tuple[int, ...]
    dtype: torch.dtype
    dtype_name: str
    quick: bool
    device: torch.device
    out_dir: Path
    rounds: int
    target_ms: float
    only: tuple[str, ...] = ()
    timing: str = "graph"
    lowp_partials: bool = False


@dataclasses.dataclass
class Result:
    """One CSV row: one (case, world size, implementation) measurement against its baseline.

    Attributes
    ----------
    bench, case, impl : str
        Bench name, case label (message size, model, ...), implementation measured.
    world_size : int
    dtype : str
    time_us, baseline_us : float
        Ours and the baseline, microseconds per call (max across ranks, median over rounds).
    baseline : str
        What ``baseline_us`` measures.
    shape : str
        Shape label such as ``"8192x4096"``; ``m, n, k`` the GEMM-style fields (collectives use
        ``m`` rows x ``k`` columns), ``nbytes`` the message size, where they apply.
    model : str
        Models the case comes from (``shapes.LAYER_CONFIGS``), comma separated.
    extra : dict
        Further metrics (GB/s, errors, ...), one CSV column each.
    """

    bench: str
    case: str
    world_size: int
    dtype: str
    impl: str
    time_us: float
    baseline: str
    baseline_us: float
    shape: str = ""
    m: Optional[int] = None
    n: Optional[int] = None
    k: Optional[int] = None
    nbytes: Optional[int] = None
    model: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """``baseline_us / time_us``: above 1 means ours is faster."""
        if self.time_us > 0 and self.baseline_us > 0:
            return self.baseline_us / self.time_us
        return math.nan


def geo_mean_row(rows: Sequence[Result], case: str) -> Result:
    """A ``shape="geo-mean"`` row summarising ``rows`` (same bench, impl and baseline): the
    geometric mean of their ratios (rows without a positive ratio left out)."""
    logs = [math.log(r.ratio) for r in rows if r.ratio == r.ratio and r.ratio > 0]
    first = rows[0]
    return Result(first.bench, case, first.world_size, first.dtype, first.impl, 1.0,
                  first.baseline, math.exp(sum(logs) / len(logs)) if logs else math.nan,
                  shape="geo-mean")


@dataclasses.dataclass
class Bench:
    """A registered bench: ``fn(cfg) -> list[Result]``."""

    name: str
    fn: Callable[[BenchConfig], list[Result]]
    help: str
    world_sizes: tuple[int, ...]
    quick_world_sizes: tuple[int, ...]


BENCHES: dict[str, Bench] = {}
IMPORT_ERRORS: dict[str, str] = {}
_NOT_BENCHES = {"harness", "plots", "shapes"}


def register(name: str, *, help: str, world_sizes: Sequence[int] = (1, 2, 4, 8),
             quick_world_sizes: Sequence[int] = (1, 2)):
    """Decorator: make ``fn(cfg) -> list[Result]`` runnable as ``python -m ditron_ops.bench name``.

    ``name`` is the subcommand and the CSV ``bench`` column, ``help`` one line for ``list``;
    ``world_sizes`` / ``quick_world_sizes`` are the defaults without ``--world-sizes``.
    """
    def wrap(fn):
        old = BENCHES.get(name)
        if old is not None and old.fn.__module__ != fn.__module__:
            raise ValueError(f"ditron.bench: a bench named {name!r} is already registered")
        BENCHES[name] = Bench(name, fn, help, tuple(world_sizes), tuple(quick_world_sizes))
        return fn
    return wrap


def discover() -> dict[str, Bench]:
    """Import every bench module of this package (each registers itself) and return ``BENCHES``.

    A module that fails to import is recorded in ``IMPORT_ERRORS`` (shown by ``list``) instead of
    breaking the other benches.
    """
    package = __name__.rsplit(".", 1)[0]
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("_") or info.name in _NOT_BENCHES:
            continue
        try:
            importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:  # noqa: BLE001 - reported by ``list``
            IMPORT_ERRORS[info.name] = f"{type(exc).__name__}: {exc}"
    return BENCHES


# -- timing ----------------------------------------------------------------------------------------

def _timed_rounds(group, fn: Callable[[], Any], iters: int, rounds: int, device_clock: bool) -> float:
    """``rounds`` x (sync, barrier, clock, ``iters`` calls, clock); max over ranks, median of rounds."""
    per_round = []
    for _ in range(rounds):
        group.synchronize()
        group.barrier()
        if device_clock:
            stream = torch.cuda.current_stream(group.device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            for _ in range(iters):
                fn()
            end.record(stream)
            end.synchronize()
            per_round.append(begin.elapsed_time(end) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            group.synchronize()
            per_round.append((time.perf_counter() - t0) * 1e6 / iters)
    group.check()
    gathered = group.all_gather_object(per_round)
    return statistics.median(max(times[i] for times in gathered) for i in range(rounds))


def time_spmd(group, fn: Callable[[], Any], *, rounds: int = 10, target_ms: float = 25.0,
              max_iters: int = 1000) -> float:
    """Time ``fn()`` on every rank of ``group``; call it on all ranks (collective).

    Parameters
    ----------
    group : Group
        This rank's group (inside ``ditron_ops.launch``).
    fn : callable
        One call of the measured operation on this rank's current stream.
    rounds, target_ms, max_iters : int, float, int
        Timed rounds (each starts with a stream sync and a host barrier), the duration one round
        aims for (sets the iterations per round, the same on all ranks), and their cap.

    Returns
    -------
    float
        Microseconds per call: per round the max across ranks, then the median over rounds.
        CUDA events on the current stream on a GPU, ``time.perf_counter`` on CPU.
    """
    fn()
    group.synchronize()  # warm-up: compile, workspace growth
    group.barrier()
    start = time.perf_counter()
    fn()
    group.synchronize()
    estimate = max(group.all_gather_object(time.perf_counter() - start))
    iters = int(min(max_iters, max(1, target_ms * 1e-3 / max(estimate, 1e-9))))
    return _timed_rounds(group, fn, iters, rounds, device_clock=group.device.type == "cuda")


def _capture(group, fn: Callable[[], Any], target_ms: float, max_iters: int):
    """``(graph, iters)``: one CUDA graph of ``iters`` back-to-back ``fn()`` calls (``iters`` from
    an eager estimate, the same on every rank), captured one rank at a time."""
    fn()
    group.synchronize()
    estimate = _timed_rounds(group, fn, 3, 1, device_clock=True)  # max over ranks: same on all
    iters = int(min(max_iters, max(1, target_ms * 1e3 / max(estimate, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with CAPTURE_LOCK:  # virtual ranks capture one at a time (concurrent captures crashed)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(iters):
                fn()
    # Nobody launches waiting kernels while a peer still captures (a capture begins with a
    # device-wide synchronize, which would wait for them).
    group.barrier()
    return graph, iters


def graph_time_spmd(group, fn: Callable[[], Any], *, rounds: int = 10, target_ms: float = 25.0,
                    max_iters: int = 1000) -> float:
    """Microseconds per call of ``fn()`` replayed from one CUDA graph of back-to-back calls: the
    device time a decode loop run in graphs sees (no Python, dispatcher or launch overhead).

    Same protocol and result as ``time_spmd`` (which it is on CPU). ``fn`` must be capturable
    after one eager call; with several ranks per device each rank captures its own graph.
    """
    if group.device.type != "cuda":
        return time_spmd(group, fn, rounds=rounds, target_ms=target_ms, max_iters=max_iters)
    graph, iters = _capture(group, fn, target_ms, max_iters)
    return _timed_rounds(group, graph.replay, 1, rounds, device_clock=True) / iters


def paired_graph_times(group, fns: dict[str, Callable[[], Any]], *, rounds: int = 10,
                       target_ms: float = 25.0, max_iters: int = 1000) -> dict[str, float]:
    """``graph_time_spmd`` of several functions measured in turns: every graph is captured once,
    then ``rounds`` passes time one round of each, in order on even passes and in reverse on
    odd ones; each function's result is the median of its passes. Ratios between the functions
    then compare the GPU in one state: clocks and temperature drift over a long bench (timing a
    baseline and, later, ours in one block each moved ratios by up to 8% between runs), and a
    drift within a pass favours neither end of the order. History: benchmarks/NOTES.md, bench
    timing."""
    if group.device.type != "cuda":
        return {name: time_spmd(group, fn, rounds=rounds, target_ms=target_ms, max_iters=max_iters)
                for name, fn in fns.items()}
    for fn in fns.values():  # every workspace at its final size before any graph bakes one in
        fn()
    group.synchronize()
    graphs = [(name, _capture(group, fn, target_ms, max_iters)) for name, fn in fns.items()]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        for name, (graph, iters) in graphs if i % 2 == 0 else reversed(graphs):
            times[name].append(_timed_rounds(group, graph.replay, 1, 1, device_clock=True) / iters)
    return {name: statistics.median(t) for name, t in times.items()}


def warm_gpu(device: torch.device, seconds: float = 2.0) -> None:
    """Keep the GPU busy with large matmuls for ``seconds`` before the first measurement, so
    the first case is not timed while the clocks ramp up (an idle H200 was seen at 450 MHz; the
    first case of a bench then ran up to 6% slower than in a rerun)."""
    if device.type != "cuda":
        return
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            x @ x
        torch.cuda.synchronize(device)


def host_time_spmd(group, fn: Callable[[], Any], *, iters: int, rounds: int = 5,
                   warmup: int = 3) -> float:
    """Host wall time per call of ``iters`` back-to-back calls, device-synced on both ends.

    Same protocol as ``time_spmd`` but always with ``time.perf_counter``, so it includes Python,
    dispatcher and launch overhead. Collective: call on all ranks. Returns microseconds per call.
    """
    for _ in range(warmup):
        fn()
    return _timed_rounds(group, fn, iters, rounds, device_clock=False)


def rows_over_worlds(cfg: BenchConfig, body: Callable[..., list], *args) -> list:
    """``launch(body, W, cfg.device, args=args)`` for every W of ``cfg``; rank 0's rows, in order."""
    from ..runtime.virtual import launch

    rows: list = []
    for world in cfg.world_sizes:
        rows += launch(body, world, cfg.device, args=args)[0]
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# -- output ------------------------------------------------------------------------------------------

COMMIT: Optional[str] = None
"""The commit written to the CSVs when set (``--commit``): for copies whose git metadata is not
the source's (the lent GPU machine's checkout showed a stale commit for every run)."""


def _git_commit() -> str:
    """Short commit of the source (``-dirty`` with local changes), or ``COMMIT``."""
    if COMMIT:
        return COMMIT
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(device: torch.device) -> dict[str, str]:
    """Columns added to every CSV row: device, versions, git commit, UTC timestamp."""
    import triton

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        detail = f"cuda {torch.version.cuda}, {torch.cuda.device_count()} visible GPU(s)"
    else:
        name = f"CPU {_cpu_model()}"
        detail = f"cpu, {os.cpu_count()} cores, Triton interpreter"
    return {"device": device.type, "device_name": name, "device_detail": detail,
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "git_commit": _git_commit(),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


_MACHINE_COLUMNS = ["device", "device_name", "device_detail", "torch", "triton", "python",
                    "git_commit", "timestamp"]
"""The keys of ``machine_info`` (the last CSV columns)."""


_BASE_COLUMNS = ["bench", "case", "model", "world_size", "dtype", "shape", "m", "n", "k", "nbytes",
                 "impl", "time_us", "baseline", "baseline_us", "ratio"]


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def _extra_keys(results: Sequence[Result]) -> list[str]:
    return list(dict.fromkeys(k for r in results for k in r.extra))


def write_csv(results: Sequence[Result], path: Path, machine: dict[str, str]) -> Path:
    """Write one row per result: base columns, then every ``extra`` key, then ``machine``."""
    columns = _BASE_COLUMNS + _extra_keys(results) + list(machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for r in results:
            row = {c: _fmt(getattr(r, c)) for c in _BASE_COLUMNS}
            row.update({k: _fmt(v) for k, v in r.extra.items()})
            row.update(machine)
            writer.writerow(row)
    return path


def read_csv(path: Path) -> tuple[list[Result], dict[str, str]]:
    """``(results, machine)`` of a CSV written by ``write_csv`` (ratios recomputed from times)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    results = []
    for row in rows:
        def num(key, cast=float):
            return cast(row[key]) if row.get(key) not in (None, "") else None
        extra = {k: v for k, v in row.items()
                 if k not in _BASE_COLUMNS and k not in _MACHINE_COLUMNS and v != ""}
        results.append(Result(row["bench"], row["case"], int(row["world_size"]), row["dtype"],
                              row["impl"], num("time_us") or 0.0, row["baseline"],
                              num("baseline_us") or 0.0, shape=row["shape"], m=num("m", int),
                              n=num("n", int), k=num("k", int), nbytes=num("nbytes", int),
                              model=row["model"], extra=extra))
    machine = {k: rows[0][k] for k in _MACHINE_COLUMNS if rows and k in rows[0]}
    return results, machine


def _short(value: Any) -> str:
    """Compact number for the printed table (the CSV keeps 6 significant digits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    if isinstance(value, int) or value == 0 or not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def format_table(results: Sequence[Result]) -> str:
    """Aligned text table: case, W, impl, times, ratio and every extra metric."""
    extras = _extra_keys(results)
    header = ["case", "W", "impl", "ours_us", "base_us", "ratio"] + extras
    body = [[r.case, str(r.world_size), r.impl, f"{r.time_us:.1f}", f"{r.baseline_us:.1f}",
             _short(r.ratio)] + [_short(r.extra.get(k)) for k in extras] for r in results]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    left = {0, 2}
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def finish(bench: str, results: Sequence[Result], cfg: BenchConfig,
           stream=None) -> tuple[Path, Optional[Path]]:
    """Write ``<out>/<bench>-<dtype>-<device>[-quick].csv`` and ``.png``, print the table.

    Returns ``(csv_path, png_path or None)``.
    """
    stream = sys.stdout if stream is None else stream
    machine = machine_info(cfg.device)
    world = f"-w{os.environ['WORLD_SIZE']}" if started_by_torchrun() else ""  # a file per W
    stem = f"{bench}{world}-{cfg.dtype_name}-{cfg.device.type}" + ("-quick" if cfg.quick else "")
    csv_path = write_csv(results, cfg.out_dir / f"{stem}.csv", machine)
    baselines = ", ".join(dict.fromkeys(r.baseline for r in results))
    title = plot_title(bench, cfg.dtype_name, machine["device_name"], results)
    png_path = plot_ratios(results, cfg.out_dir / f"{stem}.png", title, machine) if results else None
    print(f"\n== {bench}: {len(results)} rows, {machine['device_name']} ({machine['device_detail']}), "
          f"torch {machine['torch']}, triton {machine['triton']}, commit {machine['git_commit']}",
          file=stream)
    print(f"   baseline: {baselines}", file=stream)
    print(format_table(results), file=stream)
    print(f"wrote {csv_path}" + (f" and {png_path}" if png_path else " (no matplotlib: no PNG)"),
          file=stream)
    return csv_path, png_path
