"""Plain torch attention: decode over the ranks' concatenated KV shards (oracle of flash_decode),
full-sequence attention and its Ulysses oracle (all-gather of the sequence + SDPA + slice)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from ..runtime.group import Group
from .collectives import gather_tensors


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 kv_lens: torch.Tensor, group: Group, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` over every rank's ``kv_lens[b]`` keys, concatenated
    in rank order (fp32 softmax, GQA by repeating KV heads). Collective (gathers the caches)."""
    ks, vs = gather_tensors(k_cache, group), gather_tensors(v_cache, group)
    lens = [t.tolist() for t in gather_tensors(kv_lens, group)]
    b, hq, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(b, hq, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        keys = torch.cat([k[i, :n[i]] for k, n in zip(ks, lens)]).float()    # [S, Hkv, D]
        vals = torch.cat([v[i, :n[i]] for v, n in zip(vs, lens)]).float()
        rep = hq // k_cache.shape[2]
        keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
        if keys.shape[0] == 0:
            out[i] = 0
            continue
        att = torch.einsum("hd,shd->hs", q[i].float(), keys) * scale
        out[i] = torch.einsum("hs,shd->hd", att.softmax(dim=-1), vals)
    return out.to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Attention of ``q [B, S, Hq, D]`` over ``k, v [B, S, Hkv, D]`` in fp32 (SDPA, GQA by
    repeating KV heads), returned in ``q``'s dtype. Differentiable; not collective."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (rearrange(t.float(), "b s h d -> b h s d") for t in (q, k, v))
    kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=softmax_scale)
    return rearrange(out, "b h s d -> b s h d").to(q.dtype)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                      causal: bool = False, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Oracle of ``ulysses_attention``: every rank's sequence chunk gathered (rank order =
    sequence order), ``attention`` over the whole sequence, this rank's rows. Collective."""
    full = [torch.cat(gather_tensors(t, group), dim=1) for t in (q, k, v)]
    s_r = q.shape[1]
    out = attention(*full, causal=causal, softmax_scale=softmax_scale)
    return out[:, group.rank * s_r:(group.rank + 1) * s_r].contiguous()
