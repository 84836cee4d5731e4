"""Model-shape registry for the benchmarks (research/anchors.md section d).

The layer shapes are the ``LAYER_CONFIGS`` that Triton-distributed's AG-GEMM / GEMM-RS benchmarks
sweep (``python/triton_dist/test/utils.py``): ``N`` is the full output width of the
tensor-parallel GEMM (split over the ranks), ``K`` the hidden size (the reduction dimension of
AG-GEMM and the output width of GEMM-RS). The token count is ``M = 8192`` and the tensor-parallel
degree 8, as in those benchmarks::

    AG-GEMM  (per rank):  A[M/W, K] --all_gather--> A[M, K] @ B[K, N/W] -> C[M, N/W]
    GEMM-RS  (per rank):  A[M, N/W] @ B[N/W, K] -> C[M, K] --reduce_scatter--> C[M/W, K]

So the collective messages of one layer are ``M x K`` elements, and the local GEMM of one rank is
``M x N/W x K`` (``local_gemm_shape``).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

__all__ = ["ModelShape", "LAYER_CONFIGS", "DEFAULT_M", "DEFAULT_WORLD_SIZE", "get_model",
           "local_gemm_shape", "local_gemm_shapes", "hidden_sizes"]

DEFAULT_M = 8192
"""Tokens per step (rows of the gathered activation) in the Triton-distributed benchmarks."""

DEFAULT_WORLD_SIZE = 8
"""Tensor-parallel degree the per-rank shapes are quoted for."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """One tensor-parallel MLP layer of a real model.

    Attributes
    ----------
    name : str
        Model name as in the Triton-distributed shape list.
    n : int
        Full output width of the column-parallel GEMM (the MLP intermediate size).
    k : int
        Hidden size (reduction dimension of AG-GEMM, output width of GEMM-RS).
    """

    name: str
    n: int
    k: int


LAYER_CONFIGS: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("LLaMA-7B", 11008, 4096),
    ModelShape("LLaMA-3.1-8B", 14336, 4096),
    ModelShape("LLaMA-3.1-70B", 28672, 8192),
    ModelShape("LLaMA-3.1-405B", 53248, 16384),
    ModelShape("Mistral-7B", 14336, 4096),
    ModelShape("Qwen2-72B", 29568, 8192),
    ModelShape("GPT-3-175B", 49152, 12288),
)}


def get_model(name: str) -> ModelShape:
    """Look up a model by name (case-insensitive).

    Raises
    ------
    ValueError
        For an unknown name; the message lists the known ones.
    """
    for key, shape in LAYER_CONFIGS.items():
        if key.lower() == name.lower():
            return shape
    raise ValueError(f"ditron.bench: unknown model {name!r}; known: {', '.join(LAYER_CONFIGS)}")


def local_gemm_shape(model: "ModelShape | str", world_size: int = DEFAULT_WORLD_SIZE,
                     m: int = DEFAULT_M) -> tuple[int, int, int]:
    """Per-rank local GEMM ``(M, N / W, K)`` of one model layer.

    Parameters
    ----------
    model : ModelShape or str
    world_size : int
        Tensor-parallel degree W (default 8). ``N`` must be divisible by it.
    m : int
        Token count M (default 8192).

    Returns
    -------
    tuple of int
        ``(m, n // world_size, k)``: the GEMM each rank runs in AG-GEMM (and, with the roles of
        N/W and K swapped, in GEMM-RS).
    """
    shape = get_model(model) if isinstance(model, str) else model
    if world_size < 1 or shape.n % world_size:
        raise ValueError(f"ditron.bench: N={shape.n} of {shape.name} is not divisible by "
                         f"world_size={world_size}")
    return m, shape.n // world_size, shape.k


def local_gemm_shapes(world_size: int = DEFAULT_WORLD_SIZE, m: int = DEFAULT_M,
                      models: Optional[Iterable[str]] = None) -> dict[str, tuple[int, int, int]]:
    """``{model name: local_gemm_shape(model, world_size, m)}`` for every (or the given) model."""
    names = LAYER_CONFIGS if models is None else [get_model(n).name for n in models]
    return {name: local_gemm_shape(LAYER_CONFIGS[name], world_size, m) for name in names}


def hidden_sizes() -> dict[int, list[str]]:
    """Distinct hidden sizes K, ascending, each with the models that use it.

    Collective messages depend only on ``M x K``, so the collective bench runs one case per K.
    """
    out: dict[int, list[str]] = {}
    for shape in LAYER_CONFIGS.values():
        out.setdefault(shape.k, []).append(shape.name)
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    """One public decoder model's attention and MLP sizes (its ``config.json``).

    Attributes
    ----------
    name : str
    hidden, intermediate : int
        Hidden and MLP intermediate sizes.
    heads, kv_heads, head_dim : int
        Query heads, key/value heads (GQA) and head size.
    """

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def shards(self, tp: int) -> dict[str, tuple[int, int]]:
        """The per-rank ``(N, K)`` of the four Linear layers at tensor parallelism ``tp``
        (Megatron layout: QKV and gate/up column-parallel, O and down row-parallel); key/value
        heads fewer than ``tp`` are replicated (one per rank), as serving engines do. Empty
        where the query heads or the MLP do not split evenly."""
        if self.heads % tp or self.intermediate % tp:
            return {}
        kv = max(1, self.kv_heads // tp)
        return {"qkv": ((self.heads // tp + 2 * kv) * self.head_dim, self.hidden),
                "o": (self.hidden, self.heads // tp * self.head_dim),
                "gate_up": (2 * self.intermediate // tp, self.hidden),
                "down": (self.hidden, self.intermediate // tp)}


MODEL_CONFIGS: dict[str, DenseConfig] = {c.name: c for c in (
    DenseConfig("Llama-3-8B", 4096, 14336, 32, 8, 128),
    DenseConfig("Llama-3-70B", 8192, 28672, 64, 8, 128),
    DenseConfig("Mistral-Large-2", 12288, 28672, 96, 8, 128),
    DenseConfig("Gemma-2-9B", 3584, 14336, 16, 8, 256),
    DenseConfig("Gemma-2-27B", 4608, 36864, 32, 16, 128),
    DenseConfig("Phi-3-medium", 5120, 17920, 40, 10, 128),
    DenseConfig("Qwen2.5-7B", 3584, 18944, 28, 4, 128),
    DenseConfig("Qwen2.5-72B", 8192, 29568, 64, 8, 128),
    DenseConfig("Yi-34B", 7168, 20480, 56, 8, 128),
    DenseConfig("Falcon-40B", 8192, 32768, 128, 8, 64),
    DenseConfig("Command-R", 8192, 22528, 64, 64, 128),
)}
"""Dense decoder configs of eight families (Llama, Mistral, Gemma, Phi, Qwen, Yi, Falcon,
Cohere): the ``models`` set of ``bench gemm_sweep`` draws their tensor-parallel shards."""

TP_DEGREES = (2, 4, 8)


def tp_shards(tps: Iterable[int] = TP_DEGREES) -> dict[tuple[int, int], list[str]]:
    """Distinct per-rank ``(N, K)`` of every ``MODEL_CONFIGS`` layer at each TP degree, each
    with the ``"<model> tp<t> <layer>"`` names that have it (first seen first)."""
    out: dict[tuple[int, int], list[str]] = {}
    for cfg in MODEL_CONFIGS.values():
        for tp in tps:
            for layer, nk in cfg.shards(tp).items():
                out.setdefault(nk, []).append(f"{cfg.name} tp{tp} {layer}")
    return out
