"""Plain torch MoE exchange: the oracle of the tests and the layout the kernels must reproduce.

Built like a ``torch.distributed`` MoE layer: each rank sorts its entries by expert, sends each
expert owner its rows with an all-to-all, and the owner places them expert by expert, sources
in rank order (deterministic placement). ``combine_reference`` sends the expert outputs back
with the reverse all-to-all and sums them per token in fp32, slots in k order, rounding once.
fp8 quantization follows the formula ``scale = max(amax, 1e-4) / 448`` per token and 128
channels (optionally rounded up to a power of two), ``q = e4m3(x / scale)``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..reference import gather_tensors
from ..runtime.group import Group


def all_to_all(parts: Sequence[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """``parts[d]`` goes to rank d; returns what every rank sent this one, in rank order
    (``torch.distributed.all_to_all`` semantics, built on an all-gather of the packed parts)."""
    w, r = group.world_size, group.rank
    sizes = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
    all_sizes = gather_tensors(sizes, group)
    packed = gather_tensors(torch.cat(list(parts)), group)
    out = []
    for s in range(w):
        start = int(all_sizes[s][:r].sum())
        out.append(packed[s][start: start + int(all_sizes[s][r])])
    return out


def quantize_fp8(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q e4m3 [T, H], scales fp32 [T, H / 128])`` of ``x [T, H]``."""
    t, h = x.shape
    xf = x.float().reshape(t, h // 128, 128)
    amax = xf.abs().amax(dim=2).clamp(min=1e-4)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a multiplication by its
    # reciprocal, one rounding off the formula's (and the kernel's) IEEE division
    scale = amax / torch.full_like(amax, 448.0)
    if round_scale:
        bits = scale.view(torch.int32)
        scale = (((bits >> 23) + ((bits & 0x7FFFFF) != 0).int()) << 23).view(torch.float32)
    q = (xf / scale[:, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(t, h), scale


def dispatch_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                       group: Group, *, num_experts: int, max_tokens: int, layout: str = "expert_padded",
                       expert_alignment: int = 1, capacity: Optional[int] = None, fp8: bool = False,
                       round_scale: bool = False) -> dict:
    """The deterministic dispatch of this rank's ``x [T, H]`` (collective).

    Returns a dict of flat rows (``x [R, H]``, ``scales``, ``weights [R]``, ``src_of_row [R]``,
    unused rows 0 / -1), ``counts``, ``offsets``, ``cstart``, ``dest [T, k]`` and ``rows``
    (the used row indices), with the same meaning as ``Buffer.dispatch``'s outputs.
    """
    w, r = group.world_size, group.rank
    el = num_experts // w
    t, k = topk_idx.shape
    h = x.shape[1]
    cap = w * max_tokens * min(k, el) if capacity is None else capacity
    per_expert = w * max_tokens
    device = x.device
    idx = topk_idx.long().reshape(-1).cpu()
    idx = torch.where((idx >= 0) & (idx < num_experts), idx, -1)
    entries = torch.arange(t * k)
    valid = idx >= 0
    order = torch.argsort(torch.where(valid, idx, num_experts) * (t * k + 1) + entries, stable=True)
    order = order[valid[order]]  # my valid entries by (expert, entry)
    owners = idx[order] // el
    if fp8:
        rows_x, scales = quantize_fp8(x, round_scale)
        payload_x = rows_x.view(torch.uint8).cpu()
        payload_s = scales.cpu()
    else:
        payload_x, payload_s = x.cpu(), torch.zeros(t, 0)
    wts = (topk_weights.float().reshape(-1).cpu() if topk_weights is not None else torch.zeros(t * k))
    send = [order[owners == d] for d in range(w)]
    meta = all_to_all([torch.stack([idx[s], s], dim=1) for s in send], group)  # (expert, entry)
    got_x = all_to_all([payload_x[s // k] for s in send], group)
    got_s = all_to_all([payload_s[s // k] for s in send], group)
    got_w = all_to_all([wts[s] for s in send], group)
    counts_all = torch.stack(gather_tensors(torch.bincount(idx[valid], minlength=num_experts), group))
    n = counts_all.sum(0)  # [E]
    mine = torch.arange(r * el, (r + 1) * el)
    cs_all = torch.zeros(num_experts, dtype=torch.int64)  # compact start of each expert on its owner
    for d in range(w):
        seg = n[d * el:(d + 1) * el]
        cs_all[d * el:(d + 1) * el] = torch.cumsum(seg, 0) - seg
    aligned = (n[mine] + expert_alignment - 1) // expert_alignment * expert_alignment
    al_start = torch.cumsum(aligned, 0) - aligned
    rows_total = el * per_expert if layout == "expert_padded" else cap + el * (expert_alignment - 1)
    out_x = torch.zeros(rows_total, h, dtype=payload_x.dtype)
    out_s = torch.zeros(rows_total, payload_s.shape[1])
    out_w = torch.zeros(rows_total)
    src = torch.full((rows_total,), -1, dtype=torch.int64)
    used = []
    for e_local in range(el):
        e = r * el + e_local
        w_row = 0
        for s in range(w):
            pick = meta[s][:, 0] == e
            ent = meta[s][pick, 1]
            for q in range(ent.shape[0]):
                within = w_row + q
                compact = int(cs_all[e]) + within
                if compact >= cap or (layout == "expert_padded" and within >= per_expert):
                    continue
                row = e_local * per_expert + within if layout == "expert_padded" else int(al_start[e_local]) + within
                out_x[row] = got_x[s][pick][q]
                out_s[row] = got_s[s][pick][q]
                out_w[row] = got_w[s][pick][q]
                src[row] = s * max_tokens * k + int(ent[q])
                used.append(row)
            w_row += ent.shape[0]
    kept = torch.minimum(n[mine], (cap - cs_all[mine]).clamp(min=0))
    if layout == "expert_padded":
        kept = kept.clamp(max=per_expert)
        offsets = torch.arange(el + 1) * per_expert
    else:
        offsets = torch.cat([al_start, aligned.sum().reshape(1)]).clamp(max=rows_total)
    cstart = torch.cat([cs_all[mine], n[mine].sum().reshape(1)])
    # where my entries went: my position among my entries of the expert, after earlier sources
    dest = torch.full((t * k,), -1, dtype=torch.int64)
    seen = torch.zeros(num_experts, dtype=torch.int64)
    before = counts_all[:r].sum(0)
    for i in range(t * k):
        e = int(idx[i])
        if e < 0:
            continue
        within = int(before[e] + seen[e])
        seen[e] += 1
        compact = int(cs_all[e]) + within
        if compact < cap and not (layout == "expert_padded" and within >= per_expert):
            dest[i] = (e // el) * cap + compact
    if fp8:
        out_x = out_x.view(torch.float8_e4m3fn)
    return {"x": out_x.to(device), "scales": out_s.to(device) if fp8 else None, "weights": out_w.to(device),
            "src_of_row": src.int().to(device), "counts": kept.int().to(device),
            "offsets": offsets.int().to(device), "cstart": cstart.int().to(device),
            "dest": dest.reshape(t, k).int().to(device), "rows": torch.tensor(sorted(used), dtype=torch.long)}


def combine_reference(y_rows: torch.Tensor, ref: dict, topk_weights: Optional[torch.Tensor],
                      group: Group, *, num_experts: int, max_tokens: int, topk: int) -> torch.Tensor:
    """The combine of expert outputs ``y_rows [R, H]`` laid out as ``dispatch_reference``
    returned ``ref`` (collective): the used rows go back to their sources, and each token sums
    ``w[t, j] * y`` in fp32 for j in order (absent weights: 1), rounded once to y's dtype."""
    w = group.world_size
    h = y_rows.shape[1]
    rows = ref["rows"]
    src = ref["src_of_row"].cpu().long()[rows]
    owner = src // (max_tokens * topk)
    entry = src % (max_tokens * topk)
    ys = y_rows.cpu()[rows]
    back_y = all_to_all([ys[owner == s] for s in range(w)], group)
    back_i = all_to_all([entry[owner == s] for s in range(w)], group)
    t = ref["dest"].shape[0]
    slots = torch.zeros(t * topk, h, dtype=torch.float32)
    has = torch.zeros(t * topk, dtype=torch.bool)
    for s in range(w):
        slots[back_i[s]] = back_y[s].float()
        has[back_i[s]] = True
    slots, has = slots.view(t, topk, h), has.view(t, topk)
    wts = topk_weights.float().cpu() if topk_weights is not None else torch.ones(t, topk)
    acc = torch.zeros(t, h, dtype=torch.float32)
    for j in range(topk):
        acc = torch.where(has[:, j:j + 1], acc + wts[:, j:j + 1] * slots[:, j], acc)
    return acc.to(y_rows.dtype).to(y_rows.device)
