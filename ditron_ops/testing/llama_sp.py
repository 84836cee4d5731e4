"""A ``transformers`` Llama decoder run sequence-parallel with ditron's ops (issue 38).

Rank r of W holds rows ``[r S_r, (r+1) S_r)`` of the sequence (every rank the same ``S_r``:
``ulysses_attention`` needs equal chunks). Per decoder layer, with the model's own modules and
weights:

attention (Ulysses)
    ``input_layernorm`` on the shard; ``q_proj`` / ``k_proj`` / ``v_proj`` as local Linears on
    the shard (replicated weights); RoPE (the model's ``rotary_emb``) at the shard's global
    positions; ``ulysses_attention(causal=True)`` over the whole sequence (heads exchanged, GQA
    with KV heads split or replicated by the op); ``o_proj`` local; the residual.
MLP (Megatron sequence + tensor parallel)
    ``post_attention_layernorm`` on the shard; ``ag_gemm``: gather every rank's normed rows and
    multiply by this rank's slice of the intermediate columns of ``gate_proj`` and ``up_proj``
    (one GEMM over the two slices stacked, ``[2 I/W, H]``); SiLU(gate) * up on the local
    intermediate slice; ``gemm_rs`` with ``down_proj``'s columns of the same slice (``[H, I/W]``):
    the rank-ordered sum over ranks, reduce-scattered back to this rank's rows; the residual.

then ``model.model.norm`` and ``lm_head`` on the shard: this rank's ``[B, S_r, V]`` logits,
which equal ``model(input_ids).logits[:, r S_r:(r+1) S_r]`` up to rounding.

The rank-dependent pieces (global positions, weight slices) are built by ``rank_weights``
outside the function being compiled, so one ``torch.compile`` graph of
``sequence_parallel_logits(model, ids, weights=...)`` with ``group=None`` serves every rank:
only the ops' context group tells the ranks apart (what issue 38's compile report was about).

Needs ``transformers`` (the ``dev`` extra), imported inside the functions that use it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from ..attention.ulysses import HEAD_DIMS, kv_heads_per_rank, ulysses_attention
from ..gemm.ag_gemm import ag_gemm
from ..gemm.gemm_rs import gemm_rs
from ..runtime.group import Group, current_group

HIDDEN = 96         # divisible by the heads of every W below (8, and 2 W = 6 at W = 3)
HEAD_DIM = 64       # ulysses_attention's head_dim is 64 or 128
INTERMEDIATE = 192  # divisible by 2, 3, 4, 8 (each rank's slice of the MLP)
VOCAB = 256
LAYERS = 2


def heads_for(world_size: int) -> tuple[int, int]:
    """``(Hq, Hkv)`` of the tiny config for W ranks: 8 / 2 for W in {1, 2, 4, 8} (KV heads split
    at W = 2, replicated at 4 and 8); ``2 W`` / ``W`` otherwise (KV heads split; W = 3: 6 / 3).
    (No one GQA config serves every W of {2, 3, 4, 8}: ``Hkv % W == 0 or W % Hkv == 0`` for
    W = 3 and 8 leaves Hkv = 1 or a multiple of 24.)"""
    if world_size in (1, 2, 4, 8):
        return 8, 2
    return 2 * world_size, world_size


def tiny_llama(world_size: int, seed: int = 0, *, hidden: int = HIDDEN, head_dim: int = HEAD_DIM,
               intermediate: int = INTERMEDIATE, vocab: int = VOCAB, layers: int = LAYERS,
               attn_implementation: str = "eager"):
    """A ``LlamaForCausalLM`` of a small random config that W ranks can run (``heads_for``), in
    fp32 and eval mode, on the CPU. Weights from ``seed``: Linear weights normal with std
    ``1 / sqrt(in_features)``, embeddings std 1, norm gains uniform in [0.5, 1.5] (the library's
    init, std 0.02 and unit gains, makes every layer nearly the identity, which would hide a
    wrong layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hq, hkv = heads_for(world_size)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=hq,
                         num_key_value_heads=hkv, head_dim=head_dim,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:  # biases (attention_bias / mlp_bias configs)
                p.normal_(0.0, 0.1)
    return model


def check_model(model, world_size: int, seq_per_rank: Optional[int] = None) -> None:
    """Raises ``ValueError`` naming the rule when ``model`` cannot run on W ranks."""
    cfg = model.config
    attn = model.model.layers[0].self_attn
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    if d not in HEAD_DIMS:
        raise ValueError(f"llama_sp: head_dim {d} must be one of {HEAD_DIMS} (ulysses_attention)")
    if hq % world_size:
        raise ValueError(f"llama_sp: {hq} attention heads are not divisible by W = {world_size}")
    kv_heads_per_rank(hkv, world_size)
    if cfg.intermediate_size % world_size:
        raise ValueError(f"llama_sp: intermediate_size {cfg.intermediate_size} is not divisible "
                         f"by W = {world_size}")
    if getattr(cfg, "pretraining_tp", 1) != 1:
        raise ValueError("llama_sp: pretraining_tp must be 1")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError("llama_sp: only the default RoPE (positions only, no dynamic update)")
    if seq_per_rank is not None and seq_per_rank < 1:
        raise ValueError(f"llama_sp: every rank needs a sequence chunk, got S_r = {seq_per_rank}")


@dataclasses.dataclass
class RankWeights:
    """What depends on the rank: built eagerly (``rank_weights``) and passed into the per-rank
    forward, so that a compiled forward is the same graph on every rank."""

    world_size: int
    """W (the same on every rank)."""
    position_ids: torch.Tensor
    """``[1, S_r]`` int64: the global positions of this rank's rows."""
    gate_up: tuple
    """Per layer ``[2 I/W, H]``: this rank's rows of ``gate_proj.weight`` then ``up_proj.weight``
    (contiguous; the GEMM reads ``.t()``, a Linear weight's layout)."""
    gate_up_bias: tuple
    """Per layer the matching ``[2 I/W]`` slice of the two biases, or None (``mlp_bias=False``)."""
    down: tuple
    """Per layer ``[H, I/W]``: ``down_proj.weight``'s columns of this rank's intermediate slice
    (contiguous)."""


def rank_weights(model, rank: int, world_size: int, seq_per_rank: int,
                 device=None) -> RankWeights:
    """Rank ``rank``'s ``RankWeights`` for chunks of ``seq_per_rank`` rows (on ``device``,
    default the model's)."""
    check_model(model, world_size, seq_per_rank)
    device = model.lm_head.weight.device if device is None else torch.device(device)
    inter = model.config.intermediate_size // world_size
    cols = slice(rank * inter, (rank + 1) * inter)
    gate_up, gate_up_bias, down = [], [], []
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            gate, up = mlp.gate_proj, mlp.up_proj
            gate_up.append(torch.cat([gate.weight[cols], up.weight[cols]]).to(device))
            gate_up_bias.append(None if gate.bias is None else
                                torch.cat([gate.bias[cols], up.bias[cols]]).to(device))
            down.append(mlp.down_proj.weight[:, cols].contiguous().to(device))
    start = rank * seq_per_rank
    positions = torch.arange(start, start + seq_per_rank, device=device).unsqueeze(0)
    return RankWeights(world_size, positions, tuple(gate_up), tuple(gate_up_bias), tuple(down))


def _attention(attn, x: torch.Tensor, cos, sin, group: Optional[Group]) -> torch.Tensor:
    """``attn`` (a ``LlamaAttention``) on this rank's normed rows ``x [B, S_r, H]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s_r, _ = x.shape
    d = attn.head_dim
    q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, s_r, -1, d)
    k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, s_r, -1, d)
    v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, s_r, -1, d)
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # [B, S_r, H, D] layout
    o = ulysses_attention(q, k, v, group, causal=True, softmax_scale=attn.scaling)
    return F.linear(o.reshape(b, s_r, -1), attn.o_proj.weight, attn.o_proj.bias)


def _mlp(mlp, x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias, down: torch.Tensor,
         group: Optional[Group]) -> torch.Tensor:
    """``mlp`` (a ``LlamaMLP``) on this rank's normed rows ``x [B, S_r, H]``: ag_gemm over the
    gathered rows of every rank, this rank's intermediate slice, gemm_rs back to its rows.
    Every rank holds ``B S_r`` rows: both ops' default (even) shard sizes."""
    b, s_r, h = x.shape
    inter = down.shape[1]
    gu = ag_gemm(x.reshape(b * s_r, h), gate_up.t(), group,
                 bias=gate_up_bias)                         # [W B S_r, 2 I/W], rank-major rows
    act = mlp.act_fn(gu[:, :inter]) * gu[:, inter:]
    out = gemm_rs(act, down.t(), group)                     # [B S_r, H]: this rank's rows
    if mlp.down_proj.bias is not None:
        out = out + mlp.down_proj.bias
    return out.view(b, s_r, h)


def sequence_parallel_logits(model, input_ids: torch.Tensor, group: Optional[Group] = None, *,
                             weights: Optional[RankWeights] = None) -> torch.Tensor:
    """This rank's logits ``[B, S_r, V]`` of ``model`` (a ``LlamaForCausalLM``) on the sequence
    whose chunk ``input_ids [B, S_r]`` this rank holds (collective: every rank calls it with the
    same ``B`` and ``S_r``).

    ``group``: the ops' group (None: the context group, e.g. inside ``ditron_ops.launch``).
    ``weights``: this rank's ``rank_weights`` (built from ``group``'s rank when None; pass it
    in for a forward compiled once for every rank). No cache, no attention mask, no padding:
    causal attention over the whole sequence, as ``model(input_ids)``.
    """
    b, s_r = input_ids.shape
    if weights is None:
        g = current_group(group)
        weights = rank_weights(model, g.rank, g.world_size, s_r, device=input_ids.device)
    inner = model.model
    h = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(h, weights.position_ids)  # [1, S_r, D]
    for i, layer in enumerate(inner.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), cos, sin, group)
        h = h + _mlp(layer.mlp, layer.post_attention_layernorm(h), weights.gate_up[i],
                     weights.gate_up_bias[i], weights.down[i], group)
    return model.lm_head(inner.norm(h))


def shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s equal chunk of ``x`` along ``dim`` (the sequence)."""
    s = x.shape[dim]
    if s % world_size:
        raise ValueError(f"llama_sp: a sequence of {s} rows cannot be split evenly over "
                         f"{world_size} ranks")
    return x.narrow(dim, rank * (s // world_size), s // world_size)


# -- per-rank bodies for ``launch`` (the CPU and GPU tests share them) -------------------------
def eager_body(group, model, ids):
    """This rank's logits, eager, ``group`` passed explicitly (the helper slices the weights)."""
    with torch.no_grad():
        return sequence_parallel_logits(model, shard(ids, group.rank, group.world_size), group)


def forward_with_context_group(model, ids, weights):
    """What the tests compile: the forward with ``group=None`` (the context's)."""
    return sequence_parallel_logits(model, ids, weights=weights)


def compiled_body(group, compiled, model, ids):
    """This rank's logits by ``compiled`` (``forward_with_context_group`` under torch.compile);
    the rank's weight slices are made eagerly here."""
    weights = rank_weights(model, group.rank, group.world_size, ids.shape[1] // group.world_size)
    with torch.no_grad():
        return compiled(model, shard(ids, group.rank, group.world_size), weights)

