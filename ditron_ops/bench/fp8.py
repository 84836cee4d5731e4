"""Bench ``fp8``: the fp8 GEMM ops on the ``models`` set of ``gemm_sweep`` (tensor-parallel shards
of public models, seeded M).

Rows (``case``):

- ``tensor`` / ``row``: our scaled core GEMM (``gemm.scaled.scaled_matmul``, the GEMM every fp8
  op runs) vs ``torch._scaled_mm`` with the same scales (targets: geo-mean >= 0.95x, none
  below 0.85x);
- ``block``: 1x128 / 128x128 block scales vs bf16 cuBLAS (``torch.matmul``) on the same shapes
  (target >= 1.5x bf16's speed at M >= 2048); torch's own block-scaled ``_scaled_mm`` is not
  compared (the installed torch's API for it differs between versions);
- ``fused <mode>``: ``ag_gemm_scaled`` at one rank (fused path, rows packed and gathered into
  the workspace, the consumer ``_ag_launch.SCALED_CONSUMER_CORE`` says reading them) vs the
  scaled core GEMM alone: the fused op's
  overhead with data present (target <= 3%); ``gathered_bytes`` and ``bf16_bytes`` columns;
  ``fused_rs <mode>``: ``gemm_rs_scaled`` at one rank (fused path: the reduce-scatter kernel
  with nothing to exchange) vs the same;
- ``present <mode>`` / ``present_ws <mode>`` (``--only present``): ``ag_gemm_scaled``'s waiting
  consumer alone over this rank's packed rows with every chunk already present (a W = 1 pad
  pre-set, as ``bench ag_gemm``'s P2 rows), the portable one / the fp8 WS one
  (``_ws_scaled.consumer_config``), vs the scaled core GEMM on the unpacked operands: the
  fused op's overhead with data present (target <= 3%) without the producer, and the data of
  ``_ag_launch.SCALED_CONSUMER_CORE``'s default;
- ``ws <mode> <config>`` (``--only ws``, sm_90): the fp8 WS core's plan of each config
  serving the mode (``_ws_scaled.configs_for``) vs the portable core alone
  (``scaled_matmul(core="tl")``): the data of the configs' scale modes; the ``tensor`` /
  ``row`` / ``block`` rows' ``core`` column says which plan ``scaled_matmul``'s timing kept;
- ``tiles <mode>`` (``--only tiles``, GPU): the scaled core's two fp8 forms of the bf16 rule's
  tile (``_core_configs.scaled_configs``: narrow 128x128 with 8 warps vs wide), whatever the
  fp8 rule picks: the data of that rule.

Times: paired CUDA-graph replay on one GPU (``paired_graph_times``); the interpreter runs one
tiny shape for plumbing. ``--only tensor,row,block,fused,present,tiles,ws`` runs
parts.
"""
from __future__ import annotations

import dataclasses

import torch

from ..gemm.scaled import (MODES, _b_scales, ag_gemm_scaled, gathered_bytes, gemm_rs_scaled,
                           scaled_matmul)
from ..runtime.virtual import launch
from .gemm_sweep import models_shapes
from .harness import BenchConfig, Result, geo_mean_row, paired_graph_times, register, time_spmd

PARTS = ("tensor", "row", "block", "fused", "present", "tiles", "ws")
FP8 = torch.float8_e4m3fn


def _inputs(m: int, n: int, k: int, mode: str, device):
    """Seeded fp8 ``a [M, K]``, column-major ``b = w.t()`` and their scales for ``mode``."""
    gen = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    a = (torch.randn(m, k, generator=gen) * 4).to(FP8).to(device)
    b = (torch.randn(n, k, generator=gen) * 4).to(FP8).to(device).t()
    kb, nb = -(-k // 128), -(-n // 128)
    shapes = {"tensor": ((1,), (1,)), "row": ((m, 1), (1, n)), "block": ((m, kb), (kb, nb))}[mode]
    sa, sb = (torch.rand(*s, generator=gen).add(0.5).to(device) for s in shapes)
    return a, b, sa, sb


def _kernel_scales(sa, sb, mode: str):
    """``(sa, sa_row, sb, sb_row)`` as ``scaled_matmul`` takes them."""
    sbk, sb_row = _b_scales(sb, mode)
    return (sa.reshape(1) if mode == "tensor" else sa, 0 if mode == "tensor" else sa.shape[1],
            sbk, sb_row)


def _ours(a, b, sa, sb, mode: str, out: torch.Tensor, tiles: tuple = (), core: str = "auto"):
    """The scaled core GEMM's call (what every fp8 op runs; ``tiles``: fields replacing the
    rule's tile; ``core``: ``scaled_matmul``'s)."""
    sa_k, sa_row, sbk, sb_row = _kernel_scales(sa, sb, mode)
    return lambda: scaled_matmul(a, b, sa_k, sa_row, sbk, sb_row, MODES[mode], None, out, tiles,
                                 core=core)


def _ws(a, b, sa, sb, mode: str, out: torch.Tensor, config: str):
    """The fp8 WS core's plan of ``config`` alone (``--only ws``)."""
    from ..gemm._ws_scaled import WsScaledGemm
    sa_k, sa_row, sbk, sb_row = _kernel_scales(sa, sb, mode)
    gemm = WsScaledGemm(a, b, out, None, sa_k, sbk, sa_row, sb_row, MODES[mode], config)
    return lambda: gemm.run(a, b, out, None, sa_k, sbk)


def _present(group, a, b, sa, sb, mode: str, out) -> tuple[dict, dict]:
    """``present`` / ``present_ws`` calls (module docstring) and their outputs (each its own,
    like ``out``): the waiting consumers as ``_ag_launch.AgGemmPlan`` builds them over this
    rank's packed rows (``scaled.pack_rows``), every flag of a one-rank pad set (epoch 1, ``m``
    rows), no producer; the WS one only where the fp8 WS core takes the rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..gemm import _ws_scaled
    from ..gemm._ag_launch import ScaledRows
    from ..gemm._core import CoreGemm, Scales, program_budget, scaled_config, select_config
    from ..gemm.scaled import k_major, pack_rows, packed_row
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    dev, scale = a.device, MODES[mode]
    words = pack_rows(a, sa, mode, group)  # [m, pitch] fp32 words
    pitch = words.shape[1]
    bk = k_major(b)
    sbk, sb_row = _b_scales(sb, mode)
    # (the plan's views of the gathered rows: here this rank's, as one rank gathers them)
    a8, sa_rows = ScaledRows(k, scale, packed_row(k, mode).scale_offset // 4, sb_row).views(
        words.view(-1), m, pitch)
    sig = torch.zeros(16, dtype=torch.int64, device=dev)
    sig[0], sig[2], sig[3] = 1, m, 1  # W = 1: flag[0] = epoch = 1, rows[0] = m
    offsets = torch.tensor([0, m], dtype=torch.int32, device=dev)
    record, claim = group._error_tensors()
    budget = program_budget(dev, group)
    cfg = scaled_config(select_config(m, n, budget, dev, deterministic=False), scale, m, n,
                        budget)
    a_desc = TensorDescriptor(a8, [m, k], list(a8.stride()), [cfg.block_m, cfg.block_k])
    outs = {"present": torch.empty_like(out)}
    core = CoreGemm(a_desc, bk, outs["present"], None, group=group, wait=True, sig=sig,
                    offsets=offsets, claim=claim, record=record, m=m, cfg=cfg,
                    scales=Scales(scale, sa_rows, sbk, pitch, sb_row, a_varies=False))
    fns = {"present": lambda: core.run(None, bk, outs["present"], None, scale_b=sbk)}
    if dev.type == "cuda" and _ws_scaled.refusal(a8, bk, out, None) is None:
        outs["present_ws"] = torch.empty_like(out)
        # (one SM short of the share, as the op's under its default copy producer)
        ws = _ws_scaled.WsScaledGemm(a8, bk, outs["present_ws"], None, sa_rows, sbk, pitch,
                                     sb_row, scale,
                                     _ws_scaled.consumer_config(scale, m, n, max(1, budget - 1)),
                                     sms=max(1, budget - 1),
                                     wait=(sig, offsets, claim, record, 0, 1, 10**7, 0))
        fns["present_ws"] = lambda: ws.run(a8, bk, outs["present_ws"], None, sa_rows, sbk)
    return fns, outs


def _times(group, fns: dict, cfg: BenchConfig) -> dict:
    if group.device.type == "cuda":
        return paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
    return {name: time_spmd(group, fn, rounds=1, max_iters=1) for name, fn in fns.items()}


def _forms(m: int, n: int, device):
    """``(wide, narrow)`` fields of the fp8 forms of the bf16 rule's tile for ``[m, n]`` (as
    ``scaled_matmul``'s ``tiles``), or None where there is no narrow form."""
    from ..gemm._core import program_budget, scaled_configs, select_config
    cfg = select_config(m, n, program_budget(device, None), device, deterministic=False)
    wide, narrow = scaled_configs(cfg)
    if narrow is None:
        return None
    return tuple(tuple(dataclasses.asdict(c).items()) for c in (wide, narrow))


def _ws_configs(a, b, out, mode: str) -> tuple:
    """The fp8 WS core's configs serving ``mode`` where it takes these operands (else none)."""
    from ..gemm import _ws_scaled
    return (_ws_scaled.configs_for(MODES[mode])
            if _ws_scaled.refusal(a, b, out, None) is None else ())


def _core_name(a, b, sa, sb, mode: str, out) -> str:
    """The core ``scaled_matmul``'s timing kept for these operands."""
    from ..gemm.scaled import scaled_core
    sa_k, sa_row, sbk, sb_row = _kernel_scales(sa, sb, mode)
    return scaled_core(a, b, sa_k, sa_row, sbk, sb_row, MODES[mode], None, out)


def _shape_rows(group, cfg: BenchConfig, parts, m: int, n: int, k: int, model: str) -> list[Result]:
    rows = []
    dev = group.device
    shape = dict(shape=f"{m}x{n}x{k}", m=m, n=n, k=k, model=model)
    gpu = dev.type == "cuda"
    for mode in ("tensor", "row", "block"):
        if mode not in parts and not {"fused", "present", "tiles", "ws"} & set(parts):
            continue
        a, b, sa, sb = _inputs(m, n, k, mode, dev)
        out = torch.empty(m, n, dtype=torch.bfloat16 if gpu else torch.float16, device=dev)
        fns = {"ours": _ours(a, b, sa, sb, mode, out)}
        if mode in parts:
            if mode == "block":
                a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
                fns["base"] = lambda: torch.matmul(a16, b16)
                base_name = "cuBLAS bf16 torch.matmul"
            elif gpu:
                fns["base"] = lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
                base_name = "torch._scaled_mm"
            else:  # the interpreter: a dequantized float product (plumbing only)
                fns["base"] = lambda: (a.float() * sa) @ (b.float() * sb)
                base_name = "dequantized fp32 matmul (CPU)"
        if "fused" in parts:
            fns["fused"] = lambda: ag_gemm_scaled(a, b, sa, sb, group, out_dtype=out.dtype,
                                                  impl="fused")
            fns["fused_rs"] = lambda: gemm_rs_scaled(a, b, sa, sb, group, out_dtype=out.dtype,
                                                     impl="fused")
        present_outs = {}
        if "present" in parts:
            present, present_outs = _present(group, a, b, sa, sb, mode, out)
            fns.update(present)
        ws_configs = _ws_configs(a, b, out, mode) if "ws" in parts else ()
        if ws_configs:
            fns["tl"] = _ours(a, b, sa, sb, mode, out, core="tl")
            fns.update({c: _ws(a, b, sa, sb, mode, out, c) for c in ws_configs})
        forms = _forms(m, n, dev) if "tiles" in parts and gpu else None
        if forms is not None:
            fns["wide"], fns["narrow"] = (_ours(a, b, sa, sb, mode, out, f) for f in forms)
        t = _times(group, fns, cfg)
        tflops = lambda us: round(2 * m * n * k / us / 1e6, 1)  # noqa: E731
        if mode in parts:
            rows.append(Result("fp8", mode, 1, "e4m3", f"scaled core {mode}", t["ours"], base_name,
                               t["base"], extra={"tflops": tflops(t["ours"]),
                                                 "core": _core_name(a, b, sa, sb, mode, out)},
                               **shape))
        for c in ws_configs:
            rows.append(Result("fp8", f"ws {mode} {c}", 1, "e4m3", f"WS core {c}", t[c],
                               "portable core", t["tl"], extra={"tflops": tflops(t[c])},
                               **shape))
        if "narrow" in fns:
            rows.append(Result("fp8", f"tiles {mode}", 1, "e4m3", "128x128, 8 warps", t["narrow"],
                               "the bf16 rule's tile", t["wide"],
                               extra={"tflops": tflops(t["narrow"])}, **shape))
        if "fused" in parts:
            rows.append(Result("fp8", f"fused {mode}", 1, "e4m3", f"ag_gemm_scaled {mode}",
                               t["fused"], f"scaled core {mode}", t["ours"], **shape,
                               extra={"gathered_bytes": gathered_bytes([m], k, mode),
                                      "bf16_bytes": 2 * m * k}))
            rows.append(Result("fp8", f"fused_rs {mode}", 1, "e4m3", f"gemm_rs_scaled {mode}",
                               t["fused_rs"], f"scaled core {mode}", t["ours"], **shape))
        labels = {"present": "ag_gemm_scaled consumer, chunks present",
                  "present_ws": "ag_gemm_scaled WS consumer, chunks present"}
        for name, got in present_outs.items():  # (rel_err: against the scaled core's out)
            err = ((got.float() - out.float()).abs().max() / out.float().abs().max()).item()
            rows.append(Result("fp8", f"{name} {mode}", 1, "e4m3", labels[name], t[name],
                               f"scaled core {mode} ({_core_name(a, b, sa, sb, mode, out)})",
                               t["ours"], **shape,
                               extra={"overhead_pct": round(100 * (t[name] / t["ours"] - 1), 2),
                                      "rel_err": f"{err:.1e}",
                                      "no_error": int(group._error_tensors()[0][0]) == 0}))
    return rows


@register("fp8", help="fp8 GEMM ops: the scaled core vs torch._scaled_mm (tensor/row), block "
                      "scales vs bf16 cuBLAS, ag_gemm_scaled's overhead and bytes (models set)",
          world_sizes=(1,), quick_world_sizes=(1,))
def run(cfg: BenchConfig) -> list[Result]:
    parts = [p for p in PARTS if p in cfg.only] or [p for p in PARTS
                                                     if p not in ("tiles", "ws", "present")]
    gpu = cfg.device.type == "cuda"
    # two draws per model config (about 20 shapes): every new shape compiles fp8 plans
    shapes = models_shapes(per_config=2) if gpu and not cfg.quick else {(40, 48, 160): "quick"}
    out: list[Result] = []

    def body(group):
        for (m, n, k), model in shapes.items():
            rows = _shape_rows(group, cfg, parts, m, n, k, model)
            print(f"{m}x{n}x{k} ({model}): " + ", ".join(
                f"{r.case} {r.ratio:.3f}" + (f" [{r.extra['core']}]" if "core" in r.extra else "")
                for r in rows), flush=True)  # a run cut short still shows what it measured
            out.extend(rows)
        for case in dict.fromkeys(r.case for r in out):
            rows = [r for r in out if r.case == case and r.shape != "geo-mean"]
            worst = sorted(rows, key=lambda r: r.ratio)[:5]
            print(f"{case}: worst five " + ", ".join(f"{r.shape} {r.ratio:.3f}" for r in worst),
                  flush=True)
        out.extend(geo_mean_row([r for r in list(out) if r.case == case], case)
                   for case in list(dict.fromkeys(r.case for r in out)))

    launch(body, 1, cfg.device)
    return out
