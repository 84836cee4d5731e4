"""``ulysses_attention``: sequence-parallel attention (DeepSpeed-Ulysses) in one persistent kernel
per call: the packed q/k/v exchange, flash attention whose programs wait only for the chunks
they read, and the output exchange stored straight from the attention epilogue (schedule in
``_ulysses_kernels``). Backward by autograd: the inverse exchanges (``all_to_all``) around a
local attention backward, replicated KV heads' gradients summed in rank order.

Also ``local_attention``: the same kernel on one rank over ``[B, H, S, D]`` tensors, the
flash-attention forward the bench compares with SDPA.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from einops import rearrange

from .._library import define_op
from .._validation import check_tensor
from ..collectives import all_to_all
from ..deterministic import resolve_deterministic
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, op_id, resolve_group, sm_count
from ..runtime.lazy import lazy_import
from ..runtime.plan import PlanCache, tensor_key
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
launcher = lazy_import("..runtime.launcher", globals())
_kernels = lazy_import("._ulysses_kernels", globals())

PURPOSE = "ulysses"
GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.float32)
HEAD_DIMS = (64, 128)
UNIT = 1 << 24  # _ulysses_kernels.UNIT


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Tiles of the attention kernel: query rows and key rows per block, warps, pipeline stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


GPU_CONFIGS = {
    "128x128/w8/s3": AttnConfig(128, 128, 8, 3),
    "128x128/w8/s2": AttnConfig(128, 128, 8, 2),
    "128x64/w4/s3": AttnConfig(128, 64, 4, 3),
    "128x64/w8/s4": AttnConfig(128, 64, 8, 4),
}
"""Candidates the ``ulysses`` bench measures against SDPA (``local`` rows); ``GPU_CONFIG`` is
the one the op uses (the only one ``precompile`` builds). Not yet measured on the H200: 128x128 with two
warpgroups and 3 stages is the shape of FlashAttention-2's Hopper forward and of Triton's
tutorial kernel for D=128 (224 KB of shared memory at D=128, bf16)."""
GPU_CONFIG = "128x128/w8/s3"
INTERPRETER_CONFIG = AttnConfig(16, 16, 4, 1)
"""Small tiles in the interpreter (its cost is per element of every block)."""
PUSH_ROWS = {"cuda": 32, "cpu": 8}
"""Head rows (of D elements) per copy tile in the push and the tail."""


def attn_config(device: torch.device, name: Optional[str] = None) -> AttnConfig:
    """The tile configuration (rank-independent: every rank uses the same)."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return GPU_CONFIGS[name or GPU_CONFIG]


def kv_heads_per_rank(hkv: int, world_size: int) -> int:
    """KV heads each rank attends with after the exchange: ``Hkv / W`` (split) or 1 (replicated,
    ``W % Hkv == 0``). Raises ``ValueError`` naming the rule otherwise."""
    if hkv % world_size == 0:
        return hkv // world_size
    if world_size % hkv == 0:
        return 1
    raise ValueError(f"ditron.ulysses_attention: Hkv = {hkv} KV heads cannot be shared by "
                     f"W = {world_size} ranks: they are split when Hkv % W == 0 and replicated "
                     "when W % Hkv == 0")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: Optional[Group] = None, *, causal: bool = False,
                      softmax_scale: Optional[float] = None,
                      deterministic: Optional[bool] = None) -> torch.Tensor:
    """Attention over the whole sequence of ``q``, ``k``, ``v`` sharded along the sequence.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, S_r, Hq, D]``: this rank's sequence chunk (rank r holds rows ``[r S_r, (r+1) S_r)``
        of the sequence); fp16/bf16 on GPU (fp16/fp32 in the interpreter); ``D`` in {64, 128};
        ``Hq`` a multiple of the world size W.
    k, v : torch.Tensor
        ``[B, S_r, Hkv, D]``, ``q``'s dtype; ``Hq`` a multiple of ``Hkv`` (GQA) and ``Hkv % W
        == 0`` (KV heads split over the ranks) or ``W % Hkv == 0`` (each KV head replicated to
        ``W / Hkv`` ranks).
    group : Group, optional
    causal : bool
        Mask keys after the query's position in the whole sequence.
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    deterministic : bool, optional
        Defaults to the ``ditron_ops.deterministic()`` mode. The forward is deterministic in
        both modes (no atomics on data; keys in a fixed order). True: the backward's local
        attention gradient is a blockwise fp32 computation in a fixed order (slower); False: on
        GPU the flash-attention backward of PyTorch. Replicated KV heads' gradients are always
        summed in rank order in fp32 and rounded once.

    Returns
    -------
    torch.Tensor
        ``[B, S_r, Hq, D]`` in ``q``'s dtype, contiguous: this rank's rows of the attention.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same shapes (``S_r`` included),
    dtype and flags; a disagreement seen when the call's plan is built raises ``ValueError``,
    one between later calls ``DitronSizeMismatchError``. Runs on the current stream, does not
    synchronize, and is CUDA-graph capturable after one eager call with the same shapes.
    Results differ across world sizes (keys are visited in a rank-dependent order).

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # q, k zero: uniform weights over the whole sequence (2 ranks x 3 rows)
    ...     q = torch.zeros(1, 3, 2, 64, dtype=torch.float16, device=group.device)    # [B, S_r, Hq, D]
    ...     k = torch.zeros(1, 3, 1, 64, dtype=torch.float16, device=group.device)    # one KV head: replicated
    ...     v = torch.full((1, 3, 1, 64), group.rank + 1.0, dtype=torch.float16, device=group.device)
    ...     return ditron_ops.ulysses_attention(q, k, v, group)[0, :, 0, 0].tolist()
    >>> ditron_ops.launch(body, 2)[1]
    [1.5, 1.5, 1.5]
    """
    group, name = call_group(group)
    dtypes = GPU_DTYPES if group.device.type == "cuda" else CPU_DTYPES
    check_tensor("ulysses_attention", "q", q, group, dtypes, min_dim=4)
    for arg, t in (("k", k), ("v", v)):
        check_tensor("ulysses_attention", arg, t, group, (q.dtype,), min_dim=4)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ditron.ulysses_attention: q must be [B, S_r, Hq, D] and k, v equal "
                         f"[B, S_r, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, s_r, hq, d = q.shape
    hkv = k.shape[2]
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s_r, d):
        raise ValueError(f"ditron.ulysses_attention: batch, S_r and head_dim of k/v "
                         f"{tuple(k.shape)} must match q {tuple(q.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"ditron.ulysses_attention: head_dim must be one of {HEAD_DIMS}, got {d}")
    w = group.world_size
    if hq % w:
        raise ValueError(f"ditron.ulysses_attention: Hq = {hq} must be a multiple of the world "
                         f"size W = {w} (each rank attends Hq / W heads)")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"ditron.ulysses_attention: Hq = {hq} must be a multiple of Hkv = {hkv}")
    kv_heads_per_rank(hkv, w)
    if not isinstance(causal, bool):
        raise TypeError(f"ditron.ulysses_attention: causal must be a bool, got {causal!r}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    flag = resolve_deterministic(deterministic)
    return torch.ops.ditron.ulysses_attention(q, k, v, name, causal, scale, flag)


# -- the kernel's arguments -------------------------------------------------------------------

def kernel_args(q, k, v, q_desc, kv_desc, buf, buf_table, out, sig, sig_table, claim, record, *,
                dims, strides, offsets, causal, scale, merge_runs, pack, fingerprint,
                timeout_us, op_id, d, cfg: AttnConfig, push_rows: Optional[int] = None):
    """``(args, kwargs)`` of ``ulysses_attention_kernel``. ``dims = (B, S_r, Hq, Hkv, Hq_l,
    Hkv_l, rank, W)``, ``strides`` q/k/v/out (b, s, h) in elements, ``offsets = (q_off, k_off,
    v_off, stage_off, half_elems)`` in elements; ``push_rows`` defaults to ``q``'s device's."""
    args = (q, k, v, q_desc, kv_desc, kv_desc, buf, buf_table, out, sig, sig_table, claim, record,
            *dims, *strides, *offsets, int(causal), float(scale), int(merge_runs), int(pack),
            int(fingerprint), int(timeout_us), int(op_id))
    kwargs = dict(D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_R=push_rows or PUSH_ROWS["cuda" if q.device.type == "cuda" else "cpu"],
                  VEC=16 // q.element_size(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return args, kwargs


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the kernel can read it as is (head_dim contiguous, 16-byte aligned base and
    strides: the kernel's one specialization), else a contiguous copy."""
    vec = 16 // t.element_size()
    if (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s % vec == 0 for s in t.stride()[:-1])):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def check_int32(op: str, args) -> None:
    """Every integer kernel argument fits 32 bits: a larger one would make Triton compile a
    64-bit variant (not among ``precompile``'s). Raises ``ValueError`` for such sizes."""
    big = [a for a in args if isinstance(a, int) and not -2**31 <= a < 2**31]
    if big:
        raise ValueError(f"ditron.{op}: sizes or buffer offsets reach {max(big)} elements "
                         "(2^31 or more); split the batch")


def _fingerprint(*values) -> int:
    """A nonzero 30-bit summary of what every rank must agree on (a 32-bit kernel argument)."""
    h = 0
    for ch in repr(values).encode():
        h = (h * 131 + ch) % ((1 << 30) - 35)
    return h + 1


def _agree(group: Group, q, k, causal: bool, scale: float) -> None:
    """Every rank passes the same shapes and flags (``runtime.agreement``; S_r too: the
    sequence chunks are equal)."""
    b, s_r, hq, d = q.shape
    agree(group, "ulysses_attention", (("dtype", q.dtype), ("B", b), ("S_r", s_r), ("Hq", hq),
                                       ("Hkv", k.shape[2]), ("D", d), ("causal", causal),
                                       ("softmax_scale", scale)))


def _region(elems: int, elem_size: int) -> int:
    """``elems`` rounded up to 512 bytes (regions start aligned for TMA and vector stores)."""
    unit = 512 // elem_size
    return -(-elems // unit) * unit


class _UlyssesPlan:
    """ulysses_attention on a group with symmetric memory, for one key: the workspace regions,
    the descriptors over them and the bound launch."""

    def __init__(self, group: Group, q, k, v, out, causal: bool, scale: float):
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415 (lazy: Triton)

        self.group = group
        w, rank = group.world_size, group.rank
        b, s_r, hq, d = q.shape
        hkv = k.shape[2]
        hq_l, hkv_l = hq // w, kv_heads_per_rank(hkv, w)
        cfg = attn_config(q.device)
        seq, elem = s_r * w, q.element_size()
        nqb = -(-s_r // cfg.block_m)
        if b * hq_l * nqb >= UNIT // 2:
            raise ValueError(f"ditron.ulysses_attention: {b * hq_l * nqb} output tiles per rank "
                             "exceed the signal unit; split the batch")
        q_off = 0
        k_off = q_off + _region(b * hq_l * seq * d, elem)
        v_off = k_off + _region(b * hkv_l * seq * d, elem)
        stage_off = v_off + _region(b * hkv_l * seq * d, elem)
        half_need = stage_off + _region(b * s_r * hq * d, elem)
        self.ws = ws = group.workspace(PURPOSE)
        self.data = data = ws.ensure_data(2 * half_need * elem)
        half_elems = data.nbytes // 2 // 512 * 512 // elem  # fixed halves of the current buffer
        buf = data.local.view(q.dtype)
        rows = buf.numel() // d
        view = buf[:rows * d].view(rows, d)
        q_desc = TensorDescriptor(view, [rows, d], [d, 1], [cfg.block_m, d])
        kv_desc = TensorDescriptor(view, [rows, d], [d, 1], [cfg.block_n, d])
        record, claim = group._error_tensors()
        tiles = w * nqb * b * hq_l
        programs = 1 if q.device.type != "cuda" else max(1, min(group.sm_share(), tiles))
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
        args, kwargs = kernel_args(
            q, k, v, q_desc, kv_desc, buf, data.ptr_table, out, ws.signal_pad(),
            ws.signal.ptr_table, claim, record, dims=(b, s_r, hq, hkv, hq_l, hkv_l, rank, w),
            strides=strides, offsets=(q_off, k_off, v_off, stage_off, half_elems), causal=causal,
            scale=scale, merge_runs=s_r % cfg.block_n == 0, pack=1,
            fingerprint=_fingerprint(b, s_r, hq, hkv, d, str(q.dtype), causal, scale),
            timeout_us=group.timeout_us(), op_id=op_id("ulysses_attention"), d=d, cfg=cfg)
        check_int32("ulysses_attention", args)
        self.kernel = launcher.BoundKernel(_kernels.ulysses_attention_kernel, (programs,), args,
                                           kwargs, vary=("q_ptr", "k_ptr", "v_ptr", "out_ptr"),
                                           device=q.device)

    def stale(self) -> bool:
        """The workspace grew since (another call's plan): the regions are of a freed buffer."""
        return self.ws.data is not self.data

    def run(self, q, k, v, out) -> torch.Tensor:
        group, ws = self.group, self.ws
        ws.calls += 1
        with group.waiting_launch("ulysses_attention", ws.calls):
            self.kernel.launch(q, k, v, out)
        if group.sync_check:
            group.synchronize()
        return out


def _impl(q, k, v, group_name, causal, softmax_scale, deterministic):
    group = resolve_group(group_name)
    if q.numel() == 0:
        return q.new_empty(q.shape)
    if not group.has_symmetric_memory:
        _agree(group, q, k, causal, softmax_scale)
        return unfused_attention(q, k, v, group, causal, softmax_scale)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = q.new_empty(q.shape)
    group.check()
    _agree(group, q, k, causal, softmax_scale)
    key = ("ulysses_attention", causal, softmax_scale, tensor_key(q), tensor_key(k),
           tensor_key(v))
    plan = group.plans.get(key, lambda previous=None: _UlyssesPlan(  # (allocates nothing)
        group, q, k, v, out, causal, softmax_scale))
    return plan.run(q, k, v, out)


def _fake(q, k, v, group_name, causal, softmax_scale, deterministic):
    return q.new_empty(q.shape)


define_op("ulysses_attention(Tensor q, Tensor k, Tensor v, str group_name, bool causal, "
          "float softmax_scale, bool deterministic) -> Tensor", _impl, _fake)


# -- the unfused composition (groups without symmetric memory; the bench's baseline) ----------

def kv_for_ranks(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``x [B, S_r, Hkv, D]`` as the KV heads every rank attends with, in rank order (what the
    fused kernel's addressing sends): ``x`` when split, else ``x[:, :, d Hkv / W]`` for every
    rank d (a copy; ``[B, S_r, W, D]``)."""
    hkv = x.shape[2]
    if hkv % world_size == 0:
        return x
    return x[:, :, [d * hkv // world_size for d in range(world_size)]]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """``scaled_dot_product_attention`` of ``[B, Hq, S, D]`` over ``[B, Hkv, S, D]`` (GQA)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def unfused_attention(q, k, v, group: Group, causal: bool, scale: float,
                      attend=sdpa) -> torch.Tensor:
    """``all_to_all`` (heads out, sequence in) of q, k, v -> ``attend`` (SDPA) ->
    ``all_to_all`` back: the composition the fused kernel replaces."""
    w = group.world_size
    heads = [all_to_all(x, 2, 1, group) for x in (q, kv_for_ranks(k, w), kv_for_ranks(v, w))]
    qh, kh, vh = (rearrange(x, "b s h d -> b h s d") for x in heads)
    o = attend(qh, kh, vh, causal, scale)
    return all_to_all(rearrange(o, "b h s d -> b s h d").contiguous(), 1, 2, group)


# -- backward -------------------------------------------------------------------------------

BACKWARD_BLOCK = 256
"""Query rows per step of the deterministic backward (fixed: never derived from the sizes)."""


def _blockwise_backward(q, k, v, do, causal: bool, scale: float):
    """Gradients of attention (``[B, H, S, D]``, equal heads) in fp32, query blocks of
    ``BACKWARD_BLOCK`` rows in order: the result depends only on the inputs."""
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    s = q.shape[2]
    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    keys = torch.arange(s, device=q.device)
    for m0 in range(0, s, BACKWARD_BLOCK):
        qb, dob = qf[:, :, m0:m0 + BACKWARD_BLOCK], dof[:, :, m0:m0 + BACKWARD_BLOCK]
        scores = (qb @ kf.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(m0, m0 + qb.shape[2], device=q.device)
            scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        delta = (dob * (p @ vf)).sum(-1, keepdim=True)
        dv += p.transpose(-1, -2) @ dob
        ds = p * (dob @ vf.transpose(-1, -2) - delta)
        dq[:, :, m0:m0 + BACKWARD_BLOCK] = (ds @ kf) * scale
        dk += (ds.transpose(-1, -2) @ qb) * scale
    return dq, dk, dv


def _group_sum(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[B, Hkv g, S, D]`` -> ``[B, Hkv, S, D]``: the g query heads of each KV head summed in
    order, fp32."""
    parts = rearrange(x.float(), "b (h g) s d -> g b h s d", g=g)
    acc = parts[0].clone()
    for i in range(1, g):
        acc += parts[i]
    return acc


def local_attention_backward(q, k, v, do, causal: bool, scale: float, deterministic: bool):
    """Gradients of ``sdpa(q, k, v)`` (``[B, Hq, S, D]``, ``[B, Hkv, S, D]``): ``dq`` in q's
    dtype, ``dk``, ``dv`` in fp32. GPU default mode: PyTorch's flash-attention backward (on KV
    heads repeated to Hq); else ``_blockwise_backward``."""
    g = q.shape[1] // k.shape[1]
    kx, vx = (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)) if g > 1 else (k, v)
    if q.is_cuda and not deterministic:
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        out, lse, cq, ck, mq, mk, seed, offset, _ = flash(q, kx, vx, 0.0, causal, False,
                                                          scale=scale)
        dq, dkx, dvx = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, kx, vx, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)
    else:
        dq, dkx, dvx = _blockwise_backward(q, kx, vx, do, causal, scale)
    return dq.to(q.dtype), _group_sum(dkx, g), _group_sum(dvx, g)


def replica_sum(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, S_r, W, D]`` (slot d: rank d's gradient of KV head ``d Hkv / W``) -> ``[B, S_r, Hkv,
    D]``: each head's ``W / Hkv`` replicas summed in rank order in fp32."""
    parts = rearrange(x.float(), "b s (h r) d -> r b s h d", h=hkv)
    acc = parts[0].clone()
    for i in range(1, parts.shape[0]):
        acc += parts[i]
    return acc


def attention_backward(q, k, v, grad_out, group_name: str, causal: bool, scale: float,
                       deterministic: bool):
    """``(dq, dk, dv)`` of ``ulysses_attention`` on this rank (collective): the forward's
    exchange again, the local backward, the inverse exchange. The exchanges are the ops
    themselves, not the public wrapper: AOTAutograd traces this with fake tensors, where the
    wrapper's validation and agreement must not run; the forward validated these shapes."""
    w, hkv = resolve_group(group_name).world_size, k.shape[2]
    heads = [torch.ops.ditron.all_to_all(x.contiguous(), group_name, 2, 1)
             for x in (q, kv_for_ranks(k, w), kv_for_ranks(v, w), grad_out)]
    qh, kh, vh, doh = (rearrange(x, "b s h d -> b h s d") for x in heads)
    dqh, dkh, dvh = local_attention_backward(qh, kh, vh, doh, causal, scale, deterministic)

    def back(x):  # [B, H_l, S, D] -> [B, S_r, H, D]
        return torch.ops.ditron.all_to_all(rearrange(x, "b h s d -> b s h d").contiguous(),
                                           group_name, 1, 2)

    dq = back(dqh)
    if hkv % w == 0:
        return dq, back(dkh.to(k.dtype)), back(dvh.to(v.dtype))
    return dq, replica_sum(back(dkh), hkv).to(k.dtype), replica_sum(back(dvh), hkv).to(v.dtype)


def _setup(ctx, inputs, output):
    q, k, v, group_name, causal, scale, deterministic = inputs
    ctx.save_for_backward(q, k, v)
    ctx.group_name, ctx.causal, ctx.scale, ctx.deterministic = (group_name, causal, scale,
                                                                deterministic)


def _backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = attention_backward(q, k, v, grad_out, ctx.group_name, ctx.causal, ctx.scale,
                                    ctx.deterministic)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("ditron::ulysses_attention", _backward, setup_context=_setup)


# -- local attention (one rank, no exchange) -------------------------------------------------

_LOCAL_PLANS = PlanCache(None)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None,
                    config: Optional[str] = None) -> torch.Tensor:
    """The attention kernel alone: ``q [B, Hq, S, D]`` over ``k, v [B, Hkv, S, D]`` (contiguous,
    ``Hq`` a multiple of ``Hkv``) -> ``[B, Hq, S, D]``. ``config`` names one of ``GPU_CONFIGS``
    (default ``GPU_CONFIG``). Not collective; for benchmarks and tests."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError("ditron.local_attention: q must be [B, Hq, S, D] and k, v "
                         f"[B, Hkv, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[3] not in HEAD_DIMS:
        raise ValueError("ditron.local_attention: Hq must be a multiple of Hkv and D one of "
                         f"{HEAD_DIMS}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q)
    key = ("local_attention", config, causal, scale, tensor_key(q), tensor_key(k), tensor_key(v))
    plan = _LOCAL_PLANS.get(key, lambda: _LocalPlan(q, k, v, out, causal, scale, config))
    d = q.shape[3]
    plan.kernel.launch(q, k, v, q.view(-1, d), k.view(-1, d), v.view(-1, d), out)
    return out


class _LocalPlan:
    """``local_attention``'s bound launch for one key (descriptors per call over the inputs)."""

    def __init__(self, q, k, v, out, causal: bool, scale: float, config: Optional[str]):
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415 (lazy: Triton)

        b, hq, s, d = q.shape
        cfg = attn_config(q.device, config)
        self.sig, _, self.claim, self.record = one_rank_pad(q.device)
        q_desc = TensorDescriptor(q.view(-1, d), [b * hq * s, d], [d, 1], [cfg.block_m, d])
        kv_desc = TensorDescriptor(k.view(-1, d), [k.numel() // d, d], [d, 1], [cfg.block_n, d])
        tiles = -(-s // cfg.block_m) * b * hq
        programs = 1 if q.device.type != "cuda" else max(1, min(sm_count(q.device), tiles))
        zeros = (0,) * 9
        args, kwargs = kernel_args(
            q, k, v, q_desc, kv_desc, launcher.unused_pointer(q.device, q.dtype), self.sig, out,
            self.sig, self.sig, self.claim,
            self.record, dims=(b, s, hq, k.shape[1], hq, k.shape[1], 0, 1),
            strides=(*zeros, hq * s * d, d, s * d), offsets=(0, 0, 0, 0, 0), causal=causal,
            scale=scale, merge_runs=0, pack=0, fingerprint=1, timeout_us=10**6, op_id=0, d=d,
            cfg=cfg)
        self.kernel = launcher.BoundKernel(_kernels.ulysses_attention_kernel, (programs,), args,
                                           kwargs, vary=("q_ptr", "k_ptr", "v_ptr", "q_desc",
                                                         "k_desc", "v_desc", "out_ptr"),
                                           device=q.device)


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """``GPU_CONFIG`` for every dtype and head_dim as a one-rank launch (``runtime.precompile``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415 (lazy: Triton)

    cfg = attn_config(device)
    for dtype in (dt for dt in GPU_DTYPES if dt in dtypes):
        for d in HEAD_DIMS:
            sig, sig_table, claim, record = one_rank_pad(device)
            q = k = v = torch.zeros(1, 80, 2, d, dtype=dtype, device=device)
            out = torch.empty_like(q)
            buf = torch.zeros(2 * 4 * 80 * 2 * d + 4096, dtype=dtype, device=device)
            rows = buf.numel() // d
            view = buf[:rows * d].view(rows, d)
            half = buf.numel() // 2 // 256 * 256
            args, kwargs = kernel_args(
                q, k, v, TensorDescriptor(view, [rows, d], [d, 1], [cfg.block_m, d]),
                TensorDescriptor(view, [rows, d], [d, 1], [cfg.block_n, d]), buf,
                pointer_table(buf), out, sig, sig_table, claim, record,
                dims=(1, 80, 2, 2, 2, 2, 0, 1), strides=(*q.stride()[:3],) * 3 + out.stride()[:3],
                offsets=(0, 160 * d, 320 * d, 480 * d, half), causal=True, scale=d ** -0.5,
                merge_runs=0, pack=1, fingerprint=1, timeout_us=10**6, op_id=0, d=d, cfg=cfg)
            launcher.BoundKernel(_kernels.ulysses_attention_kernel, (2,), args, kwargs, device=device)


register_precompile(PURPOSE, _precompile, ("ulysses_attention",))
