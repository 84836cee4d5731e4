"""Bench ``moe``: ``Buffer.dispatch`` / ``combine`` on W virtual ranks vs a torch exchange.

Shapes (DeepSeek-V3 MoE layer; DeepEP's published settings): hidden 7168, top-8 of 256 experts,
uniform random routing, W = 8 virtual ranks (32 experts each); 128 tokens per rank in the
``expert_padded`` layout (low latency) and 4096 in ``expert_contig`` (throughput, receive
capacity ``2 T k`` rows per rank), bf16 and fp8 dispatch (combine in bf16). Per case, timed by
replaying CUDA graphs of back-to-back calls, every function in turns (``paired_graph_times``)::

    dispatch det / default    a fresh layout, deterministic and atomic placement (det_cost =
                              det / default on the default row)
    dispatch cached           with the layout of a previous dispatch (no layout kernels, no counts)
    dispatch default / cached div, rcp, split
                              fp8 cases: the same calls with the quantization variants other
                              than the Buffer's (``moe._launch.FP8_VARIANTS``; the unnamed rows
                              use ``fp8_variant``, the rule's, named in column ``variant``);
                              ``same_bits``: their deterministic dispatch equals the rule
                              variant's (codes and scales of the received rows, weights, layout)
    combine                   weighted sum back to the tokens, the virtual world's path: peers
                              read each rank's expert outputs where they are (no copy)
    combine staged            the path of every other backend: each rank first copies its
                              outputs into its symmetric staging, peers read that
    combine zero-copy         staged path with the outputs already in ``combine_input()``
                              (contig layout), so no copy
    baseline                  the same exchange in torch with the layout precomputed: per source
                              rank ``index_select`` + ``index_copy_`` (dispatch; fp8: quantized
                              by torch first), ``index_select`` * weight + ``index_add_`` (combine)

Bytes moved per rank: dispatch, the received rows (``rows x H x elem``, + fp32 scales with fp8);
combine, the expert-output rows its tokens read (``slots x H x 2``). ``GB_s`` = bytes / time;
``frac_copy`` compares it with ``copy_GB_s``, the bytes per second each rank copies with
``Tensor.copy_`` while all W ranks copy at once (each rank's share of the GPU, timed the same
way). ``traffic_frac``: the memory traffic the call makes (every byte read or written: staging
passes, remote reads, output writes) per second, over the copy's (2 x ``copy_GB_s``: a copy
reads and writes each byte), i.e. how close the call runs to the memory bound whatever its
passes; a staged combine moves 3 + 1/k bytes per counted byte against the copy's 2, so its
``frac_copy`` cannot pass about 0.64, the in-place one's about 1.8. ``programs`` is CTAs per
rank of the exchange kernels (each on its own SM; ``sms`` for all ranks). ``max_err``:
identity experts' combine vs the local expectation (bitwise 0 for bf16).

``--only`` narrows the run (comma list): ``dispatch`` / ``combine`` (the rows timed; a combine
run leaves out the fp8 cases, whose combine is the bf16 one, unless ``fp8`` is named), and
``padded`` / ``contig``, ``fp8`` / the dtype name (the cases), e.g. ``--only combine,contig``
for an A/B of the throughput combine. ``--only tokens``: instead, the fp8 dispatch rows alone,
contig layout, at 256-2048 tokens per rank (where ``moe._launch.FP8_SPLIT_MIN_VALUES`` puts the
switch between the variants); it names the same CSV as a full run: write it apart (``--out``).
"""
from __future__ import annotations

import math

import torch

from ..moe import Buffer
from ..moe._launch import FP8_VARIANTS
from ..moe.reference import quantize_fp8
from ..testing.moe_checks import identity_combine
from .harness import BenchConfig, Result, paired_graph_times, register, rows_over_worlds

BASELINE = "torch index_select/index_copy_ exchange"


def _copy_bandwidth(group, cfg: BenchConfig) -> float:
    """GB/s one rank copies while every rank copies (its share of the device)."""
    n = (1 << 20) if cfg.quick else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=group.device)
    dst = torch.empty_like(src)
    t = paired_graph_times(group, {"copy": lambda: dst.copy_(src)}, rounds=cfg.rounds,
                           target_ms=cfg.target_ms)["copy"]
    return n / t / 1e3


def _cases(cfg: BenchConfig):
    """``(tokens, hidden, topk, experts, layout, fp8)`` per case, narrowed by ``--only``."""
    if cfg.quick and "tokens" in cfg.only:
        raise ValueError("moe bench: --only tokens has no --quick cases")
    if cfg.quick:
        cases = [(4, 128, 2, 8, "expert_padded", False), (8, 128, 2, 8, "expert_contig", True)]
    elif "tokens" in cfg.only:
        cases = [(t, 7168, 8, 256, "expert_contig", True) for t in (256, 512, 1024, 2048)]
    else:
        cases = [(t, 7168, 8, 256, layout, fp8) for t, layout in ((128, "expert_padded"), (4096, "expert_contig"))
                 for fp8 in (False, True)]
    only = _only(cfg)
    layouts = only & {"padded", "contig"}
    precisions = only & {"fp8", cfg.dtype_name}
    if not precisions and _families(cfg) == {"combine"}:
        precisions = {cfg.dtype_name}  # an fp8 case's combine is the bf16 one
    return [c for c in cases if (not layouts or c[4].split("_")[1] in layouts)
            and (not precisions or ("fp8" if c[5] else cfg.dtype_name) in precisions)]


def _only(cfg: BenchConfig) -> set:
    known = {"dispatch", "combine", "padded", "contig", "fp8", "tokens", cfg.dtype_name}
    only = set(cfg.only)
    if only - known:
        raise ValueError(f"moe bench: --only takes {', '.join(sorted(known))}; got {', '.join(sorted(only - known))}")
    if "tokens" in only and only & {"combine", "padded", cfg.dtype_name}:
        raise ValueError("moe bench: --only tokens times fp8 dispatch in the contig layout only")
    return only


def _families(cfg: BenchConfig) -> set:
    if "tokens" in _only(cfg):
        return {"dispatch"}
    return (_only(cfg) & {"dispatch", "combine"}) or {"dispatch", "combine"}


def _combine_staged(buf: Buffer, y, handle):
    """``buf.combine`` through the staging (what multi-process backends run), this call only."""
    default, buf.combine_in_place = buf.combine_in_place, False
    try:
        return buf.combine(y, handle)
    finally:
        buf.combine_in_place = default


def _with_variant(buf: Buffer, variant: str, call):
    """``call()`` with ``buf``'s fp8 quantization variant set to ``variant``, this call only."""
    default, buf._fp8_variant = buf._fp8_variant, variant
    try:
        return call()
    finally:
        buf._fp8_variant = default


def _same_bits(group, a, b) -> bool:
    """Whether two deterministic fp8 dispatches gave the same outputs (received rows only:
    the others are unspecified)."""
    group.synchronize()
    group.barrier()  # no host read while a peer's kernel may spin
    used = a.handle.src_of_row >= 0
    return bool(torch.equal(a.handle.src_of_row, b.handle.src_of_row) and torch.equal(a.handle.dest, b.handle.dest)
                and torch.equal(a.counts, b.counts) and torch.equal(a.weights, b.weights)
                and all(torch.equal(getattr(a, n).reshape(used.shape[0], -1)[used].view(torch.uint8),
                                    getattr(b, n).reshape(used.shape[0], -1)[used].view(torch.uint8))
                        for n in ("x", "scales")))


def _torch_exchange(group, buf: Buffer, d, x, w, y, fp8: bool):
    """Closures timing the torch baseline with this dispatch's layout (virtual world: peers'
    tensors are addressable, exchanged once here)."""
    span = buf.max_tokens * buf.topk
    rows_out = d.handle.src_of_row.shape[0]
    staged = quantize_fp8(x)[0].view(torch.uint8) if fp8 else x
    scales = quantize_fp8(x)[1] if fp8 else None
    peers_x = group.all_gather_object((staged, scales))
    src = d.handle.src_of_row.long()
    used = torch.nonzero(src >= 0).flatten()
    gathers = []
    for s in range(group.world_size):
        mine = used[(src[used] // span) == s]
        gathers.append((mine, (src[mine] % span) // buf.topk))
    h = buf.hidden

    def dispatch():
        if fp8:  # every rank quantizes its own tokens into its staging, then gathers
            q, sc = quantize_fp8(x)
            staged.copy_(q.view(torch.uint8))
            scales.copy_(sc)
        out = torch.empty(rows_out, h, dtype=staged.dtype, device=x.device)
        out_s = torch.empty(rows_out, h // 128, device=x.device) if fp8 else None
        for s, (rows, toks) in enumerate(gathers):
            out.index_copy_(0, rows, peers_x[s][0].index_select(0, toks))
            if fp8:
                out_s.index_copy_(0, rows, peers_x[s][1].index_select(0, toks))
        return out

    flat_y = y.reshape(-1, h)
    peers = group.all_gather_object((flat_y, d.handle.src_of_row.long()))
    me = group.rank
    backs = []
    for flat, psrc in peers:
        rows = torch.nonzero((psrc >= 0) & (psrc // span == me)).flatten()
        entry = psrc[rows] % span
        backs.append((rows, entry // buf.topk, w.reshape(-1)[entry]))
    t = x.shape[0]

    def combine():
        acc = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        for (flat, _), (rows, toks, wts) in zip(peers, backs):
            acc.index_add_(0, toks, flat.index_select(0, rows).float() * wts[:, None])
        return acc.to(y.dtype)

    return dispatch, combine


def _case(group, cfg: BenchConfig, copy_gbs: float, tokens: int, hidden: int, topk: int, experts: int,
          layout: str, fp8: bool) -> list[Result]:
    cap = 2 * tokens * topk if layout == "expert_contig" else None
    with Buffer(group, num_experts=experts, max_tokens_per_rank=tokens, hidden=hidden, topk=topk,
                dtype=cfg.dtype, fp8=fp8, max_recv_tokens=cap) as buf:
        rows = _measure(group, cfg, buf, copy_gbs, tokens, layout)
        group.synchronize()
        group.barrier()
    if group.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _measure(group, cfg: BenchConfig, buf: Buffer, copy_gbs: float, tokens: int, layout: str) -> list[Result]:
    dtype, dev, world = cfg.dtype, group.device, group.world_size
    hidden, topk, experts, fp8 = buf.hidden, buf.topk, buf.num_experts, buf.fp8
    gen = torch.Generator(device="cpu").manual_seed(1000 + group.rank)
    x = torch.randn(tokens, hidden, generator=gen).to(dev, dtype)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(dev)
    w = torch.rand(tokens, topk, generator=gen).to(dev)
    d = buf.dispatch(x, idx, w, layout=layout, deterministic=True)
    y = d.x if not fp8 else (d.x.reshape(-1, hidden).float() * d.scales.reshape(-1, hidden // 128)
                              .repeat_interleave(128, 1)).to(dtype).reshape(d.x.shape)
    want = identity_combine(x, d.handle.dest, w).float()
    err = max(float((out.float() - want).abs().max()) for out in (buf.combine(y, d.handle),
                                                                   _combine_staged(buf, y, d.handle)))
    zero_copy = layout == "expert_contig"
    stage = buf.combine_input()
    if zero_copy:
        stage.copy_(y)
    ref_dispatch, ref_combine = _torch_exchange(group, buf, d, x, w, y, fp8)
    families = _families(cfg)
    fns = {}
    same = {}
    if "dispatch" in families:
        fns.update({"dispatch det": lambda: buf.dispatch(x, idx, w, layout=layout, deterministic=True),
                    "dispatch default": lambda: buf.dispatch(x, idx, w, layout=layout, deterministic=False),
                    "dispatch cached": lambda: buf.dispatch(x, None, w, handle=d.handle)})
        for variant in (v for v in FP8_VARIANTS if fp8 and v != buf._fp8_variant):
            got = _with_variant(buf, variant, lambda: buf.dispatch(x, idx, w, layout=layout, deterministic=True))
            same[variant] = int(_same_bits(group, got, d))
            fns[f"dispatch default {variant}"] = lambda v=variant: _with_variant(
                buf, v, lambda: buf.dispatch(x, idx, w, layout=layout, deterministic=False))
            fns[f"dispatch cached {variant}"] = lambda v=variant: _with_variant(
                buf, v, lambda: buf.dispatch(x, None, w, handle=d.handle))
    if "combine" in families:
        fns["combine"] = lambda: buf.combine(y, d.handle)
        fns["combine staged"] = lambda: _combine_staged(buf, y, d.handle)
        if zero_copy:
            fns["combine zero-copy"] = lambda: _combine_staged(buf, stage, d.handle)
    if "dispatch" in families:
        fns["torch dispatch"] = ref_dispatch
    if "combine" in families:
        fns["torch combine"] = ref_combine
    times = paired_graph_times(group, fns, rounds=cfg.rounds, target_ms=cfg.target_ms)
    received = int(d.counts.sum())
    slots = int((d.handle.dest >= 0).sum())
    elem = 1 if fp8 else x.element_size()
    scale_bytes = hidden // 128 * 4 if fp8 else 0
    d_bytes = received * (hidden * elem + scale_bytes)
    c_bytes = slots * hidden * x.element_size()
    # memory traffic per call: staging x (read + staged write) and the received rows (remote
    # read + local write); combine reads + output writes, + the staging copy (read + write)
    d_traffic = tokens * (hidden * x.element_size() + hidden * elem + scale_bytes) + 2 * d_bytes
    c_traffic = c_bytes + tokens * hidden * x.element_size()
    copy_traffic = 2 * received * hidden * x.element_size()
    traffic = {"combine": c_traffic, "combine staged": c_traffic + copy_traffic, "combine zero-copy": c_traffic}
    label = f"T={tokens} {layout.split('_')[1]} {'fp8' if fp8 else cfg.dtype_name}"
    rows = []
    for impl in fns:
        if impl.startswith("torch"):
            continue
        is_dispatch = impl.startswith("dispatch")
        nbytes = d_bytes if is_dispatch else c_bytes
        base = times["torch dispatch" if is_dispatch else "torch combine"]
        gbs = nbytes / times[impl] / 1e3
        moved = d_traffic if is_dispatch else traffic[impl]
        extra = {"GB_s": round(gbs, 1), "copy_GB_s": round(copy_gbs, 1),
                 "frac_copy": round(gbs / copy_gbs, 3),
                 "traffic_frac": round(moved / times[impl] / 1e3 / (2 * copy_gbs), 3),
                 "torch_GB_s": round(nbytes / base / 1e3, 1),
                 "programs": buf.programs, "sms": buf.programs * world, "max_err": err}
        if impl == "dispatch default":
            extra["det_cost"] = round(times["dispatch det"] / times[impl], 3)
        if impl.split()[-1] in same:
            extra["same_bits"] = same[impl.split()[-1]]
        elif fp8 and is_dispatch:
            extra["variant"] = buf._fp8_variant
        rows.append(Result("moe", label, world, cfg.dtype_name, impl, times[impl], BASELINE, base,
                           shape=f"{tokens}x{hidden} k{topk} E{experts}", m=tokens, n=hidden, k=topk,
                           nbytes=nbytes, model="DeepSeek-V3", extra=extra))
    return rows


def _run(group, cfg: BenchConfig) -> list[Result]:
    copy_gbs = _copy_bandwidth(group, cfg)
    rows = []
    for case in _cases(cfg):
        if case[3] % group.world_size:
            continue
        rows += _case(group, cfg, copy_gbs, *case)
    if not math.isfinite(copy_gbs):
        raise RuntimeError("moe bench: copy bandwidth not measured")
    return rows


@register("moe", help="MoE dispatch/combine (W=8 virtual, H=7168, top-8 of 256) vs a torch exchange, "
                      "GB/s vs copy bandwidth, deterministic cost", world_sizes=(8,), quick_world_sizes=(2,))
def run(cfg: BenchConfig) -> list[Result]:
    return rows_over_worlds(cfg, _run, cfg)
