"""``flash_decode``: decode attention of every rank's queries over the KV cache sharded (along
the sequence) across the ranks: local split-KV partials, exchanged through the pointer table
with signals, merged by log-sum-exp (schedule in ``_kernels``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _env
from .._library import define_op
from .._validation import check_tensor
from ..ag_gemm._kernels import ag_start_kernel
from ..deterministic import resolve_deterministic
from ..runtime.group import Group, current_group, op_id, resolve_group, sm_count
from ..runtime.warmup import one_rank_pad, pointer_table, register_warmup
from ._kernels import decode_merge_kernel, split_kv_kernel

PURPOSE = "flash_decode"
GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.float32)
HEAD_DIMS = (64, 128)
DETERMINISTIC_CHUNK = 512
"""KV chunk of one split-KV program in deterministic mode (fixed: never derived from the batch
or the number of SMs)."""


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
                 group: Optional[Group] = None, *, softmax_scale: Optional[float] = None,
                 deterministic: Optional[bool] = None) -> torch.Tensor:
    """Attention of ``q`` over the concatenation of every rank's KV shard (one decode step).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]``, the same on every rank; fp16/bf16 on GPU (fp16/fp32 in the interpreter);
        ``D`` in {64, 128}.
    k_cache, v_cache : torch.Tensor
        ``[B, S_max, Hkv, D]``: this rank's shard of the sequence; ``Hq`` a multiple of ``Hkv``
        (GQA); last dimension contiguous.
    kv_lens : torch.Tensor
        ``[B]`` int32/int64 on the device: valid keys of each sequence on this rank (0 allowed).
    group : Group, optional
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    deterministic : bool, optional
        Defaults to the ``ditron_ops.deterministic()`` mode. True: fixed chunk of
        ``DETERMINISTIC_CHUNK`` keys and a fixed merge order (a rank's chunks in order, then
        ranks 0..W-1) in fp32: bitwise identical run to run and batch invariant. False: the
        chunk shrinks when the batch is too small to fill the GPU (faster, not batch invariant).

    Returns
    -------
    torch.Tensor
        ``[B, Hq, D]`` in ``q``'s dtype, identical on every rank.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same ``B``, ``Hq``, ``Hkv``,
    ``D``, dtype and mode (``S_max`` and ``kv_lens`` may differ). Runs on the current stream,
    does not synchronize, and is CUDA-graph capturable after one eager call with the same shapes.
    """
    group = current_group(group)
    dtypes = GPU_DTYPES if group.device.type == "cuda" else CPU_DTYPES
    check_tensor("flash_decode", "q", q, group, dtypes, min_dim=3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor("flash_decode", name, t, group, (q.dtype,), min_dim=4)
    check_tensor("flash_decode", "kv_lens", kv_lens, group, (torch.int32, torch.int64), min_dim=1)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"ditron.flash_decode: q must be [B, Hq, D] and k_cache/v_cache equal "
                         f"[B, S_max, Hkv, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or tuple(kv_lens.shape) != (b,):
        raise ValueError(f"ditron.flash_decode: batch/head_dim disagree: q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, kv_lens {tuple(kv_lens.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"ditron.flash_decode: head_dim must be one of {HEAD_DIMS}, got {d}")
    if hq % k_cache.shape[2]:
        raise ValueError(f"ditron.flash_decode: Hq = {hq} must be a multiple of Hkv = {k_cache.shape[2]}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("ditron.flash_decode: the head_dim (last) dimension must be contiguous")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    flag = resolve_deterministic(deterministic)
    return torch.ops.ditron.flash_decode(q, k_cache, v_cache, kv_lens, group.group_name, scale, flag)


def chunk_size(group: Group, batch: int, kv_heads: int, s_max: int, deterministic: bool) -> int:
    """Keys per split-KV program: fixed when deterministic; otherwise halved (down to 128)
    while the grid would not give every SM two programs."""
    chunk = DETERMINISTIC_CHUNK
    if deterministic or group.device.type != "cuda":
        return chunk
    sms = sm_count(group.device)
    while chunk > 128 and batch * kv_heads * -(-max(s_max, 1) // chunk) < 2 * sms:
        chunk //= 2
    return chunk


def merge_programs(group: Group) -> int:
    """Programs of the merge kernel (they wait: all ranks' must be resident together)."""
    return max(1, min(64, group.sm_share())) if group.device.type == "cuda" else 1


def _launch_split_kv(q, k, v, lens, o_part, lse_part, scale, chunk, num_chunks) -> None:
    b, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    interp = q.device.type != "cuda"
    split_kv_kernel[(b, hkv, num_chunks)](
        q, k, v, lens, o_part, lse_part, scale, chunk, num_chunks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HQ=hq, G=g, D=d, BLOCK_G=max(16, 1 << (g - 1).bit_length()),
        BLOCK_N=16 if interp else 64, num_warps=4 if interp else 8,
        num_stages=1 if interp else 3)  # 8 warps: no register spills at D=128 (ptxas, sm_90a)


def _impl(q, k_cache, v_cache, kv_lens, group_name, softmax_scale, deterministic):
    group = resolve_group(group_name)
    b, hq, d = q.shape
    out = q.new_empty((b, hq, d))
    if b == 0:
        return out
    chunk = chunk_size(group, b, k_cache.shape[2], k_cache.shape[1], deterministic)
    num_chunks = max(1, -(-k_cache.shape[1] // chunk))
    o_part = torch.empty(b * hq * num_chunks * d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(b * hq * num_chunks, dtype=torch.float32, device=q.device)
    _launch_split_kv(q, k_cache, v_cache, kv_lens, o_part, lse_part, softmax_scale, chunk, num_chunks)
    if not group.has_symmetric_memory:
        return _merge_over_process_group(group, o_part, lse_part, b, hq, d, num_chunks).to(q.dtype)
    group.check()
    ws = group.workspace(PURPOSE)
    w, rank = group.world_size, group.rank
    pairs = b * hq
    data = ws.ensure_data(w * pairs * (d + 1) * 4)
    record, claim = group._error_tensors()
    sig = ws.signal_pad()
    ws.calls += 1
    with group.waiting_launch("flash_decode", ws.calls):
        ag_start_kernel[(1,)](sig, ws.signal.ptr_table, claim, record, rank, w, 0,
                              group.timeout_us(), op_id("flash_decode"))
        decode_merge_kernel[(merge_programs(group),)](
            o_part, lse_part, out, data.local.view(torch.float32), data.ptr_table, sig,
            ws.signal.ptr_table, claim, record, pairs, num_chunks, rank, w, group.timeout_us(),
            op_id("flash_decode"), D=d, num_warps=4)
    if _env.sync_check():
        group.synchronize()
    return out


def _fold(o_acc: torch.Tensor, lse_acc: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor):
    """The kernels' merge of two partials (fp32), vectorised over (batch, head) pairs."""
    top = torch.maximum(lse_acc, lse_new)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    lse = safe + torch.log(torch.exp(lse_acc - safe) + torch.exp(lse_new - safe))
    merged = o_acc * torch.exp(lse_acc - lse)[:, None] + o_new * torch.exp(lse_new - lse)[:, None]
    empty_new, empty_acc = torch.isneginf(lse_new), torch.isneginf(lse_acc)
    o = torch.where(empty_new[:, None], o_acc, torch.where(empty_acc[:, None], o_new, merged))
    return o, torch.where(empty_new, lse_acc, torch.where(empty_acc, lse_new, lse))


def _merge_over_process_group(group: Group, o_part, lse_part, b, hq, d, num_chunks) -> torch.Tensor:
    """Groups without symmetric memory (torch backend): the same merge order in torch, the
    per-rank partials exchanged with ``gather_tensors``."""
    from ..reference import gather_tensors

    o_part, lse_part = o_part.view(b * hq, num_chunks, d), lse_part.view(b * hq, num_chunks)
    o = torch.zeros(b * hq, d, dtype=torch.float32, device=o_part.device)
    lse = torch.full((b * hq,), float("-inf"), dtype=torch.float32, device=o_part.device)
    for c in range(num_chunks):
        o, lse = _fold(o, lse, o_part[:, c], lse_part[:, c])
    parts = gather_tensors(torch.cat([o, lse[:, None]], dim=1), group)
    o = torch.zeros_like(o)
    lse = torch.full_like(lse, float("-inf"))
    for part in parts:
        o, lse = _fold(o, lse, part[:, :d], part[:, d])
    return o.view(b, hq, d)


def _fake(q, k_cache, v_cache, kv_lens, group_name, softmax_scale, deterministic):
    return q.new_empty(q.shape)


define_op("flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, str group_name, "
          "float softmax_scale, bool deterministic) -> Tensor", _impl, _fake)


def _warmup(device: torch.device) -> None:
    """Compile split-KV (dtype x head_dim x common GQA groups) and the merge kernel (one rank)."""
    # W=1 pad: start count 1, epoch 1 (the arrival comes from the merge itself)
    sig, sig_table, claim, record = one_rank_pad(device, (0, 1, 0, 1))
    lens = torch.full((1,), 64, dtype=torch.int32, device=device)
    for dtype in GPU_DTYPES:
        for d in HEAD_DIMS:
            for g in (1, 4, 8):
                q = torch.ones(1, g, d, dtype=dtype, device=device)
                kv = torch.ones(1, 64, 1, d, dtype=dtype, device=device)
                o_part = torch.empty(g * d, dtype=torch.float32, device=device)
                lse_part = torch.empty(g, dtype=torch.float32, device=device)
                _launch_split_kv(q, kv, kv, lens, o_part, lse_part, 0.1, DETERMINISTIC_CHUNK, 1)
            buf = torch.zeros(d + 1, dtype=torch.float32, device=device)
            table = pointer_table(buf)
            out = torch.empty(1, 1, d, dtype=dtype, device=device)
            sig[0] = 0
            sig[3] = 1
            decode_merge_kernel[(1,)](o_part[:d], lse_part[:1], out, buf, table, sig, sig_table,
                                      claim, record, 1, 1, 0, 1, 10**6, 0, D=d, num_warps=4)
            torch.cuda.synchronize(device)
            if int(record[0]) != 0 or not torch.allclose(out.float(), torch.ones_like(out.float()), atol=1e-2):
                raise RuntimeError(f"ditron: flash_decode warm-up failed for {dtype}, D={d} (kernel bug)")


register_warmup(PURPOSE, _warmup)
