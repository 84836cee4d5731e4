"""``gemm_rs`` and ``gemm_ar``: a row-parallel GEMM whose partial products are summed over ranks.

``gemm_rs``: this rank's rows of ``Σ_r a_r @ b_r``; ``gemm_ar``: all of it, on every rank. The
fused path stores fp32 partial tiles into their owners' buffers while the GEMM runs and sums
them in rank order (schedule in ``_rs_kernels``); the baseline is ``matmul`` then the collective.

What each mode promises
-----------------------
``deterministic=True``: the fused kernels with batch-invariant tiles (the rule's choice for M and
N among configurations whose rows do not depend on the M-side tiling: BLOCK_K fixed at 64, no
split-K) and fp32 partials summed in rank order 0..W-1 with one rounding. Bitwise identical run
to run, independent of arrival order, and batch invariant (row i of the result depends only on
row i of ``a``: ``op(a[:k]) == op(a)[:k]``). On groups without symmetric memory the same GEMM
and a rank-ordered reference sum. ``deterministic=False`` (default): ``impl`` decides; the
baseline uses cuBLAS (whose kernel choice depends on M, so not batch invariant) and rounds the
partial product before the collective sum (NCCL's on multi-GPU groups, in NCCL's order; ditron's
rank-ordered one elsewhere); the fused path sums fp32 partials in rank order as deterministic
mode does (not in arrival order), with the rule's tiles for the shape, or the WS core's where
``_rs_launch.PRODUCER_CORE`` is ``"ws"`` (with ``_rs_launch.LOWP_PARTIALS``, experimental, its
partial tiles are rounded to the input dtype before the fp32 sum). In every mode results differ across world
sizes (different summation).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._library import autograd_scope, define_op, direct
from .._validation import check_sizes, check_tensor, memo
from ..collectives.unfused import gather_rows, reduce_rows, sum_all
from ..deterministic import resolve_deterministic
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, name_for_rows, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key
from ..runtime.split import split_sizes

_core = lazy_import("._core", globals())  # Triton and the kernels: on first use
_rs_launch = lazy_import("._rs_launch", globals())

IMPLS = ("auto", "fused", "baseline")
ALGORITHMS = ("auto", "one_shot", "two_shot")
GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.float32)
ONE_SHOT_MAX_BYTES = 2 << 20
"""``gemm_ar(algorithm="auto")`` is one-shot while the fp32 product ``M·N·4`` bytes is at most
this (every rank receives W partials of it), two-shot (gemm_rs + all_gather) above: one-shot vs
two-shot measured 1.35x at 2 MiB and 0.87x at 4 MiB (H200, virtual world W=4, [M, 1376] @
[1376, 4096], CUDA-graph replay). On one GPU both move HBM bytes; multi-GPU runs must measure the
crossover on NVLink. History: benchmarks/NOTES.md, gemm_rs / gemm_ar."""


def _check(op: str, a, b, group: Group, impl: str) -> None:
    dtypes = GPU_DTYPES if group.device.type == "cuda" else CPU_DTYPES
    check_tensor(op, "a", a, group, dtypes, min_dim=2)
    check_tensor(op, "b", b, group, (a.dtype,), min_dim=2)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"ditron.{op}: a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"ditron.{op}: a is [M, K_r] = {tuple(a.shape)} but b is [K_r, N] = "
                         f"{tuple(b.shape)} (K_r must match)")
    if impl not in IMPLS:
        raise ValueError(f"ditron.{op}: impl must be one of {IMPLS}, got {impl!r}")


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group: Optional[Group] = None, *,
            deterministic: Optional[bool] = None, impl: str = "auto",
            shard_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """GEMM of row-parallel shards, reduce-scattered: this rank's rows of ``Σ_r a_r @ b_r``.

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K_r]`` (this rank's slice of the reduction dimension); fp16/bf16 on GPU,
        fp16/fp32 in the CPU interpreter.
    b : torch.Tensor
        ``[K_r, N]``, same dtype, any strides (``w.t()`` of a ``[N, K_r]`` weight is not copied).
    group : Group, optional
    deterministic : bool, optional
        Defaults to the ``ditron_ops.deterministic()`` mode; see the module docstring.
    impl : {"auto", "fused", "baseline"}
        ``auto``: the baseline in virtual worlds and on CPU (where the fused path cannot hide
        anything); on multi-GPU groups fused for GEMMs of at least ``AUTO_MIN_FLOPS_RS``
        FLOPs, else cuBLAS + NCCL. Deterministic mode always runs our GEMM.
    shard_sizes : sequence of int, optional
        Rows of the result each rank keeps (sum M); default ``split_sizes(M, W)``: the first
        ``M % W`` ranks get one extra row.

    Returns
    -------
    torch.Tensor
        ``[shard_sizes[rank], N]``.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same M, N, dtype, flags.
    Runs on the current stream and does not synchronize.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # a [4, K_r = 8] of ones, b [8, 8] of rank + 1: the sum is 8 * 1 + 8 * 2
    ...     a = torch.ones(4, 8, dtype=torch.float16, device=group.device)
    ...     b = torch.full((8, 8), group.rank + 1.0, dtype=torch.float16, device=group.device)
    ...     return ditron_ops.gemm_rs(a, b, group)[:, 0].tolist()  # this rank's 2 rows of the sum
    >>> ditron_ops.launch(body, 2)[1]
    [24.0, 24.0]
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate() -> list[int]:
        _check("gemm_rs", a, b, group, impl)
        rows = split_sizes(a.shape[0], group.world_size) if shard_sizes is None else check_sizes(
            "gemm_rs", "shard_sizes", shard_sizes, group)
        if sum(rows) != a.shape[0]:
            raise ValueError(f"ditron.gemm_rs: shard_sizes {rows} must sum to M = {a.shape[0]}")
        agree(group, "gemm_rs", (("dtype", a.dtype), ("M", a.shape[0]), ("N", b.shape[1]),
                                 ("shard_sizes", tuple(rows)), ("impl", impl),
                                 ("deterministic", flag)))
        return rows

    key = call_key("gemm_rs", a, b, impl, shard_sizes, flag)
    rows = memo(group, key, validate)
    name = name_for_rows(name, group, rows)
    if direct(a, b):  # the plan key reuses the memo key's tensor keys (a, b)
        return _gemm_rs_impl(a, b, name, rows, flag, impl,
                             tensor_keys=None if key is None else key[1:3])
    with autograd_scope(a, b):
        return torch.ops.ditron.gemm_rs(a, b, name, rows, flag, impl)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, group: Optional[Group] = None, *,
            deterministic: Optional[bool] = None, impl: str = "auto",
            algorithm: str = "auto") -> torch.Tensor:
    """GEMM of row-parallel shards, all-reduced: ``Σ_r a_r @ b_r`` on every rank.

    Parameters are those of ``gemm_rs``, except that ``impl="auto"`` stays unfused on multi-GPU
    groups (cuBLAS + NCCL measured faster, ``AUTO_MIN_FLOPS_RS``); ``algorithm`` picks the
    fused reduction: ``one_shot`` (every rank receives every partial: latency-bound small M),
    ``two_shot`` (gemm_rs, then all_gather of the reduced rows), ``auto`` (one-shot up to
    ``ONE_SHOT_MAX_BYTES``).

    Returns
    -------
    torch.Tensor
        ``[M, N]``, identical on every rank.

    Constraints
    -----------
    As ``gemm_rs``.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):
    ...     a = torch.ones(4, 8, dtype=torch.float16, device=group.device)
    ...     b = torch.full((8, 8), group.rank + 1.0, dtype=torch.float16, device=group.device)
    ...     out = ditron_ops.gemm_ar(a, b, group, deterministic=True)  # every row of the sum
    ...     return tuple(out.shape), out.unique().tolist()
    >>> ditron_ops.launch(body, 2)
    [((4, 8), [24.0]), ((4, 8), [24.0])]
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate() -> bool:
        _check("gemm_ar", a, b, group, impl)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"ditron.gemm_ar: algorithm must be one of {ALGORITHMS}, got "
                             f"{algorithm!r}")
        agree(group, "gemm_ar", (("dtype", a.dtype), ("M", a.shape[0]), ("N", b.shape[1]),
                                 ("impl", impl), ("algorithm", algorithm),
                                 ("deterministic", flag)))
        return True

    memo(group, call_key("gemm_ar", a, b, impl, algorithm, flag), validate)
    if direct(a, b):
        return _gemm_ar_impl(a, b, name, flag, impl, algorithm)
    return torch.ops.ditron.gemm_ar(a, b, name, flag, impl, algorithm)


AUTO_MIN_FLOPS_RS = 60 * 10**9
"""``gemm_rs(impl="auto")`` on a multi-GPU group is fused when the local GEMM (2·M·N·K_r) has at
least this many FLOPs, else cuBLAS + NCCL's reduce-scatter: fused vs cuBLAS + NCCL measured
0.78x at 30 GFLOP, 1.05x at 120 GFLOP and 0.98-1.04x on the model layers at M = 8192 (2 H200s,
LLaMA-3.1-8B [M, 7168] @ [7168, 4096], CUDA-graph replay). ``gemm_ar(impl="auto")`` stays
unfused on multi-GPU groups: the fused two-shot measured at most 0.90x at M <= 2048 and
0.97-1.01x at M = 8192 against cuBLAS + NCCL's all-reduce. Both measured at W = 2 only.
History: benchmarks/NOTES.md, gemm_rs / gemm_ar."""


def _fused_wanted(group: Group, impl: str, deterministic: bool, op: str, flops: int) -> bool:
    """``impl`` and the mode decide: deterministic mode always runs our kernels (fused when the
    group has symmetric memory); ``auto`` is fused on multi-GPU groups only where it measured
    faster (``AUTO_MIN_FLOPS_RS``), never in virtual worlds or on CPU."""
    if impl == "baseline" and not deterministic:
        return False
    if not group.has_symmetric_memory:
        return False
    if impl == "fused" or deterministic:
        return True
    multi_gpu = group.device.type == "cuda" and group.backend != "virtual"
    return multi_gpu and op == "gemm_rs" and flops >= AUTO_MIN_FLOPS_RS


def _partials(a: torch.Tensor, deterministic: bool) -> torch.dtype:
    """Dtype of the fused path's partial tiles: fp32, or the input dtype in the default mode
    with ``_rs_launch.LOWP_PARTIALS`` (experimental)."""
    return a.dtype if _rs_launch.LOWP_PARTIALS and not deterministic else torch.float32


def _partial(a: torch.Tensor, b: torch.Tensor, deterministic: bool,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's product for the unfused paths: fp32 from our batch-invariant GEMM when
    deterministic (one rounding after the sum), else cuBLAS in the input dtype (into ``out``
    when given, of the product's shape)."""
    if a.shape[1] == 0:
        return a.new_zeros(a.shape[0], b.shape[1]) if out is None else out.zero_()
    if deterministic:
        return _core.matmul(a, b, out=torch.empty(a.shape[0], b.shape[1], dtype=torch.float32,
                                                  device=a.device), deterministic=True)
    return a @ b if out is None else torch.matmul(a, b, out=out)


def _nonempty_k(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b``, or 8 zero columns and rows (16-byte rows for TMA) when this rank's slice of K
    is empty: the path is chosen from arguments every rank shares, so such a rank runs the
    fused kernel too (its product, 0) instead of the unfused collectives its peers never call."""
    if a.shape[1]:
        return a, b
    return a.new_zeros(a.shape[0], 8), b.new_zeros(8, b.shape[1])


def _gemm_rs_impl(a, b, group_name, shard_sizes, deterministic, impl, tensor_keys=None):
    group = resolve_group(group_name)
    rows = list(shard_sizes)
    out = a.new_empty((rows[group.rank], b.shape[1]))
    if a.shape[0] == 0 or b.shape[1] == 0:
        return out
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if _fused_wanted(group, impl, deterministic, "gemm_rs", flops):
        if a.shape[1] == 0:
            a, b = _nonempty_k(a, b)
            tensor_keys = None
        return _rs_launch.fused(group, a, b, out, rows, broadcast=False, op="gemm_rs",
                                partials=_partials(a, deterministic), deterministic=deterministic,
                                tensor_keys=tensor_keys)
    return reduce_rows(_partial(a, b, deterministic), group, rows, out, deterministic)


def _gemm_rs_fake(a, b, group_name, shard_sizes, deterministic, impl):
    return a.new_empty((shard_sizes[resolve_group(group_name).rank], b.shape[1]))


def _gemm_ar_impl(a, b, group_name, deterministic, impl, algorithm):
    group = resolve_group(group_name)
    m, n = a.shape[0], b.shape[1]
    if m == 0 or n == 0:
        return a.new_empty((m, n))
    flops = 2 * m * a.shape[1] * n
    if not deterministic and not _fused_wanted(group, impl, deterministic, "gemm_ar", flops):
        part = _partial(a, b, False)  # in the input dtype: summed in place (one op less a call)
        return sum_all(part, group, part, False)
    out = a.new_empty((m, n))
    if _fused_wanted(group, impl, deterministic, "gemm_ar", flops):
        a, b = _nonempty_k(a, b)
        if algorithm == "auto":
            algorithm = "one_shot" if m * n * 4 <= ONE_SHOT_MAX_BYTES else "two_shot"
        if algorithm == "one_shot":
            return _rs_launch.fused(group, a, b, out, [m] * group.world_size, broadcast=True,
                                 op="gemm_ar", partials=_partials(a, deterministic),
                                 deterministic=deterministic)
        rows = split_sizes(m, group.world_size)
        mine = _rs_launch.fused(group, a, b, a.new_empty((rows[group.rank], n)), rows,
                             broadcast=False, op="gemm_ar", partials=_partials(a, deterministic),
                             deterministic=deterministic)
        return gather_rows(mine, group, rows, out=out)  # a copy: exact
    return sum_all(_partial(a, b, deterministic, out), group, out, deterministic)


def _gemm_ar_fake(a, b, group_name, deterministic, impl, algorithm):
    return a.new_empty((a.shape[0], b.shape[1]))


define_op("gemm_rs(Tensor a, Tensor b, str group_name, SymInt[] shard_sizes, bool deterministic, "
          "str impl) -> Tensor", _gemm_rs_impl, _gemm_rs_fake)
define_op("gemm_ar(Tensor a, Tensor b, str group_name, bool deterministic, str impl, "
          "str algorithm) -> Tensor", _gemm_ar_impl, _gemm_ar_fake)
