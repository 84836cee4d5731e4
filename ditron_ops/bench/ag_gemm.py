"""Bench ``ag_gemm``: our GEMM core vs cuBLAS, the fused op's overhead, host cost, fused vs baseline.

Cases (one run, one GPU)::

    P1  core      matmul(a, w.t()) (our persistent TMA GEMM) vs torch.matmul (cuBLAS)
                  on the local shapes M=8192, N = model N / 8, K (shapes.LAYER_CONFIGS), per
                  tile configuration of ``gemm._core.GPU_CONFIGS``
    P2  present   the ag_gemm consumer with every chunk already present (flags pre-set, waits
                  and swizzle active) vs the same kernel as a plain GEMM, per tile configuration,
                  and the warp-specialized consumer (``ws``) vs its plain launch
    host          eager ag_gemm at W=1 on a tiny problem vs the same call replayed in a CUDA graph
    fused         ag_gemm(impl="fused") vs impl="baseline" (all_gather + torch.matmul) on the
                  virtual world (W ranks share one GPU: the collective is HBM copies), M sweep,
                  LLaMA-3.1-8B layer
    consumer      the fused call with the consumer core ``auto`` vs the portable core forced
                  (``_ag_launch.CONSUMER_CORE``), same sweep
    producer      the fused path with the SM pull producer (``ag_pull_kernel``) vs the copy-engine
                  producer, same sweep (on one GPU both move HBM to HBM: this measures the SMs
                  the pull kernel takes from the GEMM against the copy engines' interference)

``--only fused``: the fused, consumer and producer rows alone.

Every case times CUDA-graph replays (device time; the host row measures the eager call's cost);
P1 and P2 time ours and the baseline in turns (``paired_graph_times``).
The ``ratio`` column is baseline / ours (>1: ours faster). ``geo-mean`` rows summarise P1/P2.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..gemm import _ag_launch
from ..gemm._core import matmul
from ..gemm.ag_gemm import ag_gemm
from ..gemm import _core as gemm_core
from ..runtime.virtual import launch
from .harness import (BenchConfig, Result, geo_mean_row, graph_time_spmd, host_time_spmd,
                      paired_graph_times, register)
from .shapes import DEFAULT_M, DEFAULT_WORLD_SIZE, LAYER_CONFIGS, get_model

_SWEEP_M = (128, 512, 2048, 8192)


def _local_shapes(quick: bool) -> dict[tuple[int, int, int], str]:
    """Distinct local (M, N/8, K) shapes with the models that have them."""
    shapes: dict[tuple[int, int, int], str] = {}
    for name, s in LAYER_CONFIGS.items():
        key = (64 if quick else DEFAULT_M, s.n // DEFAULT_WORLD_SIZE, s.k)
        shapes[key] = f"{shapes[key]},{name}" if key in shapes else name
        if quick:
            break
    return shapes


def _inputs(m: int, n: int, k: int, dtype, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(dtype=dtype, device=device)
    return a, w


def _core(group, cfg: BenchConfig, out: list[Result], configs: list[str]) -> None:
    """P1: our GEMM per tile configuration vs cuBLAS, on the local model shapes."""
    per_config: dict[str, list[Result]] = {c: [] for c in configs}
    for (m, n, k), models in _local_shapes(cfg.quick).items():
        a, w = _inputs(m, n, k, cfg.dtype, group.device)
        b = w.t()
        ref = torch.matmul(a, b)
        fns, errs = {"cublas": lambda: torch.matmul(a, b)}, {}
        for name in configs:
            tc = gemm_core.GPU_CONFIGS[name]
            got = matmul(a, b, cfg=tc)
            errs[name] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            fns[name] = lambda tc=tc: matmul(a, b, cfg=tc)
        times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
        for name in configs:
            t_cublas, t, err = times["cublas"], times[name], errs[name]
            tflops = 2 * m * n * k / t / 1e6
            r = Result("ag_gemm", f"P1 core {name}", 1, cfg.dtype_name, "triton persistent TMA", t,
                       "cuBLAS torch.matmul", t_cublas, shape=f"{m}x{n}x{k}", m=m, n=n, k=k,
                       model=models, extra={"tflops": round(tflops, 1), "rel_err": f"{err:.1e}"})
            per_config[name].append(r)
            out.append(r)
    for name, rows in per_config.items():
        out.append(geo_mean_row(rows, f"P1 core {name}"))


def _present(group, cfg: BenchConfig, out: list[Result], configs: list[str]) -> None:
    """P2 per tile configuration: the consumer with all chunks present (W=1 pad pre-set) vs the
    same configuration's plain GEMM (no waits), all timed in turns per shape."""
    rows: dict[str, list[Result]] = {c: [] for c in configs}
    for (m, n, k), models in _local_shapes(cfg.quick).items():
        a, w = _inputs(m, n, k, cfg.dtype, group.device)
        b = w.t()
        sig = torch.zeros(16, dtype=torch.int64, device=group.device)
        sig[0], sig[2], sig[3] = 1, m, 1  # W=1 pad: flag[0] = epoch = 1, rows[0] = m
        offsets = torch.tensor([0, m], dtype=torch.int32, device=group.device)
        record, claim = group._error_tensors()
        fns, equal = {}, {}
        for name in configs:
            tc = gemm_core.GPU_CONFIGS[name]
            a_desc = TensorDescriptor(a, [m, k], [k, 1], [tc.block_m, tc.block_k])
            c = torch.empty(m, n, dtype=cfg.dtype, device=group.device)

            def fused_present(tc=tc, a_desc=a_desc, c=c):
                gemm_core.launch_consumer(a_desc, b, c, None, group=group, wait=True, sig=sig,
                                          offsets=offsets, claim=claim, record=record, m=m, cfg=tc)

            fused_present()
            group.synchronize()
            equal[name] = torch.equal(c, matmul(a, b, cfg=tc)) and int(record[0]) == 0
            fns[f"plain {name}"] = lambda tc=tc: matmul(a, b, cfg=tc)
            fns[f"present {name}"] = fused_present
        times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
        for name in configs:
            t_plain, t = times[f"plain {name}"], times[f"present {name}"]
            r = Result("ag_gemm", f"P2 chunks present {name}", 1, cfg.dtype_name,
                       "ag_gemm consumer (waits)", t, "our plain GEMM", t_plain,
                       shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=models,
                       extra={"overhead_pct": round(100 * (t / t_plain - 1), 2),
                              "equal": equal[name]})
            rows[name].append(r)
            out.append(r)
        ws_row = _present_ws(group, cfg, a, b, sig, offsets, claim, record, models)
        if ws_row is not None:
            rows.setdefault("ws", []).append(ws_row)
            out.append(ws_row)
    for name in rows:
        if rows[name]:
            out.append(geo_mean_row(rows[name], f"P2 chunks present {name}"))


def _present_ws(group, cfg: BenchConfig, a, b, sig, offsets, claim, record, models):
    """P2 of the warp-specialized consumer (``WAIT``, data parallel) vs its plain launch (same
    plan, no waits), with cuBLAS timed in the same turns (``vs_cublas``); None where the WS
    core refuses the product."""
    from ..gemm._ws_launch import MODE_DP, WsGemm, refusal
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    c, c_plain = (torch.empty(m, n, dtype=cfg.dtype, device=group.device) for _ in range(2))
    if refusal(a, b, c, None) is not None:
        return None
    sms = gemm_core.program_budget(group.device, None)
    waiting = WsGemm(a, b, c, None, sms, (sig, offsets, claim, record, 0, 1, 10**7, 0))
    plain = WsGemm(a, b, c_plain, None, sms, mode=MODE_DP)
    waiting.run(a, b, c, None)
    plain.run(a, b, c_plain, None)
    group.synchronize()
    equal = torch.equal(c, c_plain) and int(record[0]) == 0
    times = paired_graph_times(group, {"plain": lambda: plain.run(a, b, c_plain, None),
                                       "present": lambda: waiting.run(a, b, c, None),
                                       "cublas": lambda: torch.matmul(a, b)},
                               rounds=cfg.rounds, target_ms=cfg.target_ms)
    t, t_plain = times["present"], times["plain"]
    return Result("ag_gemm", "P2 chunks present ws", 1, cfg.dtype_name,
                  "ag_gemm WS consumer (waits)", t, "our plain WS GEMM", t_plain,
                  shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=models,
                  extra={"overhead_pct": round(100 * (t / t_plain - 1), 2), "equal": equal,
                         "config": waiting.name,
                         "vs_cublas": round(times["cublas"] / t, 3)})


def _host(group, cfg: BenchConfig, out: list[Result]) -> None:
    """Eager call cost vs CUDA-graph replay of the same call (tiny problem, W=1)."""
    a, w = _inputs(128, 256, 256, cfg.dtype, group.device)
    b = w.t()
    call = lambda: ag_gemm(a, b, impl="fused")  # noqa: E731
    call()
    group.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(group.device)):
        call()
    eager = host_time_spmd(group, call, iters=200)
    replay = host_time_spmd(group, graph.replay, iters=200)
    baseline = host_time_spmd(group, lambda: ag_gemm(a, b, impl="baseline"), iters=200)
    out.append(Result("ag_gemm", "host eager vs graph", 1, cfg.dtype_name, "eager ag_gemm fused",
                      eager, "graph replay", replay, shape="128x256x256", m=128, n=256, k=256,
                      extra={"host_overhead_us": round(eager - replay, 1),
                             "eager_baseline_us": round(baseline, 1)}))


def _fused_vs_baseline(cfg: BenchConfig, out: list[Result], world: int) -> None:
    model = get_model("LLaMA-3.1-8B")
    n, k = model.n // DEFAULT_WORLD_SIZE, model.k
    sweep = (64,) if cfg.quick else _SWEEP_M

    def body(group):
        rows = []
        for m in sweep:
            a, w = _inputs(m // world, n, k, cfg.dtype, group.device, seed=group.rank)
            b = w.t()
            t = {}
            try:  # a module setting, the same on every rank (their timings are barrier separated)
                for producer in ("auto",) + _ag_launch.PRODUCERS:
                    _ag_launch.PRODUCER = producer
                    t[producer] = graph_time_spmd(group, lambda: ag_gemm(a, b, impl="fused"),
                                                  rounds=cfg.rounds, target_ms=cfg.target_ms)
                _ag_launch.PRODUCER = "copy"  # (the WS consumer's producers: copy, pull)
                for core in ("auto", "tl"):
                    _ag_launch.CONSUMER_CORE = core
                    t[f"core {core}"] = graph_time_spmd(
                        group, lambda: ag_gemm(a, b, impl="fused"), rounds=cfg.rounds,
                        target_ms=cfg.target_ms)
            finally:
                _ag_launch.PRODUCER = chosen
                _ag_launch.CONSUMER_CORE = consumer
            t_b = graph_time_spmd(group, lambda: ag_gemm(a, b, impl="baseline"), rounds=cfg.rounds,
                                  target_ms=cfg.target_ms)
            common = dict(shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=model.name)
            rows.append(Result("ag_gemm", f"fused M={m}", world, cfg.dtype_name,
                               f"ag_gemm fused ({chosen})", t[chosen], "all_gather + torch.matmul",
                               t_b, **common))
            rows.append(Result("ag_gemm", f"consumer M={m}", world, cfg.dtype_name,
                               "fused (copy), consumer core auto", t["core auto"],
                               "fused, portable consumer", t["core tl"], **common))
            for producer, what in (("pull", "pull producer (SMs)"),
                                   ("push", "push call (one launch)")):
                rows.append(Result("ag_gemm", f"producer M={m}", world, cfg.dtype_name,
                                   f"fused, {what}", t[producer], "fused, copy-engine producer",
                                   t["copy"], **common))
        return rows

    chosen, consumer = _ag_launch.PRODUCER, _ag_launch.CONSUMER_CORE

    out.extend(launch(body, world, cfg.device)[0])


@register("ag_gemm", help="ag_gemm: GEMM core vs cuBLAS (P1), fused overhead (P2), host cost, "
                          "fused vs baseline, pull vs copy-engine producer", world_sizes=(4,), quick_world_sizes=(2,))
def run(cfg: BenchConfig, configs: Optional[list[str]] = None) -> list[Result]:
    if cfg.device.type != "cuda":
        raise SystemExit("ditron.bench ag_gemm: needs a CUDA GPU (TMA GEMM)")
    configs = configs or list(gemm_core.GPU_CONFIGS)
    out: list[Result] = []

    def single(group):
        _core(group, cfg, out, configs)
        _present(group, cfg, out, configs)
        _host(group, cfg, out)

    if "fused" not in cfg.only:  # (``--only fused``: the virtual worlds' rows alone)
        launch(single, 1, cfg.device)
    for world in cfg.world_sizes:
        _fused_vs_baseline(cfg, out, world)
    return out
