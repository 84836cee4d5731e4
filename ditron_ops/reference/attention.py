"""Plain torch decode attention over the ranks' concatenated KV shards (oracle of flash_decode)."""
from __future__ import annotations

from typing import Optional

import torch

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
