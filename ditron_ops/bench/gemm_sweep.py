"""Bench ``gemm_sweep``: our GEMM core (``matmul``, the consumer of ag_gemm and the producer of
gemm_rs / gemm_ar) against cuBLAS on shapes drawn by a seeded rule, not picked by hand.

Shapes (``sweep_shapes``): M, N, K log-uniform in [128, 16384], [256, 16384], [512, 16384]; a
third of the N drawn off the multiples of 128 and a third of the K off the multiples of 64 (all
multiples of 8: a bf16/fp16 row must be a multiple of 16 bytes for the TMA descriptors); shapes
under ``MIN_GFLOP`` are drawn again (the issue's floor: smaller GEMMs are host and launch bound,
and ``impl="auto"`` runs the fused ops only from 15 GFLOP). Each shape in bf16
and fp16, ``a [M, K] @ w.t()`` with ``w [N, K]`` (a Linear weight), CUDA-graph replays of ours
and cuBLAS in turns (``paired_graph_times``). Ours is ``matmul(a, b)``: the tiles and K
slices the rule (``gemm._core_configs.select_split``) picks for the shape, named in the rows'
``config`` and ``split_k`` (1: unsplit) columns. Rows: ``case = "sweep <dtype>"`` per shape, a
geo-mean row per dtype. Beside it, on the GPU:

- ``models <dtype>`` (``models_shapes``): tensor-parallel shards (TP 2/4/8) of eleven public
  dense models of eight families (``shapes.MODEL_CONFIGS``: QKV, O, gate/up and down), four
  per model, M log-uniform in [256, 16384] and a third of them off the multiples of 128.
  Targets: geo-mean >= 0.98x, none below 0.90x.
- ``deterministic bf16`` (``deterministic_shapes``): the batch-invariant core
  (``matmul(..., deterministic=True)``) at M in ``DETERMINISTIC_M`` on six model shards.
  Targets: geo-mean >= 0.92x over M <= 64, >= 0.95x at M >= 1024, none below 0.80x.
- ``registered <dtype>``: the registered layer shapes at M = 8192 (``shapes.LAYER_CONFIGS``,
  the ag_gemm / gemm_rs benches' local GEMMs). Target >= 1.0x.

``--only sweep`` / ``models`` / ``deterministic`` / ``registered`` runs one set (the sweep's
target: geo-mean >= 0.95x, none below 0.80x); the worst five of each set are printed.
``--only configs``: instead, bf16 only, every tile configuration of ``CANDIDATES`` on every
sweep shape (``case = "configs bf16"``, ``impl`` = the configuration): the data a shape-aware
rule is fitted to and checked against; ``--only configs,candidates``: the rule's candidates only;
``--only occupancy``: ``OCCUPANCY`` (two programs per SM) beside the rule's own choice
(``impl = "rule"``), on the sweep and the model shapes; it prints each compiled variant's
registers and shared memory; ``--only wide``: the same for ``WIDE_CANDIDATES`` (tiles 272, 288
and 320 columns wide) beside the 128x256 tiles; ``--only tail``: on the shapes whose 128x256
or 128x128 tiles leave a partial last wave (``tail_shapes``), those tiles (128x256 with and
without the half-tile tail) and with the last wave in ``TAIL_SLICES`` K slices
(``sliced_tail``), beside the rule's choice. ``--only splitk``: instead, bf16 only, the
split-K calibration (``splitk_shapes``: the sweep shapes where some candidate has fewer tiles
than the SMs): every such candidate with K forced into S in ``SPLITS`` slices (and the rule's
own choice), paired with cuBLAS (``case = "splitk bf16"``, ``impl = "<config> S=<slices>"``;
columns ``config``, ``split_k`` (the slices run), ``tiles``, ``pred_us`` (the model's time,
``_core_configs.split_time_us``), ``rule`` (1 on the rule's choice), ``rel_err``): what
``tools/gemm_rule_fit.py --splitk`` fits the split-K constants to. Write it apart from the sweep (``--out``): both are ``gemm_sweep-bf16-cuda.csv``.
``--quick`` (CPU, the interpreter): three tiny fp16 shapes, to test the plumbing (``--only
splitk``: two, forced splits).
"""
from __future__ import annotations

import dataclasses
import math
import random

import torch

from ..gemm import _core_configs as rules
from ..gemm._core import (GPU_CONFIGS, TileConfig, matmul, matmul_config, matmul_split,
                          program_budget)
from ..runtime.virtual import launch
from .harness import BenchConfig, Result, geo_mean_row, paired_graph_times, register, time_spmd
from .shapes import DEFAULT_M, DEFAULT_WORLD_SIZE, LAYER_CONFIGS, MODEL_CONFIGS, tp_shards

MIN_GFLOP = 8.0
"""Smallest sweep GEMM (2 M N K), issue 20's floor."""
SEED, COUNT = 20, 48
"""The sweep's seed and size (the issue asks for at least 40 shapes)."""
RANGES = {"m": (128, 16384), "n": (256, 16384), "k": (512, 16384)}
OFF_GRID = {"n": 128, "k": 64}
"""Dimensions drawn off these multiples a third of the time (tiles that do not divide them)."""


CANDIDATES = {**GPU_CONFIGS,
              "128x128x64/s4": TileConfig(128, 128, 64, 8, 8, 4),
              "128x128x64/s5/w4": TileConfig(128, 128, 64, 8, 4, 5),
              "64x256x64/s4": TileConfig(64, 256, 64, 8, 4, 4),
              "64x128x64/s6": TileConfig(64, 128, 64, 8, 4, 6),
              "128x256x32/s6": TileConfig(128, 256, 32, 8, 8, 6),
              "256x128x64/s3": TileConfig(256, 128, 64, 8, 8, 3)}
"""Tile configurations ``--only configs`` measures: the tuned ones and smaller or other-shaped
tiles for small N and M, and K that 64 does not divide; every candidate of the rule
(``gemm._core_configs.GPU_CANDIDATES``) among them."""
OCCUPANCY = {"128x256x64/s4/tail": GPU_CONFIGS["128x256x64/s4/tail"],
             "128x128x64/s3/o2": TileConfig(128, 128, 64, 8, 8, 3, ctas_per_sm=2),
             "128x128x64/s3/w4/o2": TileConfig(128, 128, 64, 8, 4, 3, ctas_per_sm=2),
             "128x128x64/s3/tail/o2": TileConfig(128, 128, 64, 8, 8, 3, split_tail=True,
                                                 ctas_per_sm=2),
             "64x256x64/s2/o2": TileConfig(64, 256, 64, 8, 4, 2, ctas_per_sm=2),
             "64x128x64/s4/o2": TileConfig(64, 128, 64, 8, 4, 4, ctas_per_sm=2),
             "128x64x64/s4/o2": TileConfig(128, 64, 64, 8, 4, 4, ctas_per_sm=2)}
"""What ``--only occupancy`` measures beside the rule: two programs per SM (``ctas_per_sm``),
tiles whose stages fit half an SM's shared memory, against the rule's large tiles."""
SPLITS = (1, 2, 4, 8)
"""K slices ``--only splitk`` forces on every candidate under one wave (``rules.MAX_SPLIT``)."""


def _draw(rng: random.Random, name: str) -> int:
    lo, hi = RANGES[name]
    value = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))) / 8)) * 8
    grid = OFF_GRID.get(name)
    if grid and rng.random() < 1 / 3:
        value = value // grid * grid + 8 * rng.randrange(1, grid // 8)  # a multiple of 8, not of grid
    elif grid:
        value = max(grid, value // grid * grid)
    return max(lo, min(hi, value))


def sweep_shapes(seed: int = SEED, count: int = COUNT, min_gflop: float = MIN_GFLOP) -> list[tuple[int, int, int]]:
    """``count`` distinct ``(M, N, K)`` of the seeded rule (module docstring)."""
    rng = random.Random(seed)
    shapes: list[tuple[int, int, int]] = []
    while len(shapes) < count:
        shape = (_draw(rng, "m"), _draw(rng, "n"), _draw(rng, "k"))
        if 2 * shape[0] * shape[1] * shape[2] >= min_gflop * 1e9 and shape not in shapes:
            shapes.append(shape)
    return shapes


MODELS_SEED, MODELS_PER_CONFIG = 39, 4
"""The ``models`` set's seed and shapes per model config (44 in all)."""
MODELS_M = (256, 16384)
DETERMINISTIC_M = (1, 4, 16, 64, 256, 1024, 8192)
DETERMINISTIC_SHARDS = 6
SETS = ("sweep", "models", "deterministic", "registered")
"""The row sets of the default run (``--only <set>``: that one)."""


def _draw_m(rng: random.Random) -> int:
    """M log-uniform in ``MODELS_M``: a third of the draws any integer (off the multiples of
    128, as a batch of ragged requests is), the rest rounded to a multiple of 128."""
    lo, hi = MODELS_M
    value = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if rng.random() < 1 / 3:
        m = int(value)
        return m + 1 if m % 128 == 0 else m
    return max(lo, min(hi, int(round(value / 128)) * 128))


def models_shapes(seed: int = MODELS_SEED, per_config: int = MODELS_PER_CONFIG
                  ) -> dict[tuple[int, int, int], str]:
    """``{(M, N, K): "<model> tp<t> <layer>"}``: ``per_config`` draws per ``MODEL_CONFIGS``
    entry of a TP degree and layer (its shard's N, K) and an M (``_draw_m``); seeded."""
    rng = random.Random(seed)
    out: dict[tuple[int, int, int], str] = {}
    for cfg in MODEL_CONFIGS.values():
        options = [(tp, layer, nk) for tp in (2, 4, 8) for layer, nk in cfg.shards(tp).items()]
        drawn = 0
        while drawn < per_config:
            tp, layer, (n, k) = rng.choice(options)
            shape = (_draw_m(rng), n, k)
            if shape not in out:
                out[shape] = f"{cfg.name} tp{tp} {layer}"
                drawn += 1
    return out


def deterministic_shapes(seed: int = MODELS_SEED) -> dict[tuple[int, int, int], str]:
    """``{(M, N, K): name}``: ``DETERMINISTIC_SHARDS`` model shards (seeded, of distinct
    (N, K)) at every M of ``DETERMINISTIC_M``."""
    rng = random.Random(seed + 1)
    shards = sorted(tp_shards().items())
    picked = rng.sample(shards, DETERMINISTIC_SHARDS)
    return {(m, n, k): names[0] for (n, k), names in picked for m in DETERMINISTIC_M}


def _model_shapes() -> dict[tuple[int, int, int], str]:
    """The registered layers' local GEMMs at M = 8192: ``[M, K] @ [K, N / 8]``."""
    shapes: dict[tuple[int, int, int], str] = {}
    for name, s in LAYER_CONFIGS.items():
        key = (DEFAULT_M, s.n // DEFAULT_WORLD_SIZE, s.k)
        shapes[key] = f"{shapes[key]},{name}" if key in shapes else name
    return shapes


def _inputs(group, m: int, n: int, k: int, dtype: torch.dtype):
    """``(a [M, K], w.t())`` of a seeded Linear problem."""
    gen = torch.Generator(device="cpu").manual_seed(m * 7 + n * 3 + k)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=group.device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=group.device)
    return a, w.t()


def configs_measured(only: tuple[str, ...]) -> dict[str, TileConfig]:
    """What ``--only configs`` times: every ``CANDIDATES`` entry, or with ``candidates`` only the
    rule's own (``GPU_CANDIDATES``: what its efficiencies are fitted to, in a third of the time)."""
    if "candidates" in only:
        return {c.name: c.cfg for c in rules.GPU_CANDIDATES}
    if "occupancy" in only:
        return OCCUPANCY
    if "wide" in only:
        return {rules.GPU_CONFIG: GPU_CONFIGS[rules.GPU_CONFIG],
                **{c.name: c.cfg for c in rules.WIDE_CANDIDATES}}
    if "tail" in only:
        out = {rules.GPU_CONFIG: GPU_CONFIGS[rules.GPU_CONFIG]}
        for main in (rules.SLICED_TAIL_MAIN, rules.GPU_CANDIDATES[1]):  # (128x256, 128x128)
            out[main.name] = main.cfg
            out.update({f"{main.name}/kt{s}": dataclasses.replace(main.cfg, tail_slices=s)
                        for s in TAIL_SLICES})
        return out
    return CANDIDATES


TAIL_SLICES = (2, 3, 4, 6, 8)
"""K slices ``--only tail`` forces on the partial last wave (``sliced_tail``'s range)."""


def tail_shapes(programs: int, shapes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The shapes whose 128x256 or 128x128 tiles fill one wave of ``programs`` or more and leave
    a partial last one (what a sliced tail can shorten)."""
    out = []
    for m, n, k in shapes:
        for cfg in (rules.SLICED_TAIL_MAIN.cfg, rules.GPU_CANDIDATES[1].cfg):
            tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            if tiles >= programs and tiles % programs:
                out.append((m, n, k))
                break
    return out


def _configs(group, cfg: BenchConfig, m: int, n: int, k: int) -> list[Result]:
    """The ``configs_measured`` configurations on one shape, bf16, paired with cuBLAS."""
    a, b = _inputs(group, m, n, k, torch.bfloat16)
    fns = {"cublas": lambda: torch.matmul(a, b)}
    if {"occupancy", "wide", "tail"} & set(cfg.only):
        fns["rule"] = lambda: matmul(a, b, deterministic=False)
    ref = torch.matmul(a, b).float()
    for name, tc in configs_measured(cfg.only).items():
        try:  # a configuration that does not fit (shared memory, registers) is reported and left out
            err = ((matmul(a, b, cfg=tc).float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:
                print(f"configs: {name} on {m}x{n}x{k} wrong: rel err {err:.2e}", flush=True)
                continue
        except Exception as exc:  # noqa: BLE001
            print(f"configs: {name} on {m}x{n}x{k} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        fns[name] = lambda tc=tc: matmul(a, b, cfg=tc)
    times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
    return [Result("gemm_sweep", "configs bf16", 1, "bf16", name, times[name], "cuBLAS torch.matmul",
                   times["cublas"], shape=f"{m}x{n}x{k}", m=m, n=n, k=k,
                   extra={"tflops": round(2 * m * n * k / times[name] / 1e6, 1)})
            for name in fns if name != "cublas"]


def splitk_shapes(programs: int, device: torch.device,
                  shapes: list[tuple[int, int, int]] | None = None) -> list[tuple[int, int, int]]:
    """The sweep shapes (or ``shapes``) where the split rule weighs a split on ``programs``:
    some candidate of ``select``'s has fewer tiles than ``programs`` (17 of the 48 at 132)."""
    return [s for s in (sweep_shapes() if shapes is None else shapes)
            if rules.split_options(*s, programs, device, deterministic=False)]


def _splitk(group, cfg: BenchConfig, m: int, n: int, k: int, dtype: torch.dtype,
            dtype_name: str) -> list[Result]:
    """One shape of ``--only splitk``: every candidate the rule would split (and its unsplit
    choice) at each of ``SPLITS`` (as ``rules.slices`` leaves them) plus the rule's own
    choice, in one paired run with cuBLAS; each checked against the fp32 product."""
    a, b = _inputs(group, m, n, k, dtype)
    device, budget = group.device, program_budget(group.device, None)
    first = rules.select(m, n, budget, device, deterministic=False)
    chosen, rule_s = rules.select_split(m, n, k, budget, device, deterministic=False)
    cands = [first] + [c for c, _ in rules.split_options(m, n, k, budget, device,
                                                         deterministic=False)]
    runs = {}  # impl name -> (candidate, slices)
    for c in dict.fromkeys(cands):
        for s in SPLITS if cfg.device.type == "cuda" else SPLITS[:3]:
            used = rules.slices(k, c.cfg.block_k, s)[0]
            runs.setdefault(f"{c.name} S={used}", (c, used))
    runs.setdefault(f"{chosen.name} S={rule_s}", (chosen, rule_s))
    ref = torch.matmul(a.float(), b.float())
    fns, errs = {"cublas": lambda: torch.matmul(a, b)}, {}
    for name, (c, s) in runs.items():
        fns[name] = lambda c=c, s=s: matmul(a, b, cfg=c.cfg, split_k=s, deterministic=False)
        got = fns[name]().float()
        errs[name] = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
    rows = []
    for name, (c, s) in runs.items():
        tiles = -(-m // c.cfg.block_m) * -(-n // c.cfg.block_n)
        pred = rules.split_time_us(c, m, n, k, budget, s)
        rows.append(Result("gemm_sweep", f"splitk {dtype_name}", 1, dtype_name, name,
                           times[name], "cuBLAS torch.matmul", times["cublas"],
                           shape=f"{m}x{n}x{k}", m=m, n=n, k=k,
                           extra={"tflops": round(2 * m * n * k / times[name] / 1e6, 1),
                                  "rel_err": f"{errs[name]:.1e}", "config": c.name,
                                  "split_k": s, "tiles": tiles, "pred_us": round(pred, 2),
                                  "rule": int((c, s) == (chosen, rule_s))}))
    best = min(rows, key=lambda r: r.time_us)
    rule = next(r for r in rows if r.extra["rule"])
    print(f"splitk {m}x{n}x{k}: rule {rule.impl} {rule.time_us:.1f} us (model "
          f"{rule.extra['pred_us']}), best {best.impl} {best.time_us:.1f} us, cuBLAS "
          f"{times['cublas']:.1f} us", flush=True)
    return rows


def _print_compiled() -> None:
    """Registers, spills and shared memory of every persistent GEMM variant compiled so far (an
    ``/o2`` variant holds two programs per SM only within half the SM's registers and memory)."""
    from ..gemm._core_kernels import persistent_gemm_kernel
    idx = {name: i for i, name in enumerate(persistent_gemm_kernel.arg_names)}
    for caches in getattr(persistent_gemm_kernel, "device_caches", {}).values():
        for kernel in caches[0].values():
            consts = kernel.src.constants
            tiles = [consts.get((idx[n],), consts.get(n)) for n in ("BLOCK_M", "BLOCK_N", "SPLIT_TAIL")]
            print(f"compiled: tiles {tiles} warps {kernel.metadata.num_warps} stages "
                  f"{kernel.metadata.num_stages} shared {kernel.metadata.shared} regs "
                  f"{getattr(kernel, 'n_regs', '?')} spills {getattr(kernel, 'n_spills', '?')}",
                  flush=True)


def _measure(group, cfg: BenchConfig, case: str, m: int, n: int, k: int, dtype: torch.dtype,
             dtype_name: str, model: str = "", deterministic: bool = False) -> Result:
    a, b = _inputs(group, m, n, k, dtype)
    ref = torch.matmul(a.float(), b.float())  # rel_err against fp32 on every device
    got = matmul(a, b, deterministic=deterministic)  # (the mode named, whatever the context)
    err = ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    if group.device.type == "cuda":
        times = paired_graph_times(group, {"cublas": lambda: torch.matmul(a, b),
                                           "ours": lambda: matmul(a, b, deterministic=deterministic)},
                                   rounds=cfg.rounds, target_ms=cfg.target_ms)
        ours, base = times["ours"], times["cublas"]
    else:  # the interpreter: plumbing only
        ours = time_spmd(group, lambda: matmul(a, b, deterministic=deterministic), rounds=1,
                         max_iters=1)
        base = time_spmd(group, lambda: torch.matmul(a, b), rounds=1, max_iters=1)
    return Result("gemm_sweep", case, 1, dtype_name, "triton persistent TMA", ours, "cuBLAS torch.matmul",
                  base, shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=model,
                  extra={"tflops": round(2 * m * n * k / ours / 1e6, 1), "rel_err": f"{err:.1e}",
                         "config": matmul_config(a, b, deterministic=deterministic),
                         "split_k": matmul_split(a, b, deterministic=deterministic)})


def _set(group, cfg: BenchConfig, case: str, shapes: dict, dtype: torch.dtype, dtype_name: str,
         deterministic: bool = False) -> list[Result]:
    """One set's rows, its geo-mean row, and its worst five printed."""
    rows = [_measure(group, cfg, case, m, n, k, dtype, dtype_name, model, deterministic)
            for (m, n, k), model in shapes.items()]
    worst = sorted(rows, key=lambda r: r.ratio)[:5]
    print(f"{case}: worst five " + ", ".join(f"{r.shape} {r.ratio:.3f}" for r in worst), flush=True)
    return rows + [geo_mean_row(rows, case)]


@register("gemm_sweep", help="GEMM core vs cuBLAS: 48 seeded shapes (sweep), 44 tensor-parallel "
                             "shards of 11 public models (models), the batch-invariant core at M "
                             "1-8192 (deterministic), the registered layers (registered)",
          world_sizes=(1,), quick_world_sizes=(1,))
def run(cfg: BenchConfig) -> list[Result]:
    gpu = cfg.device.type == "cuda"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16} if gpu else {"fp16": torch.float16}
    shapes = sweep_shapes() if not cfg.quick else [(64, 48, 40), (96, 64, 72), (33, 80, 64)]
    out: list[Result] = []

    def body(group):
        if "splitk" in cfg.only:
            todo = (splitk_shapes(program_budget(group.device, None), group.device) if gpu
                    else [(40, 48, 200), (33, 80, 136)])  # (the interpreter: no waves; forced)
            print(f"splitk: {len(todo)} shapes", flush=True)
            name, dtype = ("bf16", torch.bfloat16) if gpu else ("fp16", torch.float16)
            for m, n, k in todo:
                out.extend(_splitk(group, cfg, m, n, k, dtype, name))
            return
        if {"configs", "occupancy", "wide", "tail"} & set(cfg.only):
            if not gpu:
                raise SystemExit("ditron.bench gemm_sweep --only configs: needs a CUDA GPU")
            extra = (list(_model_shapes()) if {"occupancy", "wide", "tail"} & set(cfg.only)
                     else [])
            todo = shapes + extra
            if "tail" in cfg.only:
                todo = tail_shapes(program_budget(group.device, None), todo)
            for m, n, k in todo:
                out.extend(_configs(group, cfg, m, n, k))
            _print_compiled()
            return
        sets = [s for s in SETS if s in cfg.only] or list(SETS)
        if not gpu or cfg.quick:  # the interpreter: the sweep's plumbing, and one model shard
            sets = [s for s in sets if s in ("sweep", "models")]
        for name, dtype in dtypes.items():
            if "sweep" in sets:
                out.extend(_set(group, cfg, f"sweep {name}", dict.fromkeys(shapes, ""), dtype, name))
            if "models" in sets:
                todo = models_shapes() if gpu and not cfg.quick else {(40, 96, 64): "quick"}
                out.extend(_set(group, cfg, f"models {name}", todo, dtype, name))
            if "registered" in sets:
                out.extend(_set(group, cfg, f"registered {name}", _model_shapes(), dtype, name))
        if "deterministic" in sets:
            name = "bf16"
            out.extend(_set(group, cfg, f"deterministic {name}", deterministic_shapes(),
                            dtypes[name], name, deterministic=True))

    launch(body, 1, cfg.device)
    return out
