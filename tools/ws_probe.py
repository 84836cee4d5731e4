"""Probe of the warp-specialized Gluon GEMM (``ditron_ops/gemm/_ws_kernels.py``, host side
``_ws_launch.py``) on an H200.

Checks every variant of ``WS_CONFIGS`` on integer-valued operands (exact against torch in fp32:
small integers, so every product and partial sum is exact and both sides round the same fp32
value), then times it against cuBLAS (``torch.matmul``) by paired CUDA-graph replay::

    python tools/ws_probe.py --out DIR          # GPU: correctness, timing, table, DIR/ws_probe.csv
    python tools/ws_probe.py --compile-only     # no GPU: compile all variants for sm_90a and
                                                # report registers, spills, HGMMA, shared memory
    python tools/ws_probe.py --partials         # GPU: fp32 partial traffic, "reg" vs "tma"
                                                # (reduce step alone, then the few-tile GEMMs)
    python tools/ws_probe.py --timeline         # GPU: where each schedule's time goes on the
                                                # few-tile shapes (consumers' timer stamps)

Options: ``--variants a,b`` (default all), ``--no-tl`` (skip the portable ``tl`` core column),
``--rounds N``, ``--quick`` (fewer shapes). A variant name ending in ``@tma`` forces
``partials="tma"`` (``_ws_configs.PARTIALS``) on its plan.

``--partials`` (the partial-traffic question, one short run): (1) the reduce step alone
(``--partials-only`` stops after it): ``ws_reduce_kernel`` over ``[split, M, N]`` planes
against ``ws_reduce_tma_kernel`` over line-padded planes, and a device copy of the same bytes
as the speed of L2, in GB/s of (partials read + C written), planes warm in L2 as in the GEMM;
(2) integer checks of the ``@tma`` variants; (3) the few-tile shapes of NOTES (``FEW_TILE_SHAPES``)
timed with each partial-moving schedule in both forms (``PARTIALS_VARIANTS``), each ``@tma``
output compared bitwise with its ``reg`` twin (same slice order: must be equal).

Timing: per shape, one graph of up to 20 calls per contender (cuBLAS, each variant, the ``tl``
core), inputs rotated over enough buffer sets to exceed L2; graphs replayed alternately; the
median per-call time over the rounds. Ratio = t_cublas / t_ours (> 1: faster than cuBLAS).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ditron_ops.testing.sm90 import use_sm90_stand_in_driver  # noqa: E402

CHECK_SHAPES = [(1000, 2560, 2560), (517, 4480, 5120), (4808, 272, 14080), (64, 4096, 4096),
                (129, 136, 72), (2100, 7000, 648)]
"""Correctness shapes (M, N, K): ragged M, N, K; one tile-column; a K tail of one short step;
enough tiles for stream-K after data-parallel waves."""

MODEL_NK = [
    ("llama3-8b/tp4", 1536, 4096), ("llama3-8b/tp4", 4096, 1024),
    ("llama3-8b/tp4", 3584, 4096), ("llama3-8b/tp4", 4096, 3584),
    ("mistral-l2/tp8", 1792, 12288), ("mistral-l2/tp8", 12288, 1536),
    ("mistral-l2/tp8", 3584, 12288), ("mistral-l2/tp8", 12288, 3584),
    ("gemma2-27b/tp8", 576, 4608), ("gemma2-27b/tp8", 9216, 4608),
    ("qwen2-72b/tp8", 7392, 8192), ("qwen2-72b/tp8", 8192, 3696),
]
"""TP shards (N, K) of public models' linear layers (QKV, O, gate+up, down)."""
MODEL_M = (512, 1000, 2048, 3000, 4096)
FEW_TILE_SHAPES = [("few-tile", 4096, 576, 4608), ("few-tile", 3000, 1536, 4096),
                   ("few-tile", 696, 5072, 11304), ("few-tile", 512, 576, 4608),
                   ("few-tile", 512, 1792, 12288), ("partial-wave", 1000, 1536, 4096),
                   ("partial-wave", 3000, 1792, 12288), ("partial-wave", 3000, 3584, 4096)]
"""Few tiles / a partial last wave (benchmarks/NOTES.md, the WS core's status; the last three:
model shards at 0.80, 0.87, 0.88 in ``probes/ws_probe-bf16-cuda.csv``)."""
PARTIALS_VARIANTS = ("auto", "auto@tma", "coop128x256:sk", "coop128x256:sk@tma", "pp128x128:split3",
                     "pp128x128:split3@tma", "pp64x128:splitr3", "pp64x128:splitr3@tma",
                     "pp64x128:splitr4", "pp64x128:splitr4@tma")
"""``--partials``: every schedule that moves partials, in both forms (``auto`` for scale)."""
REDUCE_SPLITS = (2, 3, 4, 8)
RANDOM_SHAPES = 10
RANDOM_SEED = 39
L2_SPAN = 128 << 20
"""Bytes the rotated buffer sets of one shape span at least (H200 L2: 50 MB)."""
GRAPH_CALLS = 20
GRAPH_TARGET_S = 3e-3
"""Calls per graph shrink below ``GRAPH_CALLS`` so that one replay takes about this long."""
HANG_S = float(os.environ.get("WS_PROBE_HANG_S", "60"))
"""Silence (no progress) after which the watchdog ends the process: a barrier-phase bug hangs
the kernel and the CUDA context cannot be recovered."""
DEADLINE_S = 320.0
"""Timing stops after this many seconds of the run (the table still prints; the lead's limit
is 6 minutes including compiles)."""

_last_progress = [time.time()]


def touch() -> None:
    """Tell the watchdog the probe is alive."""
    _last_progress[0] = time.time()


def log(*args) -> None:
    touch()
    print(*args, flush=True)


def _start_watchdog() -> None:
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            if time.time() - _last_progress[0] > HANG_S:
                print(f"HANG: no progress for {HANG_S:.0f} s (a kernel never finished); exiting",
                      flush=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _short(dtype) -> str:
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}[str(dtype)]


# --------------------------------------------------------------------------------------------
# Compile only (CPU)
# --------------------------------------------------------------------------------------------



@functools.lru_cache(maxsize=None)
def _ws_module():
    """``_ws_launch`` (with ``_ws_kernels`` and ``_ws_configs``' names)."""
    import importlib
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return importlib.import_module("ditron_ops.gemm._ws_launch")


def variant_plan(ws, name, M, N, K, in_bytes=2, out_bytes=2, sms=132):
    """Plan of probe variant ``name``: ``auto`` (the rule), ``det`` (deterministic mode),
    ``CFG`` (rule's schedule with that config), ``CFG:dp`` / ``CFG:sk`` / ``CFG:splitS`` /
    ``CFG:splitrS`` (forced schedule); ``[+padX][/stN][@tma]`` suffixes force row copies,
    stages, ``partials="tma"``."""
    name, tma, _ = name.partition("@tma")
    part = dict(partials="tma") if tma else {}
    if name == "auto":
        return ws.plan(M, N, K, in_bytes, out_bytes, sms, **part)
    if name == "det":
        return ws.plan(M, N, K, in_bytes, out_bytes, sms, deterministic=True, **part)
    name, _, st = name.partition("/st")  # CFG[:mode][+padX][/stN]: forced copies, stages
    name, _, pad = name.partition("+pad")
    kw = dict(pad=pad if _ else None, stages=int(st) if st else None, **part)
    if name == "auto":
        return ws.plan(M, N, K, in_bytes, out_bytes, sms, **kw)
    cfg, _, mode = name.partition(":")
    if mode.startswith("splitr"):
        return ws.plan(M, N, K, in_bytes, out_bytes, sms, variant=cfg, mode=ws.MODE_SPLITR,
                       split=int(mode[6:]), **kw)
    if mode.startswith("split"):
        return ws.plan(M, N, K, in_bytes, out_bytes, sms, variant=cfg, mode=ws.MODE_SPLIT,
                       split=int(mode[5:]), **kw)
    mode = {"": None, "dp": ws.MODE_DP, "sk": ws.MODE_SK}[mode]
    return ws.plan(M, N, K, in_bytes, out_bytes, sms, variant=cfg, mode=mode, **kw)


def _sass_stats(kernel) -> dict:
    """Registers and spills (ptxas -v on the PTX), HGMMA and local-memory counts (SASS)."""
    import re
    import subprocess
    import tempfile

    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        cubin = os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as fh:
            fh.write(kernel.asm["ptx"])
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx,
                               "-o", cubin], capture_output=True, text=True, check=True).stderr
        with open(cubin, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    hgmma = sorted(set(re.findall(r"[HQ]GMMA\.\S+", sass)))  # (QGMMA: fp8)
    setmax = sorted(set(int(x, 16) for x in re.findall(r"USETMAXREG\.\S+ \S*?,? ?(0x[0-9a-f]+)",
                                                        sass)))
    return dict(regs=regs, spills=spills, hgmma=len(re.findall(r"\b[HQ]GMMA\.", sass)),
                hgmma_kinds=hgmma, local=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
                setmaxnreg=setmax)


def compile_only(variants) -> int:
    import torch
    use_sm90_stand_in_driver()
    ws = _ws_module()
    log(f"compile-only: triton sm_90a, variants {', '.join(variants)}")
    log(f"{'variant':<12} {'in':<4} {'B':<6} {'bias':<4} {'C':<4} {'st':>2} {'smem':>6} "
        f"{'regs':>4} {'spill':>5} {'LDL/STL':>7} {'HGMMA':>5}  setmaxnreg  kinds  (s)")
    bad = 0
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    combos = [(bf16, False, False, bf16), (bf16, True, True, fp32),
              (fp16, False, True, fp16), (fp16, True, False, fp32)]
    for name in variants:
        for dt, b_kn, has_bias, out_dt in combos:
            M, N, K = 1000, 2560, 2560
            cfg_plan = variant_plan(ws, name, M, N, K, dt.itemsize, out_dt.itemsize)
            a = torch.empty(M, K, dtype=dt)
            b = torch.empty(K, N, dtype=dt) if b_kn else torch.empty(N, K, dtype=dt).t()
            out = torch.empty(M, N, dtype=out_dt)
            bias = torch.empty(N, dtype=dt) if has_bias else None
            t0 = time.time()
            try:
                args, meta = ws.ws_operands(a, b, out, bias, cfg_plan)
                kernel = ws.ws_gemm_kernel.warmup(*args, **meta, grid=(cfg_plan.grid, ))
                st = _sass_stats(kernel)
                if cfg_plan.mode == ws.MODE_SPLITR:  # and the reduce kernel
                    rgrid, rargs, rmeta = ws.ws_reduce_operands(out, bias, cfg_plan, args[4])
                    ws.reduce_kernel(cfg_plan).warmup(*rargs, **rmeta, grid=rgrid)
            except Exception as exc:  # report and go on: the other variants still say something
                bad += 1
                log(f"{name:<12} {_short(dt):<4} {'kn' if b_kn else 'w.t()':<6} FAILED: "
                    f"{type(exc).__name__}: {str(exc)[:300]}")
                continue
            ok = st["spills"] == 0 and st["local"] == 0 and st["hgmma"] > 0
            bad += not ok
            log(f"{name[:12]:<12} {_short(dt):<4} {'kn' if b_kn else 'w.t()':<6} "
                f"{'y' if has_bias else 'n':<4} {_short(out_dt):<4} {meta['STAGES']:>2} "
                f"{kernel.metadata.shared:>6} {st['regs']:>4} {st['spills']:>5} {st['local']:>7} "
                f"{st['hgmma']:>5}  {'/'.join(map(str, st['setmaxnreg'])):<10} "
                f"{','.join(k[6:] for k in st['hgmma_kinds'])}  ({time.time() - t0:.1f})")
    log("compile-only: " + ("all variants compile, no spills, HGMMA present" if not bad
                            else f"{bad} problem(s)"))
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------

def _sync(what: str) -> None:
    """Synchronize, naming ``what`` if the watchdog fires meanwhile."""
    import torch
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > HANG_S - 5:
            log(f"HANG: {what} did not finish")
            os._exit(3)
        time.sleep(1e-4)
    touch()


def _ints(shape, dtype, gen):
    import torch
    return torch.randint(-2, 3, shape, generator=gen, device="cuda").to(dtype)


def check(ws, variants) -> dict:
    """Exact integer checks per variant; returns ``{variant: failures}``."""
    import torch
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    # Every (dtype, B layout, bias) with both C dtypes across them: 8 compiles per variant.
    combos = [(dt, b_kn, has_bias,
               dt if (b_kn + has_bias + (dt == torch.float16)) % 2 else torch.float32)
              for dt in (torch.bfloat16, torch.float16)
              for b_kn in (False, True)
              for has_bias in (False, True)]
    fails = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in variants:
        n_fail = n_run = 0
        t0 = time.time()
        for M, N, K in CHECK_SHAPES:
            for dt, b_kn, has_bias, out_dt in combos:
                a = _ints((M, K), dt, gen)
                b = _ints((K, N), dt, gen) if b_kn else _ints((N, K), dt, gen).t()
                bias = _ints((N, ), dt, gen) if has_bias else None
                out = torch.full((M, N), float("nan"), dtype=out_dt, device="cuda")
                pl = variant_plan(ws, name, M, N, K, dt.itemsize, out_dt.itemsize, sms)
                cfg = pl.cfg
                tag = (f"{name} [{ws.describe(pl)}] {M}x{N}x{K} {_short(dt)} "
                       f"{'kn' if b_kn else 'w.t()'} bias={int(has_bias)} C={_short(out_dt)}")
                try:
                    ws.ws_matmul(a, b, out, bias, plan_=pl)
                    _sync(tag)
                except Exception as exc:
                    n_fail += 1
                    log(f"  ERROR {tag}: {type(exc).__name__}: {str(exc)[:400]}")
                    if "CUDA error" in str(exc) or "illegal" in str(exc):
                        log("the CUDA context is lost; exiting")
                        os._exit(4)
                    continue
                ref = a.float() @ b.float()
                if bias is not None:
                    ref += bias.float()
                ref = ref.to(out_dt)
                n_run += 1
                touch()
                if not torch.equal(out, ref):
                    n_fail += 1
                    diff = (out.float() - ref.float()).abs().nan_to_num(float("inf"))
                    bad = (diff > 0).nonzero()
                    r, c = bad[0].tolist()
                    log(f"  FAIL {tag}: {bad.shape[0]} wrong, max |diff| {diff.max().item():.3g}, "
                        f"first at ({r}, {c}) tile ({r // cfg.block_m}, {c // cfg.block_n}); "
                        f"rows {bad[:, 0].min().item()}..{bad[:, 0].max().item()}, "
                        f"cols {bad[:, 1].min().item()}..{bad[:, 1].max().item()}")
        n_fail += _check_repeat(ws, name, sms, gen)
        fails[name] = n_fail
        log(f"check {name}: {n_run} runs, {n_fail} failed ({time.time() - t0:.1f} s)")
    return fails


def _check_repeat(ws, name, sms, gen) -> int:
    """Float inputs: bitwise equal run to run (fixed-order reductions); for ``det`` also batch
    invariance (``op(x[:m])`` equals ``op(x)[:m]`` bitwise). Returns the failures."""
    import torch
    bad = 0
    M, N, K = 1000, 1536, 4096
    a = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, generator=gen, device="cuda").to(torch.bfloat16)
    pl = variant_plan(ws, name, M, N, K, 2, 2, sms)
    ref = ws.ws_matmul(a, w.t(), plan_=pl)
    for _ in range(3):
        if not torch.equal(ws.ws_matmul(a, w.t(), plan_=pl), ref):
            bad += 1
            log(f"  FAIL {name} [{ws.describe(pl)}]: not bitwise equal run to run")
            break
    if name == "det":
        for m in (1, 7, 64, 129, 500, 999):
            part = ws.ws_matmul(a[:m], w.t(), deterministic=True)
            if not torch.equal(part, ref[:m]):
                bad += 1
                log(f"  FAIL det: rows 0..{m} differ from the full batch's")
    _sync(f"{name} repeat")
    return bad


def timing_shapes(quick: bool, seeds=(RANDOM_SEED, ), model: bool = True):
    shapes = [(tag, M, N, K) for tag, N, K in MODEL_NK for M in MODEL_M] if model else []
    if quick:
        shapes = shapes[::3]
    for seed in seeds:
        shapes += _random_shapes(seed, RANDOM_SHAPES // (2 if quick else 1))
    return shapes


def _random_shapes(seed, n):
    import random
    rng = random.Random(seed)
    dims = lambda: next(x for x in iter(lambda: rng.randint(32, 2048) * 8, None) if x % 128)
    return [(f"random/s{seed}", dims(), dims(), dims()) for _ in range(n)]


def _graph(fn, calls):
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(calls, 3)):  # warm-up outside the graph (compiles, cuBLAS heuristics)
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    _sync("graph warm-up")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return g


def time_shape(ws, variants, M, N, K, rounds, tl_matmul):
    """Per-call seconds of each contender (cuBLAS, variants, tl core) on one shape."""
    import torch
    dt = torch.bfloat16
    set_bytes = 2 * (M * K + N * K + M * N)
    sets = max(1, min(GRAPH_CALLS, math.ceil(L2_SPAN / set_bytes)))
    a = [torch.randn(M, K, dtype=dt, device="cuda") for _ in range(sets)]
    w = [torch.randn(N, K, dtype=dt, device="cuda") for _ in range(sets)]
    c = [torch.empty(M, N, dtype=dt, device="cuda") for _ in range(sets)]
    fns = {"cublas": lambda i: torch.matmul(a[i % sets], w[i % sets].t(), out=c[i % sets])}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in variants:
        pl = variant_plan(ws, name, M, N, K, 2, 2, sms)
        fns[name] = (lambda pl: lambda i: ws.ws_matmul(a[i % sets], w[i % sets].t(), c[i % sets],
                                                       plan_=pl))(pl)
    if tl_matmul is not None:
        fns["tl"] = lambda i: tl_matmul(a[i % sets], w[i % sets].t(), out=c[i % sets])
    # Calls per graph: about GRAPH_TARGET_S per replay, from one timed cuBLAS call.
    fns["cublas"](0)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fns["cublas"](1)
    e1.record()
    torch.cuda.synchronize()
    est = e0.elapsed_time(e1) * 1e-3
    calls = max(2, min(GRAPH_CALLS, round(GRAPH_TARGET_S / max(est, 1e-6))))
    graphs = {}
    for name, fn in fns.items():
        try:
            graphs[name] = _graph(fn, calls)
        except Exception as exc:
            log(f"  {name}: no graph ({type(exc).__name__}: {str(exc)[:200]})")
    _sync(f"graph warm-up {M}x{N}x{K}")
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times[name].append(e0.elapsed_time(e1) * 1e-3 / calls)
    del graphs
    return {name: statistics.median(ts) for name, ts in times.items()}


def geo(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def run_gpu(args, variants) -> int:
    import torch
    import triton
    ws = _ws_module()
    dev = torch.cuda.get_device_properties(0)
    log(f"device {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}, "
        f"triton {triton.__version__}; variants {', '.join(variants)}")
    t_start = time.time()
    _start_watchdog()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays exact
    fails = {n: "" for n in variants} if args.no_check else check(ws, variants)
    if args.check_only:
        log("check failures: " + " ".join(f"{n}={fails[n]}" for n in variants))
        return 1 if any(fails.values()) else 0
    # Scratch sized once for every plan of the sweep: graphs keep their pointers.
    ws._scratch(torch.device("cuda", 0), 2 * 132 * 128 * 256, 1 << 16)
    tl_matmul = None
    if not args.no_tl:
        try:
            from ditron_ops.gemm._core import matmul as tl_matmul
        except Exception as exc:
            log(f"tl core unavailable ({type(exc).__name__}: {str(exc)[:200]})")
    shapes = timing_shapes(args.quick, [int(x) for x in args.seeds.split(",")],
                           not args.no_model)
    if args.off_sectors:  # only shapes whose K rows start off 32-byte sectors
        shapes = [s for s in shapes if (s[3] * 2) % 32]
    if args.few_tiles:  # only shapes of fewer than 2 waves of 128x256 tiles
        shapes = [s for s in shapes if -(-s[1] // 128) * -(-s[2] // 256) < 2 * 132]
    log(f"timing {len(shapes)} shapes (bf16, B = w.t(), C bf16, no bias), {args.rounds} rounds")
    rows = []
    for idx, (tag, M, N, K) in enumerate(shapes):
        if time.time() - t_start > args.deadline:
            log(f"deadline: timing stopped after {idx} of {len(shapes)} shapes")
            break
        try:
            t = time_shape(ws, variants, M, N, K, args.rounds, tl_matmul)
        except Exception as exc:
            log(f"  {M}x{N}x{K}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append((tag, M, N, K, t))
        ratios = " ".join(f"{n}={t['cublas'] / t[n]:.3f}" for n in t if n != "cublas")
        auto = ws.describe(variant_plan(ws, "auto", M, N, K))
        log(f"[{idx + 1}/{len(shapes)} {time.time() - t_start:.0f}s] {tag} {M}x{N}x{K} "
            f"cublas {t['cublas'] * 1e6:.1f}us {ratios} auto={auto}")
        torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ws_probe.csv")
    with open(path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["tag", "M", "N", "K", "contender", "t_cublas_us", "t_us", "ratio", "tflops",
                     "check_failures"])
        for tag, M, N, K, t in rows:
            for name, tv in t.items():
                wr.writerow([tag, M, N, K, name, f"{t['cublas'] * 1e6:.2f}", f"{tv * 1e6:.2f}",
                             f"{t['cublas'] / tv:.4f}", f"{2 * M * N * K / tv * 1e-12:.1f}",
                             fails.get(name, "")])

    cols = [n for n in variants + ["tl"] if rows and n in rows[0][4]]
    log("")
    log("ratio = t_cublas / t_ours (>1: faster than cuBLAS); bf16, B = w.t(); cuBLAS TFLOP/s")
    log(f"{'tag':<15}{'M':>6}{'N':>7}{'K':>7}{'cuBLAS':>7} "
        + " ".join(f"{n[:11]:>11}" for n in cols))
    for tag, M, N, K, t in rows:
        tf = 2 * M * N * K / t["cublas"] * 1e-12
        log(f"{tag:<15}{M:>6}{N:>7}{K:>7}{tf:>7.0f} "
            + " ".join(f"{t['cublas'] / t[n]:>11.3f}" if n in t else f"{'-':>11}" for n in cols))
    log("")
    for group, sel in (("model", lambda r: not r[0].startswith("random")),
                       ("random", lambda r: r[0].startswith("random")), ("all", lambda r: True)):
        sub = [r for r in rows if sel(r)]
        if not sub:
            continue
        best = geo([max(r[4]["cublas"] / r[4][n] for n in variants if n in r[4]) for r in sub])
        log(f"geo-mean {group:<6} ({len(sub):>2}): "
            + " ".join(f"{n}={geo([r[4]['cublas'] / r[4][n] for r in sub if n in r[4]]):.3f}"
                       for n in cols) + f" best-ws={best:.3f}")
    seeds = sorted({r[0] for r in rows if r[0].startswith("random")})
    for seed in seeds if len(seeds) > 1 else []:
        sub = [r for r in rows if r[0] == seed]
        log(f"geo-mean {seed:<10}: " + " ".join(
            f"{n}={geo([r[4]['cublas'] / r[4][n] for r in sub if n in r[4]]):.3f}" for n in cols))
    for n in [v for v in ("auto", ) + tuple(variants) if v in cols][:1]:
        for group, sel in (("model", lambda r: not r[0].startswith("random")),
                           ("random", lambda r: r[0].startswith("random"))):
            sub = sorted((r[4]["cublas"] / r[4][n], r) for r in rows if sel(r) and n in r[4])
            log(f"worst {n} {group}: " + ", ".join(
                f"{r[1]}x{r[2]}x{r[3]} {x:.3f} [{ws.describe(variant_plan(ws, n, *r[1:4]))}]"
                for x, r in sub[:5]))
    log("check failures: " + " ".join(f"{n}={fails[n]}" for n in variants))
    log(f"csv: {path}; total {time.time() - t_start:.0f} s")
    return 1 if any(fails.values()) else 0


def _graph_time(fn, rounds: int, calls: int = GRAPH_CALLS) -> float:
    """Median seconds per call of ``fn()`` replayed ``calls`` times in one CUDA graph."""
    import torch
    g = _graph(lambda i: fn(), calls)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(rounds):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3 / calls)
    touch()
    return statistics.median(ts)


def reduce_only(ws, rounds: int) -> int:
    """The split-K reduce step alone: ``reg`` (``ws_reduce_kernel``, ``[split, M, N]``) vs
    ``tma`` (``ws_reduce_tma_kernel``, line-padded planes) vs a device copy of the planes (the
    speed of L2: the planes of these shapes fit in it, as in the GEMM, where the reduce reads
    what the GEMM has just written). GB/s = (fp32 partials read + bf16 C written) / time; the
    copy's = (read + written) / time. Returns the number of mismatches (tma vs reg, bitwise)."""
    import torch
    sizes = sorted({(M, N) for _, M, N, _ in FEW_TILE_SHAPES} | {(512, 4096)})
    log("")
    log("reduce step alone (planes warm in L2); GB/s = (fp32 partials + bf16 C) bytes / time")
    log(f"{'M':>5} {'N':>5} {'split':>5} {'MiB':>6} | {'reg us':>7} {'GB/s':>6} | {'tma us':>7} "
        f"{'GB/s':>6} | {'copy GB/s':>9} | {'tma/reg':>7} {'bitwise':>7}")
    bad = 0
    cfg = ws.WS_CONFIGS["pp64x128"]
    for M, N in sizes:
        for split in REDUCE_SPLITS:
            p_reg = ws.WsPlan("pp64x128", ws.MODE_SPLITR, 1, split=split)
            p_tma = dataclasses.replace(p_reg, partials="tma")
            rows, ld = ws.splitr_pitch(M, N, cfg)
            w_reg = torch.randn(split, M, N, device="cuda")
            w_tma = torch.randn(split, rows, ld, device="cuda")
            w_tma[:, :M, :N] = w_reg
            o_reg = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
            o_tma = torch.empty_like(o_reg)
            g1, a1, m1 = ws.ws_reduce_operands(o_reg, None, p_reg, w_reg)
            g2, a2, m2 = ws.ws_reduce_operands(o_tma, None, p_tma, w_tma)
            k_reg, k_tma = ws.reduce_kernel(p_reg), ws.reduce_kernel(p_tma)
            f_reg = lambda: k_reg[g1](*a1, **m1)  # noqa: E731
            f_tma = lambda: k_tma[g2](*a2, **m2)  # noqa: E731
            dst = torch.empty_like(w_reg)
            f_copy = lambda: dst.copy_(w_reg)  # noqa: E731
            f_reg()
            f_tma()
            _sync(f"reduce {M}x{N}x{split}")
            same = torch.equal(o_reg, o_tma)
            bad += not same
            nbytes = split * M * N * 4 + M * N * 2
            t_reg, t_tma, t_copy = (_graph_time(f, rounds) for f in (f_reg, f_tma, f_copy))
            log(f"{M:>5} {N:>5} {split:>5} {nbytes / 2**20:>6.2f} | {t_reg * 1e6:>7.2f} "
                f"{nbytes / t_reg * 1e-9:>6.0f} | {t_tma * 1e6:>7.2f} {nbytes / t_tma * 1e-9:>6.0f}"
                f" | {2 * split * M * N * 4 / t_copy * 1e-9:>9.0f} | {t_reg / t_tma:>7.2f} "
                f"{'ok' if same else 'DIFF':>7}")
    log(f"reduce: tma vs reg bitwise mismatches: {bad}")
    return bad


def _bitwise_pairs(ws, variants, M, N, K, sms) -> int:
    """Each ``X@tma`` of ``variants`` against ``X`` on float inputs: bitwise equal (the same
    slice order). Returns the mismatches (logged)."""
    import torch
    gen = torch.Generator(device="cuda")
    gen.manual_seed(M + N + K)
    a = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(N, K, generator=gen, device="cuda").to(torch.bfloat16)
    bad = 0
    for name in variants:
        base, tma, _ = name.partition("@tma")
        if not tma or base not in variants:
            continue
        outs = [ws.ws_matmul(a, w.t(), plan_=variant_plan(ws, n, M, N, K, 2, 2, sms))
                for n in (base, name)]
        _sync(f"bitwise {name} {M}x{N}x{K}")
        if not torch.equal(*outs):
            bad += 1
            log(f"  DIFF {name} vs {base} {M}x{N}x{K}: not bitwise equal")
    return bad


def run_partials(args, variants) -> int:
    """``--partials``: the reduce step alone, then the few-tile GEMMs (module docstring)."""
    import torch
    import triton
    ws = _ws_module()
    dev = torch.cuda.get_device_properties(0)
    sms = dev.multi_processor_count
    log(f"device {dev.name}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}")
    t_start = time.time()
    _start_watchdog()
    torch.backends.cuda.matmul.allow_tf32 = False
    bad = reduce_only(ws, args.rounds)
    if args.partials_only:
        return 1 if bad else 0
    tma_names = [n for n in variants if n.endswith("@tma")]
    fails = {n: "" for n in variants} if args.no_check else check(ws, tma_names)
    ws._scratch(torch.device("cuda", 0), 16 << 20, 1 << 16)  # graphs keep the pointers
    rows = []
    log("")
    log(f"few-tile GEMMs, bf16, B = w.t(); ratio = t_cublas / t_ours; {args.rounds} rounds")
    for tag, M, N, K in FEW_TILE_SHAPES:
        if time.time() - t_start > args.deadline:
            log("deadline: timing stopped")
            break
        bad += _bitwise_pairs(ws, variants, M, N, K, sms)
        try:
            t = time_shape(ws, variants, M, N, K, args.rounds, None)
        except Exception as exc:
            log(f"  {M}x{N}x{K}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append((M, N, K, t))
        log(f"  {M}x{N}x{K} cublas {t['cublas'] * 1e6:.1f}us " + " ".join(
            f"{n}={t['cublas'] / t[n]:.3f}" for n in variants if n in t))
    log("")
    log("ratio (t_us) per variant: " + ", ".join(variants))
    log(f"{'shape':<17}{'cuBLAS':>9} | " + " ".join(f"{n[:15]:>15}" for n in variants))
    for M, N, K, t in rows:
        log(f"{f'{M}x{N}x{K}':<17}{t['cublas'] * 1e6:>7.1f}us | " + " ".join(
            f"{t['cublas'] / t[n]:>6.3f}({t[n] * 1e6:>6.1f})" if n in t else f"{'-':>15}"
            for n in variants))
    log("plans: " + "; ".join(f"{M}x{N}x{K}: " + ", ".join(
        ws.describe(variant_plan(ws, n, M, N, K, 2, 2, sms)) for n in variants)
        for M, N, K, _ in rows))
    log("")
    log("tma speed-up over reg (t_reg / t_tma) per schedule:")
    for n in variants:
        base, tma, _ = n.partition("@tma")
        if tma and base in variants:
            xs = [r[3][base] / r[3][n] for r in rows if n in r[3] and base in r[3]]
            log(f"  {base:<22} " + " ".join(f"{x:.3f}" for x in xs) + f"  geo {geo(xs):.3f}")
    log("check failures: " + " ".join(f"{n}={fails.get(n, '')}" for n in tma_names)
        + f"; bitwise mismatches {bad}; total {time.time() - t_start:.0f} s")
    return 1 if bad or any(fails.get(n) for n in tma_names) else 0


TIMELINE_VARIANTS = ("auto", "coop128x256:sk", "coop128x256:sk@tma", "pp128x128:sk@tma",
                     "pp128x128")
"""``--timeline``: the rule's plan, stream-K on the cooperative and the ping-pong consumers
(ping-pong: one consumer's fix-up under the other's mainloop), and data parallel."""


def timeline(stamps, units: int) -> dict:
    """Summary of one traced launch (``stamps`` int64 ``[grid, TRACE_UNITS, 4]`` ns, zero where
    a point was not reached): ``span`` (first mainloop start to last unit done), and for the
    program that finished last its ``main`` (mainloops), ``store`` (partial store and arrival),
    ``fixup`` and ``gaps`` (between its units: waiting on the ring), all in us."""
    import torch
    st = stamps.to(torch.float64) / 1e3
    t0, t1, t2, t3 = (st[:, :units, j] for j in range(4))
    done = torch.where(t3 > 0, t3, torch.where(t2 > 0, t2, t1))
    begin = t0[t0 > 0].min()
    last = int(done.max(dim=1).values.argmax())
    seen = t0[last] > 0
    a0, a1, a2, a3 = (x[last][seen] for x in (t0, t1, t2, t3))
    has2 = a2 > 0
    store = (a2 - a1)[has2].sum()
    fix = torch.where(has2 & (a3 > 0), a3 - a2, torch.zeros_like(a3)).sum()
    end = torch.where(a3 > 0, a3, torch.where(has2, a2, a1))
    return {"span": float(done.max() - begin), "units": int(seen.sum()),
            "start": float(a0.min() - begin), "main": float((a1 - a0).sum()),
            "store": float(store), "fixup": float(fix),
            "epilogue": float(torch.where(~has2 & (a3 > 0), a3 - a1, torch.zeros_like(a3)).sum()),
            "gaps": float((a0[1:] - end[:-1]).clamp(min=0).sum())}


def run_timeline(args, variants) -> int:
    """``--timeline``: each variant on ``FEW_TILE_SHAPES`` once traced (after a warm call), the
    last program's breakdown against the launch's span."""
    import torch
    ws = _ws_module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _start_watchdog()
    log("timeline (us; the last program to finish): span = start + main + store + fixup + "
        "epilogue + gaps for one consumer (ping-pong: the two consumers' parts overlap)")
    for tag, M, N, K in FEW_TILE_SHAPES:
        a = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        w = torch.randn(N, K, device="cuda").to(torch.bfloat16)
        for name in variants:
            p = variant_plan(ws, name, M, N, K, 2, 2, sms)
            stamps = torch.zeros(p.grid, ws.TRACE_UNITS, ws.TRACE_POINTS, dtype=torch.int64,
                                 device="cuda")
            for _ in range(2):  # the first compiles and warms
                stamps.zero_()
                ws.ws_matmul(a, w.t(), plan_=p, trace=stamps)
            _sync(f"timeline {name} {M}x{N}x{K}")
            stamps = stamps.cpu()
            if bool((stamps[:, -1, 0] > 0).any()):
                log(f"  ({name}: over {ws.TRACE_UNITS} units in a program; the last row mixes)")
            t = timeline(stamps, ws.TRACE_UNITS)
            log(f"  {M}x{N}x{K} {name:<20} {ws.describe(p):<28} " + " ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ws_probe_out")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tl", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--rule-configs", default="", help="configs the rule may pick, a,b")
    ap.add_argument("--no-model", action="store_true", help="random shapes only")
    ap.add_argument("--seeds", default=str(RANDOM_SEED), help="random-shape seeds, a,b,...")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S)
    ap.add_argument("--few-tiles", action="store_true",
                    help="time only shapes of < 2 waves of 128x256 tiles")
    ap.add_argument("--off-sectors", action="store_true",
                    help="time only shapes whose bf16 K rows start off 32-byte sectors")
    ap.add_argument("--no-check", action="store_true", help="skip the integer checks")
    ap.add_argument("--partials", action="store_true",
                    help="partial traffic: reduce step alone + few-tile GEMMs, reg vs tma")
    ap.add_argument("--timeline", action="store_true",
                    help="GPU: traced launches of the few-tile shapes (where the time goes)")
    ap.add_argument("--partials-only", action="store_true",
                    help="with --partials (implied): only the reduce step alone (GB/s)")
    args = ap.parse_args()
    args.partials = args.partials or args.partials_only
    if args.compile_only:
        import importlib.util
        spec = importlib.util.find_spec("triton.experimental.gluon")
        if spec is None:
            log("triton without gluon")
            return 1
    _ws_module()
    if args.rule_configs:  # restrict the rule (e.g. to the configs that passed their checks)
        sys.modules["ditron_ws._ws_configs"].RULE_CONFIGS = tuple(args.rule_configs.split(","))
    ws_names = list(_ws_module().WS_CONFIGS) if not args.variants else args.variants.split(",")
    if args.partials and not args.variants:
        ws_names = list(PARTIALS_VARIANTS)
    if args.compile_only:
        return compile_only(ws_names)
    if args.partials:
        return run_partials(args, ws_names)
    if args.timeline:
        return run_timeline(args, list(TIMELINE_VARIANTS) if not args.variants else ws_names)
    return run_gpu(args, ws_names)


if __name__ == "__main__":
    sys.exit(main())
