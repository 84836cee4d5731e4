"""``ag_gemm``: all-gather of row shards fused with the GEMM that consumes them.

``out = all_gather(a) @ b (+ bias)`` where every rank holds a row shard ``a [M_r, K]``. The fused
path hides the all-gather behind the GEMM (schedule in ``_ag_kernels``); the baseline runs the
collective, then a cuBLAS/torch matmul.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._library import autograd_scope, define_op, direct
from .._validation import check_sizes, check_tensor, memo
from ..collectives.unfused import gather_rows
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key

_ag_launch = lazy_import("._ag_launch", globals())  # Triton and the kernels: on first use

IMPLS = ("auto", "fused", "baseline")
GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.float32)

AUTO_MIN_FLOPS_PER_RANK = 60 * 10**9
"""``impl="auto"`` on a multi-GPU group picks the fused path when the GEMM (2·ΣM_r·N·K) has at
least this many FLOPs, else NCCL's all-gather + cuBLAS: fused vs NCCL + cuBLAS measured 0.97x
at 30 GFLOP, 1.27x at 120 GFLOP and 1.03-1.21x on every model layer at M = 8192 (2 H200s,
LLaMA-3.1-8B [M, 4096] @ [4096, 7168], CUDA-graph replay). Not yet measured at W > 2: more
ranks mean more bytes to hide per FLOP, so the bound can only move down. History:
benchmarks/NOTES.md, ag_gemm."""
AUTO_MIN_FLOPS_VIRTUAL = 15 * 10**9
"""The same bound in a virtual world (W ranks on one GPU): fused vs all_gather + matmul measured
0.83x at 7.5 GFLOP and 1.53x at 30 GFLOP (H200, W=4, LLaMA-3.1-8B layer [M, 4096] @ [4096,
1792], CUDA-graph replay); the bound is their geometric mean. One GPU has no link to hide: the
fused path wins there because its persistent GEMMs share the SMs in fixed slices while W
concurrent cuBLAS calls contend for all of them. History: benchmarks/NOTES.md, ag_gemm."""


def ag_gemm(a: torch.Tensor, b: torch.Tensor, group: Optional[Group] = None, *,
            bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
            return_gathered: bool = False, impl: str = "auto",
            shard_sizes: Optional[Sequence[int]] = None):
    """All-gather the row shards ``a`` of every rank and multiply by ``b``.

    Parameters
    ----------
    a : torch.Tensor
        ``[M_r, K]`` this rank's rows; fp16/bf16 on GPU (fp16/fp32 in the CPU interpreter).
    b : torch.Tensor
        ``[K, N]``, same dtype, any strides (``linear.weight.t()`` is used without a copy; other
        non-contiguous layouts are copied once per call).
    group : Group, optional
        Defaults to the current group.
    bias : torch.Tensor, optional
        ``[N]``, added in fp32 before rounding.
    out : torch.Tensor, optional
        ``[ΣM_r, N]`` destination (any strides).
    return_gathered : bool
        Also return the gathered ``A [ΣM_r, K]``.
    impl : {"auto", "fused", "baseline"}
        ``"auto"``: the fused kernels on the GPU for large GEMMs, else the baseline
        (all_gather + matmul; NCCL's all-gather on multi-GPU groups); always the baseline on
        CPU (see ``use_fused``).
    shard_sizes : sequence of int, optional
        ``[M_0, ..., M_{W-1}]``, the same on every rank; ``None`` means all ranks have
        ``a.shape[0]`` rows (a disagreement raises ``DitronSizeMismatchError``).

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``[ΣM_r, N]`` (rank 0's rows first), plus the gathered ``A`` if ``return_gathered``.

    Constraints
    -----------
    Collective: every rank calls it in the same order relative to the group's other ops, with
    the same ``shard_sizes``, ``K``, ``N``, dtype and ``impl``. Runs on the current stream (the
    fused path forks a side stream and joins it before returning); does not synchronize.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # rank r holds r + 1 rows of value r + 1; K = N = 8
    ...     a = torch.full((group.rank + 1, 8), group.rank + 1.0, dtype=torch.float16, device=group.device)
    ...     b = torch.ones(8, 8, dtype=torch.float16, device=group.device)
    ...     return ditron_ops.ag_gemm(a, b, group, shard_sizes=[1, 2])[:, 0].tolist()
    >>> ditron_ops.launch(body, 2)[0]
    [8.0, 16.0, 16.0]
    """
    group, name = call_group(group)
    key = call_key("ag_gemm", a, b, bias, out, impl, shard_sizes)
    sizes = memo(group, key, lambda: _validate(group, a, b, bias, out, impl, shard_sizes))
    gather = bool(return_gathered)
    if gather:  # the backward adds the gathered rows' grad at this rank's offset: a compiled
        name = group.group_name  # graph (and its backward) per rank, not one CONTEXT graph
    if out is not None:
        if direct(a, b, bias, out):
            gathered = _ag_gemm_out_impl(a, b, bias, out, name, sizes, gather, impl)
        else:
            gathered = torch.ops.ditron.ag_gemm_out(a, b, bias, out, name, sizes,
                                                    gather, impl)
        result = out
    elif direct(a, b, bias):  # the validation key holds a, b and bias's tensor keys: reused
        result, gathered = _run(a, b, bias, None, name, sizes, gather, impl,
                                empty=False, tensor_keys=None if key is None else key[1:4])
    else:
        with autograd_scope(a, b, bias):
            result, gathered = torch.ops.ditron.ag_gemm(a, b, bias, name, sizes,
                                                        gather, impl)
    return (result, gathered) if return_gathered else result


def _validate(group: Group, a, b, bias, out, impl: str, shard_sizes) -> list[int]:
    """The call's checks (typed errors naming the argument); the shard sizes."""
    dtypes = GPU_DTYPES if group.device.type == "cuda" else CPU_DTYPES
    check_tensor("ag_gemm", "a", a, group, dtypes, min_dim=2)
    check_tensor("ag_gemm", "b", b, group, (a.dtype,), min_dim=2)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"ditron.ag_gemm: a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"ditron.ag_gemm: a is [M_r, K] = {tuple(a.shape)} but b is [K, N] = "
                         f"{tuple(b.shape)} (K must match)")
    sizes = [a.shape[0]] * group.world_size if shard_sizes is None else check_sizes(
        "ag_gemm", "shard_sizes", shard_sizes, group)
    # (only given sizes read the rank: a compiled graph then serves every rank)
    if shard_sizes is not None and sizes[group.rank] != a.shape[0]:
        raise ValueError(f"ditron.ag_gemm: shard_sizes[{group.rank}] = {sizes[group.rank]} but a has "
                         f"{a.shape[0]} rows on rank {group.rank}")
    if bias is not None:
        check_tensor("ag_gemm", "bias", bias, group, (a.dtype,), min_dim=1)
        if tuple(bias.shape) != (b.shape[1],):
            raise ValueError(f"ditron.ag_gemm: bias must be [N] = [{b.shape[1]}], got {tuple(bias.shape)}")
    if impl not in IMPLS:
        raise ValueError(f"ditron.ag_gemm: impl must be one of {IMPLS}, got {impl!r}")
    if out is not None:
        check_tensor("ag_gemm", "out", out, group, (a.dtype,), min_dim=2)
        if tuple(out.shape) != (sum(sizes), b.shape[1]):
            raise ValueError(f"ditron.ag_gemm: out must be [ΣM_r, N] = [{sum(sizes)}, {b.shape[1]}], "
                             f"got {tuple(out.shape)}")
    agree(group, "ag_gemm", (("dtype", a.dtype), ("K", a.shape[1]), ("N", b.shape[1]),
                             ("shard_sizes", tuple(sizes)), ("impl", impl)))
    return sizes


def use_fused(group: Group, impl: str, m: int, n: int, k: int) -> bool:
    """The ``impl`` rule. Fused needs symmetric memory; ``auto`` picks it on the GPU for GEMMs of
    at least ``AUTO_MIN_FLOPS_VIRTUAL`` (virtual worlds) or ``AUTO_MIN_FLOPS_PER_RANK``
    (multi-GPU groups) FLOPs, both measured, and the baseline on CPU (the interpreter)."""
    if impl == "baseline" or not group.has_symmetric_memory:
        return False
    if impl == "fused":
        return True
    bound = AUTO_MIN_FLOPS_VIRTUAL if group.backend == "virtual" else AUTO_MIN_FLOPS_PER_RANK
    return group.device.type == "cuda" and 2 * m * n * k >= bound


def _run(a, b, bias, out, group_name, shard_sizes, return_gathered, impl, empty=True, tensor_keys=None):
    """``(out, gathered)``: the product (into ``out``, or a new tensor when None) and the
    gathered A (``[ΣM_r, K]``) when ``return_gathered``, else an empty tensor (the op's second
    output), or None without ``empty`` (eager calls, which drop it). ``tensor_keys``: ``a``,
    ``b`` and ``bias``'s ``tensor_key``s when the caller has them (the eager call's validation key)."""
    group = resolve_group(group_name)
    m, k, n = sum(shard_sizes), a.shape[1], b.shape[1]
    gathered = a.new_empty((m, k)) if return_gathered else None
    if use_fused(group, impl, m, n, k) and m and n:
        own_out = out is None
        out = a.new_empty((m, n)) if own_out else out
        if k == 0:
            out.zero_() if bias is None else out.copy_(bias.expand_as(out))
        else:
            _ag_launch.fused(group, a, b, bias, out, shard_sizes, gathered, own_out=own_out,
                             tensor_keys=tensor_keys)
    else:
        full = gather_rows(a, group, shard_sizes, out=gathered)
        if out is None:  # the product allocates its own output (one op less per call)
            out = full @ b if bias is None else torch.addmm(bias, full, b)
        else:
            torch.matmul(full, b, out=out) if bias is None else torch.addmm(bias, full, b, out=out)
    return out, (gathered if gathered is not None or not empty else a.new_empty((0,)))


def _ag_gemm_impl(a, b, bias, group_name, shard_sizes, return_gathered, impl, empty=True):
    return _run(a, b, bias, None, group_name, shard_sizes, return_gathered, impl, empty)


def _ag_gemm_fake(a, b, bias, group_name, shard_sizes, return_gathered, impl):
    m = sum(shard_sizes)
    return a.new_empty((m, b.shape[1])), a.new_empty((m, a.shape[1]) if return_gathered else (0,))


def _ag_gemm_out_impl(a, b, bias, out, group_name, shard_sizes, return_gathered, impl):
    return _run(a, b, bias, out, group_name, shard_sizes, return_gathered, impl)[1]


def _ag_gemm_out_fake(a, b, bias, out, group_name, shard_sizes, return_gathered, impl):
    return a.new_empty((sum(shard_sizes), a.shape[1]) if return_gathered else (0,))


define_op("ag_gemm(Tensor a, Tensor b, Tensor? bias, str group_name, SymInt[] shard_sizes, "
          "bool return_gathered, str impl) -> (Tensor, Tensor)", _ag_gemm_impl, _ag_gemm_fake)
define_op("ag_gemm_out(Tensor a, Tensor b, Tensor? bias, Tensor(a!) out, str group_name, "
          "SymInt[] shard_sizes, bool return_gathered, str impl) -> Tensor",
          _ag_gemm_out_impl, _ag_gemm_out_fake)
