"""``all_reduce_rmsnorm``: all-reduce of a row-parallel layer's partial sums, residual add,
RMSNorm and an optional e4m3 quantization, in one kernel launch per rank.

The serving pattern after an attention or MLP output projection (TP)::

    h = all_reduce(x); residual = h + residual; normed = rms_norm(residual, weight)  [; fp8]

One-shot (small T): every rank stages its x in symmetric memory, then reduces *every* row by
reading all ranks' copies (peer pointers) in rank order; no other exchange::

    rank r: stage x | signal all | wait all | rows 0..T-1: sum_s x_s, add, norm, quant -> out

Two-shot (large T): each rank reduces and normalizes only its own rows (``split_sizes``), then
every rank copies every owner's finished rows (normed, residual_out, codes, scales)::

    rank r: stage x | signal | wait | my rows: sum, add, norm, quant -> staging | signal |
            wait | copy all owners' staged rows -> out

Both in one kernel. Rounding (the composition all_reduce -> add -> ``F.rms_norm`` -> fp8, with
torch's roundings): ``h = round(sum_s x_s)`` in fp32 in rank order 0..W-1, rounded once to x's
dtype (``all_reduce``'s contract); ``residual_out = round(h + residual)`` (fp32 add, one
rounding: torch's ``h + residual``); ``normed = round(r * rstd * weight)`` with ``r`` =
residual_out in fp32, ``rstd = 1 / sqrt(sum(r^2) / H + eps)`` (fp32, correctly rounded division
and root, one rounding at the end as ``F.rms_norm`` does on torch 2.13); ``scale = amax *
fp32(1/448)`` (torch's CUDA ``amax / 448``) over the rounded ``normed`` (per row or per 128
columns), ``codes = e4m3(clamp(normed / scale, ±448))`` (rounded to nearest even; a zero scale
divides by 1). The sum over H runs in a fixed order that depends on H alone, so ``normed`` may
differ from torch's by an ulp.

Groups without symmetric memory (``TorchGroup``) run ``reference.norm`` instead: in
deterministic mode the rank-ordered sum of the gathered x and a sum over H in a fixed pairwise
order of elementwise adds (row invariant on any device; its bits differ from the kernel's by
an ulp); otherwise the group's own all-reduce of x in fp32 (one rounding, the backend's order)
and torch's sum over H, which promise nothing about batch invariance.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._library import define_op, direct
from .._validation import check_tensor, memo
from ..deterministic import resolve_deterministic
from ..reference import norm as _reference
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key

# Triton, the kernel and its launch code: imported on first use (``runtime.lazy``)
_norm_launch = lazy_import("._norm_launch", globals())

GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_DTYPES = (torch.float16, torch.float32)  # the interpreter rounds fp32 -> bf16 differently
ALGORITHMS = ("auto", "one_shot", "two_shot")
QUANTS = (None, "fp8_e4m3", "fp8_e4m3_128")
ONE_SHOT_MAX_BYTES = 256 * 1024
"""``algorithm="auto"`` is one-shot while this rank's ``x`` (T·H·elem bytes) is at most this,
two-shot above: the same default as ``all_reduce`` (every rank reads W copies of x in one-shot,
one W-th of them plus the finished rows in two-shot). A default, not a measurement: the bench
(``bench/serving_norm.py``) measures both forms per T to set it."""
MAX_ELEMS = 2**31 - 1 - 32 * 2048
"""Largest T*H: the kernel's element offsets are 32-bit, and ``language.copy_tiles`` steps its
offset by programs * COPY_BLOCK (at most 32 * 2048) past the count before it stops."""


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """``auto`` rule: one-shot up to ``ONE_SHOT_MAX_BYTES`` (latency-bound), two-shot above."""
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES or world_size == 1 else "two_shot"


def _check(x, residual, weight, eps, quant, algorithm, group: Group) -> None:
    op = "all_reduce_rmsnorm"
    dtypes = GPU_DTYPES if group.device.type == "cuda" else CPU_DTYPES
    check_tensor(op, "x", x, group, dtypes, min_dim=2)
    check_tensor(op, "residual", residual, group, (x.dtype,))
    check_tensor(op, "weight", weight, group, tuple(dict.fromkeys((x.dtype, torch.float32))))
    if x.dim() != 2:
        raise ValueError(f"ditron.{op}: x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"ditron.{op}: residual must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(residual.shape)}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"ditron.{op}: weight must be [H] = ({x.shape[1]},), got "
                         f"{tuple(weight.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"ditron.{op}: H must be at least 1, got shape {tuple(x.shape)}")
    if x.numel() > MAX_ELEMS:
        raise ValueError(f"ditron.{op}: x has {x.numel()} elements; at most {MAX_ELEMS} (T*H "
                         "must fit the kernel's 32-bit offsets)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"ditron.{op}: eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"ditron.{op}: eps must be finite and >= 0, got {eps!r}")
    if quant not in QUANTS:
        raise ValueError(f"ditron.{op}: quant must be one of {QUANTS}, got {quant!r}")
    if quant == "fp8_e4m3_128" and x.shape[1] % 128:
        raise ValueError(f"ditron.{op}: quant='fp8_e4m3_128' needs H divisible by 128, got "
                         f"H = {x.shape[1]}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"ditron.{op}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *, group: Optional[Group] = None,
                       deterministic: Optional[bool] = None, quant: Optional[str] = None,
                       algorithm: str = "auto") -> tuple:
    """All-reduce ``x`` over ranks, add ``residual``, RMSNorm with ``weight`` (and quantize).

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H]``: this rank's partial sums (e.g. a row-parallel projection's output);
        fp16/bf16/fp32 on GPU, fp16/fp32 in the CPU interpreter. T may be 0.
    residual : torch.Tensor
        ``[T, H]``, x's dtype: the residual stream, the same on every rank (replicated, as in
        tensor parallelism: two-shot takes each row's from the rank that owns the row).
    weight : torch.Tensor
        ``[H]``, x's dtype or fp32.
    eps : float
        Added to the mean square (fp32), finite and >= 0.
    group : Group, optional
        Default the context group (``launch``) or the default group.
    deterministic : bool, optional
        Default the ``ditron_ops.deterministic()`` mode. On groups with symmetric memory both
        modes run the same kernel, which already keeps every promise of the mode: the sum over
        ranks is in rank order 0..W-1 in fp32 with one rounding, the sum over H is in a fixed
        order that depends on H alone, so a row's bits depend on neither T, the other rows, the
        algorithm (given a replicated ``residual``), nor run to run (batch invariant). On a
        ``TorchGroup`` only ``deterministic=True`` keeps them (rank-ordered gather and a fixed
        sum order, row invariant); the default there uses the backend's all-reduce (fp32, its
        own order) and torch's sum over H. Results differ across world sizes.
    quant : {None, "fp8_e4m3", "fp8_e4m3_128"}
        Also return e4m3 codes of ``normed`` with fp32 scales ``amax * fp32(1/448)`` per token
        (``"fp8_e4m3"``) or per 128 channels (``"fp8_e4m3_128"``, H divisible by 128).
    algorithm : {"auto", "one_shot", "two_shot"}
        ``auto``: one-shot up to ``ONE_SHOT_MAX_BYTES`` of x, two-shot above
        (``choose_algorithm``); every rank picks the same. Both give the same bits when
        ``residual`` is the same on every rank, as required (two-shot adds each row's owner's
        residual, one-shot this rank's).

    Returns
    -------
    normed : torch.Tensor
        ``[T, H]``, x's dtype.
    residual_out : torch.Tensor
        ``[T, H]``, x's dtype: ``round(all_reduce(x) + residual)``, the next layer's residual.
    codes : torch.Tensor
        With ``quant``: ``[T, H]`` ``torch.float8_e4m3fn``.
    scales : torch.Tensor
        With ``quant``: ``[T, 1]`` (per token) or ``[T, H / 128]`` fp32; ``normed ≈ codes *
        scales`` (broadcast per group).

    Raises
    ------
    TypeError, ValueError
        Bad dtype, device, shape, eps, quant or algorithm, before anything is launched.
    DitronMismatchError
        The ranks' shapes, dtypes, eps, quant, algorithm or mode differ.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same T, H, dtypes, eps, quant,
    algorithm and mode. Runs on the current stream, returns without synchronizing;
    CUDA-graph capturable after one eager call with the same shapes. Back-to-back calls of any
    T and algorithm need no synchronization between them (double buffered by epoch parity).
    The rounding of every output is the module docstring's.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):
    ...     x = torch.full((2, 4), 1.0 + group.rank, device=group.device)  # sum over 2 ranks: 3
    ...     res = torch.ones(2, 4, device=group.device)
    ...     w = torch.ones(4, device=group.device)
    ...     normed, res_out = ditron_ops.all_reduce_rmsnorm(x, res, w, group=group)
    ...     return res_out[0].tolist(), normed[0].tolist()
    >>> ditron_ops.launch(body, 2)[0]
    ([4.0, 4.0, 4.0, 4.0], [1.0, 1.0, 1.0, 1.0])
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)

    def validate() -> str:  # the algorithm to run
        _check(x, residual, weight, eps, quant, algorithm, group)
        chosen = (choose_algorithm(x.numel() * x.element_size(), group.world_size)
                  if algorithm == "auto" else algorithm)
        agree(group, "all_reduce_rmsnorm",
              (("dtype", x.dtype), ("x.shape", tuple(x.shape)), ("weight.dtype", weight.dtype),
               ("eps", float(eps)), ("quant", quant), ("algorithm", chosen),
               ("deterministic", flag)))
        return chosen

    chosen = memo(group, call_key("all_reduce_rmsnorm", x, residual, weight, eps, quant,
                                  algorithm, flag), validate)
    if direct(x, residual, weight):  # (no dispatcher: codes and scales may be shared stand-ins)
        outs = _run(x, residual, weight, float(eps), name, chosen, quant or "", flag, True)
    else:
        outs = torch.ops.ditron.all_reduce_rmsnorm(x, residual, weight, float(eps), name, chosen,
                                                   quant or "", flag)
    return tuple(outs) if quant else (outs[0], outs[1])


_NO_QUANT: dict = {}
"""device -> the ``[0, 0]`` codes and scales of eager calls without quant: made once, never
written, never returned to the caller (the public function drops them)."""


def _outputs(x: torch.Tensor, quant: str, shared: bool = False) -> tuple:
    """``(normed, residual_out, codes, scales)``, fresh; without quant codes and scales are
    ``[0, 0]``, the shared stand-ins of ``x``'s device with ``shared``."""
    normed = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not quant:
        if not shared:
            return (normed, res_out, x.new_empty((0, 0), dtype=torch.float8_e4m3fn),
                    x.new_empty((0, 0), dtype=torch.float32))
        empty = _NO_QUANT.get(x.device)
        if empty is None:
            empty = _NO_QUANT.setdefault(x.device, (
                x.new_empty((0, 0), dtype=torch.float8_e4m3fn),
                x.new_empty((0, 0), dtype=torch.float32)))
        return (normed, res_out) + empty
    rows, cols = x.shape
    groups = cols // 128 if quant == "fp8_e4m3_128" else 1
    return (normed, res_out, x.new_empty((rows, cols), dtype=torch.float8_e4m3fn),
            x.new_empty((rows, groups), dtype=torch.float32))


def _run(x, residual, weight, eps, group_name, algorithm, quant, deterministic, shared):
    group = resolve_group(group_name)
    outs = _outputs(x, quant, shared)
    if x.shape[0] == 0:  # every rank has T = 0 (agreed): nothing to exchange
        return outs
    if not group.has_symmetric_memory:  # torch.distributed: the reference (module docstring)
        got = _reference.all_reduce_rmsnorm(x, residual, weight, eps, group, quant or None,
                                            deterministic=deterministic)
        for out, value in zip(outs, got):
            out.copy_(value)
        return outs
    return _norm_launch.run(group, x, residual, weight, eps, algorithm == "two_shot",
                            quant or None, outs)


def _all_reduce_rmsnorm_impl(x, residual, weight, eps, group_name, algorithm, quant,
                             deterministic):
    return _run(x, residual, weight, eps, group_name, algorithm, quant, deterministic, False)


def _all_reduce_rmsnorm_fake(x, residual, weight, eps, group_name, algorithm, quant,
                             deterministic):
    return _outputs(x, quant)


define_op("all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, "
          "str group_name, str algorithm, str quant, bool deterministic) -> "
          "(Tensor, Tensor, Tensor, Tensor)",
          _all_reduce_rmsnorm_impl, _all_reduce_rmsnorm_fake)
