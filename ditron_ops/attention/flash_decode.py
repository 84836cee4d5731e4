"""``flash_decode``: decode attention of every rank's queries over the KV cache sharded (along
the sequence) across the ranks: local split-KV partials, exchanged through the pointer table
with signals, merged by log-sum-exp (schedule in ``_flash_decode_kernels``).
"""
from __future__ import annotations

import itertools
import math
from typing import Optional

import torch

from .._library import define_op, direct
from .._validation import check_tensor, memo
from ..deterministic import resolve_deterministic
from ..errors import DitronInputError
from ..runtime import compiler
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, op_id, resolve_group, sm_count
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key, tensor_key
from ..runtime.tracing import tracing
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile
from . import paged_kv

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
barrier = lazy_import("..language.barrier", globals())
launcher = lazy_import("..runtime.launcher", globals())
_kernels = lazy_import("._flash_decode_kernels", globals())

PURPOSE = "flash_decode"
GPU_DTYPES = (torch.float16, torch.bfloat16)
CPU_DTYPES = (torch.float16, torch.float32)
HEAD_DIMS = (64, 128)
DETERMINISTIC_CHUNK = 512
"""KV chunk of one split-KV program in deterministic mode (fixed: never derived from the batch
or the number of SMs)."""


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: Optional[torch.Tensor],
                 kv_lens: torch.Tensor, group: Optional[Group] = None, *,
                 softmax_scale: Optional[float] = None, deterministic: Optional[bool] = None,
                 block_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` over the concatenation of every rank's KV shard (one decode step).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]``, the same on every rank; fp16/bf16 on GPU (fp16/fp32 in the interpreter);
        ``D`` in {64, 128}.
    k_cache, v_cache : torch.Tensor
        ``[B, S_max, Hkv, D]``: this rank's shard of the sequence; ``Hq`` a multiple of ``Hkv``
        (GQA); last dimension contiguous. Paged (``block_table`` given): ``[num_blocks,
        page_size, Hkv, D]`` each, or one ``[num_blocks, 2, page_size, Hkv, D]`` tensor as
        ``k_cache`` with ``v_cache=None``; ``page_size`` a power of two in 1..256.
    kv_lens : torch.Tensor
        ``[B]`` int32/int64 on the device: valid keys of each sequence on this rank (0 allowed;
        paged: at most ``max_blocks x page_size``, 0 when the cache has no pages).
    group : Group, optional
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    deterministic : bool, optional
        Defaults to the ``ditron_ops.deterministic()`` mode. True: one partial per fixed chunk
        of ``DETERMINISTIC_CHUNK`` keys and a fixed merge (chunks by position, then ranks
        0..W-1) in fp32: bitwise identical run to run and batch invariant. False: one partial
        per split-KV program, the key ranges sized from the batch and the GPU (faster; not
        batch invariant).
    block_table : torch.Tensor, optional
        ``[B, max_blocks]`` int32 on the device, rows contiguous: key ``n`` of sequence ``b`` is
        slot ``n % page_size`` of page ``block_table[b, n // page_size]`` (this rank's pages;
        entries past a sequence's pages are never read). The kernel reads the table on the
        device, so a captured CUDA graph follows its contents. Key ranges depend on key
        positions only (the capacity ``max_blocks x page_size`` plays ``S_max``): deterministic
        mode gives the bits of the contiguous call over the same keys. A used entry outside
        ``[0, num_blocks)`` (-1 included) or a length past the table is read clamped and
        raised as ``DitronInputError`` at the next host check (host tensors: before the
        launch). FlashInfer's CSR form converts with ``csr_to_block_table``.

    Returns
    -------
    torch.Tensor
        ``[B, Hq, D]`` in ``q``'s dtype, identical on every rank.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same ``B``, ``Hq``, ``Hkv``,
    ``D``, dtype, mode and page size (``S_max``, ``kv_lens``, the number of pages and the
    table's width may differ; all ranks paged or none). Runs on the current stream,
    does not synchronize, and is CUDA-graph capturable after one eager call with the same shapes.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # q and keys zero: uniform weights, the mean of every rank's values
    ...     q = torch.zeros(1, 2, 64, dtype=torch.float16, device=group.device)        # [B, Hq, D]
    ...     k = torch.zeros(1, 4, 1, 64, dtype=torch.float16, device=group.device)     # [B, S_max, Hkv, D]
    ...     v = torch.full((1, 4, 1, 64), group.rank + 1.0, dtype=torch.float16, device=group.device)
    ...     lens = torch.tensor([2], dtype=torch.int32, device=group.device)          # 2 of 4 slots hold keys
    ...     return ditron_ops.flash_decode(q, k, v, lens, group)[0, :, 0].tolist()
    >>> ditron_ops.launch(body, 2)[0]
    [1.5, 1.5]
    """
    group, name = call_group(group)
    flag = resolve_deterministic(deterministic)
    if block_table is not None:
        return _paged(group, name, q, k_cache, v_cache, kv_lens, block_table, softmax_scale, flag)
    key = call_key("flash_decode", q, k_cache, v_cache, kv_lens, flag)
    d = memo(group, key, lambda: _validate(group, q, k_cache, v_cache, kv_lens, flag))
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if kv_lens.device.type == "cpu" and not tracing():
        _check_lens(group, kv_lens, k_cache.shape[1])  # on the host: free (device: the kernel's)
    if direct(q, k_cache, v_cache, kv_lens):  # the plan key reuses the memo key's tensor keys
        return _impl(q, k_cache, v_cache, kv_lens, name, scale, flag,
                     tensor_keys=None if key is None else key[1:5])
    return torch.ops.ditron.flash_decode(q, k_cache, v_cache, kv_lens, name, scale, flag)


def _paged(group: Group, name: str, q, k_cache, v_cache, kv_lens, block_table, softmax_scale,
           flag: bool) -> torch.Tensor:
    """The paged form of ``flash_decode`` (same checks, then ``flash_decode_paged``)."""
    k_cache, v_cache = paged_kv.split_kv(k_cache, v_cache)
    key = call_key("flash_decode_paged", q, k_cache, v_cache, kv_lens, block_table, flag)
    d = memo(group, key, lambda: _validate(group, q, k_cache, v_cache, kv_lens, flag, block_table))
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if kv_lens.device.type == "cpu" and not tracing():  # on the host: free (device: the kernel's)
        paged_kv.check_host(group, kv_lens, block_table, k_cache.shape[1], k_cache.shape[0])
    if direct(q, k_cache, v_cache, kv_lens, block_table):
        return _impl(q, k_cache, v_cache, kv_lens, name, scale, flag, block_table=block_table,
                     tensor_keys=None if key is None else key[1:5] + (_table_key(block_table),))
    return torch.ops.ditron.flash_decode_paged(q, k_cache, v_cache, kv_lens, block_table, name,
                                               scale, flag)


def _validate(group: Group, q, k_cache, v_cache, kv_lens, deterministic: bool,
              block_table=None) -> int:
    """The call's checks (typed errors naming the argument); the head dim. ``block_table``:
    the paged form (``paged_kv.validate_table`` for the cache and table shapes)."""
    dtypes = GPU_DTYPES if group.device.type == "cuda" else CPU_DTYPES
    check_tensor("flash_decode", "q", q, group, dtypes, min_dim=3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor("flash_decode", name, t, group, (q.dtype,), min_dim=4)
    check_tensor("flash_decode", "kv_lens", kv_lens, group, (torch.int32, torch.int64), min_dim=1)
    page = 0
    if block_table is not None:
        check_tensor("flash_decode", "block_table", block_table, group, (torch.int32,), min_dim=2)
        if q.dim() != 3:
            raise ValueError(f"ditron.flash_decode: q must be [B, Hq, D]; got {tuple(q.shape)}")
        page = paged_kv.validate_table(q, k_cache, v_cache, block_table)
    elif q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"ditron.flash_decode: q must be [B, Hq, D] and k_cache/v_cache equal "
                         f"[B, S_max, Hkv, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    b, hq, d = q.shape
    if (k_cache.shape[0] != b and not page) or k_cache.shape[3] != d or tuple(kv_lens.shape) != (b,):
        raise ValueError(f"ditron.flash_decode: batch/head_dim disagree: q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, kv_lens {tuple(kv_lens.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"ditron.flash_decode: head_dim must be one of {HEAD_DIMS}, got {d}")
    if hq % k_cache.shape[2]:
        raise ValueError(f"ditron.flash_decode: Hq = {hq} must be a multiple of Hkv = {k_cache.shape[2]}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("ditron.flash_decode: the head_dim (last) dimension must be contiguous")
    fields = (("dtype", q.dtype), ("B", b), ("Hq", hq), ("Hkv", k_cache.shape[2]), ("D", d),
              ("deterministic", deterministic))
    # paged: the page size joins (it selects the compiled kernel: a new one makes every rank
    # meet before waiting, ``agreement``), so all ranks are paged alike
    agree(group, "flash_decode", fields + ((("page_size", page),) if page else ()))
    return d


def _check_lens(group: Group, kv_lens: torch.Tensor, s_max: int) -> None:
    """Raise ``DitronInputError`` for a host ``kv_lens`` entry outside ``[0, S_max]``."""
    bad = ((kv_lens < 0) | (kv_lens > s_max)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise DitronInputError("flash_decode", "kv_lens", group.rank, i, int(kv_lens[i]),
                               f"lengths must lie in [0, S_max = k_cache.shape[1] = {s_max}]")


SPLIT_CONFIG = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
CTAS_PER_SM = 1
"""Split-KV kernel on the GPU and its programs resident per SM (shared memory bound): the best of
a BLOCK_N x warps x stages x waves sweep on the H200, geo-mean 3454 GB/s vs 3295 for the
runner-up (64, 4 warps, 2 stages, 3 per SM). History: benchmarks/NOTES.md, flash_decode."""
WIDE_SPLIT_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
WIDE_CTAS_PER_SM = 3
WIDE_MAX_KEYS = 4096
"""Default mode with at least ``WIDE_CTAS_PER_SM`` (batch, KV head) pairs per SM and at most
``WIDE_MAX_KEYS`` keys: one program per pair already fills the GPU several times over, and three
short programs per SM hide each other's pipeline start (H200, B=64, KV=4k: 0.960x SDPA vs 0.940x
with ``SPLIT_CONFIG``; it lost at KV=32k, hence the key bound). Never used in deterministic
mode, whose partials must not depend on the batch. History: benchmarks/NOTES.md, flash_decode."""
SPLIT_WAVES = 1
"""Aim for at most this many waves of split-KV programs (1 beat 2 and 3 for every config)."""
MIN_PART = 256
"""Default mode: fewest keys per partial (more partials cost combine traffic)."""
COMBINE_CONFIG = {"BLOCK_P": 1, "BLOCK_C": 32, "num_warps": 4}
"""Chunk combine: pairs per program and partials per block (BLOCK_C fixes the summation tree)."""
MERGE_BLOCK_P = 4


_INTERPRETER_SPLIT_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def _split_config(device: torch.device, pairs: int = 0, s_max: int = 0,
                  deterministic: bool = True) -> dict:
    """The split-KV launch configuration for ``pairs`` (batch x KV heads) of ``s_max`` keys."""
    if device.type != "cuda":
        return _INTERPRETER_SPLIT_CONFIG
    if not deterministic and pairs >= WIDE_CTAS_PER_SM * sm_count(device) and s_max <= WIDE_MAX_KEYS:
        return WIDE_SPLIT_CONFIG
    return SPLIT_CONFIG


def _block_n(device: torch.device) -> int:
    """Key-block granularity of partials (every configuration's BLOCK_N divides it)."""
    return _split_config(device)["BLOCK_N"]


def partition(group: Group, batch: int, kv_heads: int, s_max: int, deterministic: bool):
    """How keys are split: ``(part_len, prog_len, num_parts, splits)``.

    A partial covers ``part_len`` keys (partial ``i`` = keys ``[i part_len, (i+1) part_len)``), a
    split-KV program ``prog_len`` keys (a multiple of ``part_len``); ``num_parts`` partials and
    ``splits`` programs per (batch, KV head). Deterministic: ``part_len = DETERMINISTIC_CHUNK``
    (fixed, so results never depend on the batch or the GPU) and each program takes as many
    whole chunks as keep ``CTAS_PER_SM x SMs`` programs busy. Default: one partial per program,
    balanced key ranges for ``SPLIT_WAVES`` waves, at least ``MIN_PART`` keys.
    """
    s_max = max(s_max, 1)
    slots = CTAS_PER_SM * sm_count(group.device) if group.device.type == "cuda" else 1
    if deterministic:
        part = DETERMINISTIC_CHUNK  # a multiple of BLOCK_N: partials end on key-block boundaries
        assert part % _block_n(group.device) == 0, (part, SPLIT_CONFIG)
        num_parts = -(-s_max // part)
        per_prog = max(1, -(-batch * kv_heads * num_parts // (SPLIT_WAVES * slots)))
        splits = -(-num_parts // per_prog)
        return part, part * per_prog, num_parts, splits
    block_n = _block_n(group.device)
    want = max(1, SPLIT_WAVES * slots // max(1, batch * kv_heads))  # programs <= waves x slots
    part = max(MIN_PART, -(-(-(-s_max // want)) // block_n) * block_n)
    num_parts = -(-s_max // part)
    return part, part, num_parts, num_parts


def merge_programs(group: Group, pairs: int) -> int:
    """Programs of the merge kernel (they wait: all ranks' must be resident together)."""
    if group.device.type != "cuda":
        return 1
    return max(1, min(-(-pairs // MERGE_BLOCK_P), 64, group.sm_share()))


def _seq_len(k, table) -> int:
    """Keys a sequence can hold: ``S_max``, or a paged table's capacity."""
    return k.shape[1] if table is None else paged_kv.capacity(k, table)


def _plan_len(k, table) -> int:
    """Keys a plan is made for: ``S_max``, or a paged table's capacity at the planned width
    (``paged_kv.plan_blocks``: one plan serves a range of widths, so a growing table meets
    O(log) plans; the kernels get the actual capacity per call)."""
    return k.shape[1] if table is None else paged_kv.plan_capacity(k, table)


def _table_key(table) -> tuple:
    """What a plan key holds of a block table: batch and planned width. Its stride and address
    are per-call arguments (``do_not_specialize``), its dtype and row layout are validated."""
    return ("block_table", table.shape[0], paged_kv.plan_blocks(table.shape[1]))


def _kv_ptrs(q, k, v):
    """The tensors the kernel gets for the caches: ``q`` for an empty cache (a rank without
    pages: its capacity is 0, nothing is read, and an empty tensor may have no address)."""
    return (q, q) if k.numel() == 0 else (k, v)


def _split_kv_args(q, k, v, lens, o_part, lse_part, scale, plan, cfg: dict, direct: bool,
                   errors: tuple, table=None):
    """``(args, kwargs, grid)`` of ``split_kv_kernel``; ``errors``: ``(claim, record, rank)``
    where a length outside the cache is recorded. ``table``: the paged form (``k``/``v``
    ``[num_blocks, page_size, Hkv, D]``); else the table arguments are unused placeholders."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    part, prog, num_parts, splits = plan
    assert not direct or (prog == part and num_parts == 1), plan  # the only partial, unflushed
    paged = (launcher.unused_pointer(lens.device, lens.dtype), 0, 0, 0, 0) if table is None else (
        table, table.stride(0), k.shape[0], op_id("flash_decode_paged"), k.shape[1])
    args = (q, *_kv_ptrs(q, k, v), lens, o_part, lse_part, scale, hq, part, prog, num_parts,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), _seq_len(k, table), *errors,
            op_id("flash_decode"), *paged[:4])
    kwargs = dict(G=g, D=d, BLOCK_G=max(16, 1 << (g - 1).bit_length()), FLUSH=prog != part,
                  DIRECT=direct, PAGE=paged[4], **cfg)
    return args, kwargs, (b, hkv, splits)


def _launch_split_kv(q, k, v, lens, o_part, lse_part, scale, plan, cfg: dict, errors: tuple,
                     direct: bool = False, table=None) -> None:
    """Split-KV partials into ``o_part`` / ``lse_part``; ``direct`` (one partial per pair, one
    rank): ``o_part`` is the output and holds the result."""
    args, kwargs, grid = _split_kv_args(q, k, v, lens, o_part, lse_part, scale, plan, cfg, direct,
                                        errors, table)
    compiler.settle_cache_keys(_kernels.split_kv_kernel)  # (a launch outside a plan compiles)
    _kernels.split_kv_kernel[grid](*args, **kwargs)


def _combine_args(o_part, lse_part, lens, out, buf, buf_table, plan, rank, world_size, seq_len):
    """``(args, kwargs, grid)`` of ``chunk_combine_kernel``: this rank's partials (lengths
    clamped into ``[0, seq_len]``, as split-KV's); one rank writes ``out``, more push into
    ``buf`` (see the kernel)."""
    cfg = COMBINE_CONFIG
    b, hq, d = out.shape
    args = (o_part, lse_part, lens, out, buf, buf_table, b * hq, hq, plan[0], plan[2], rank,
            world_size, seq_len)
    return args, dict(D=d, FINAL=world_size == 1, **cfg), (-(-b * hq // cfg["BLOCK_P"]),)


def _impl(q, k_cache, v_cache, kv_lens, group_name, softmax_scale, deterministic,
          tensor_keys=None, block_table=None):
    group = resolve_group(group_name)
    b, hq, d = q.shape
    out = q.new_empty((b, hq, d))
    if b == 0:
        return out
    table = block_table
    if not group.has_symmetric_memory:  # no plan: the partition of this call's capacity
        s_max = _seq_len(k_cache, table)
        plan = partition(group, b, k_cache.shape[2], s_max, deterministic)
        cfg = _split_config(q.device, b * k_cache.shape[2], s_max, deterministic)
        o_part = torch.empty(b * hq * plan[2] * d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(b * hq * plan[2], dtype=torch.float32, device=q.device)
        _launch_split_kv(q, k_cache, v_cache, kv_lens, o_part, lse_part, softmax_scale, plan, cfg,
                         (*group._error_tensors()[::-1], group.rank), table=table)
        return _merge_over_process_group(group, o_part, lse_part, kv_lens, plan, b, hq,
                                          d).to(q.dtype)
    if tensor_keys is None:  # (q, k_cache, v_cache, kv_lens[, block_table])
        tensor_keys = tuple(tensor_key(t) for t in (q, k_cache, v_cache, kv_lens))
        if table is not None:
            tensor_keys += (_table_key(table),)
    key = ("flash_decode", deterministic, softmax_scale, *tensor_keys)  # out: made here
    plan = group.plans.get(key, lambda previous=None: _DecodePlan(
        group, q, k_cache, v_cache, kv_lens, out, softmax_scale, deterministic, previous, table))
    return plan.run(q, k_cache, v_cache, kv_lens, out, table)


class _DecodePlan:
    """flash_decode on a group with symmetric memory, for one key: the partition, the partials'
    scratch (stream-ordered reuse, as the workspace) and the bound launches. One rank with one
    partial per pair: the split-KV kernel writes the output (the combine would return it bit for
    bit); one rank: split-KV + the final combine; more: + start barrier, pushing combine, merge.
    ``table`` (paged): the block table, its row stride and the capacity are per-call
    arguments of split-KV (and the capacity of the combine): the plan serves every table width
    that rounds to its planned one (``_plan_len``)."""

    def __init__(self, group: Group, q, k_cache, v_cache, kv_lens, out, scale: float,
                 deterministic: bool, previous: "_DecodePlan | None" = None, table=None):
        self.group = group
        b, hq, d = q.shape
        hkv, s_max = k_cache.shape[2], _plan_len(k_cache, table)
        part = partition(group, b, hkv, s_max, deterministic)
        cfg = _split_config(q.device, b * hkv, s_max, deterministic)
        w, rank = group.world_size, group.rank
        device = q.device
        self.direct = w == 1 and part[2] == 1
        self.ws = None
        errors = (*group._error_tensors()[::-1], rank)  # (claim, record, rank)
        paged = ("table_ptr", "stride_tb", "seq_len") if table is not None else ()
        self.page_cap = 0 if table is None or k_cache.shape[0] == 0 else k_cache.shape[1]
        if self.direct:
            one = (part[0], part[0], 1, 1)
            self.split = _bound_split_kv(q, k_cache, v_cache, kv_lens, out, out, scale, one, cfg,
                                         errors, direct=True, table=table,
                                         vary=("q_ptr", "k_ptr", "v_ptr", "lens_ptr", "o_part",
                                               "lse_part") + paged)
            return
        pairs = b * hq
        if previous is not None:  # a stale plan of this key: its scratch, no allocation
            self.o_part, self.lse_part = previous.o_part, previous.lse_part
        else:
            self.o_part = torch.empty(pairs * part[2] * d, dtype=torch.float32, device=device)
            self.lse_part = torch.empty(pairs * part[2], dtype=torch.float32, device=device)
        self.split = _bound_split_kv(q, k_cache, v_cache, kv_lens, self.o_part, self.lse_part,
                                     scale, part, cfg, errors, table=table,
                                     vary=("q_ptr", "k_ptr", "v_ptr", "lens_ptr") + paged)
        seq_len = _seq_len(k_cache, table)
        if w == 1:  # nothing to exchange: the combine writes the output
            self.combine = _bound_combine(self.o_part, self.lse_part, kv_lens, out, self.o_part,
                                          self.o_part, part, 0, 1, seq_len, table is not None)
            return
        if device.type == "cuda":  # every variant a later plan of this signature can pick
            _compile_split_variants(q, k_cache, v_cache, kv_lens, self.o_part, self.lse_part,
                                    scale, part, cfg, errors, table, deterministic, b * hkv)
        self.ws = ws = group.workspace(PURPOSE)
        self.data = data = ws.ensure_data(w * pairs * (d + 1) * 4)
        record, claim = group._error_tensors()
        sig, timeout = ws.signal_pad(), group.timeout_us()
        buf = data.local.view(torch.float32)
        self.start = launcher.BoundKernel(barrier.start_barrier_kernel, (1,),
                                          (sig, ws.signal.ptr_table, claim, record, rank, w, 0,
                                           timeout, op_id("flash_decode")), {}, device=device)
        self.combine = _bound_combine(self.o_part, self.lse_part, kv_lens, out, buf,
                                      data.ptr_table, part, rank, w, seq_len, table is not None)
        self.merge = launcher.BoundKernel(
            _kernels.decode_merge_kernel, (merge_programs(group, pairs),),
            (out, buf, sig, ws.signal.ptr_table, claim, record, pairs, rank, w, timeout,
             op_id("flash_decode")), dict(D=d, BLOCK_P=MERGE_BLOCK_P, num_warps=4),
            vary=("out_ptr",), device=device)

    def stale(self) -> bool:
        """The workspace grew since (another call's plan): the exchange buffer was freed."""
        return self.ws is not None and self.ws.data is not self.data

    def run(self, q, k_cache, v_cache, kv_lens, out, table=None):
        group = self.group
        k_cache, v_cache = _kv_ptrs(q, k_cache, v_cache)
        if table is None:
            tail = tail_c = ()
        else:  # this call's table: address, row stride, capacity
            seq_len = table.shape[1] * self.page_cap
            tail, tail_c = (table, table.stride(0), seq_len), (seq_len,)
        if self.direct:
            self.split.launch(q, k_cache, v_cache, kv_lens, out, out, *tail)
            return out
        if self.ws is None:
            self.split.launch(q, k_cache, v_cache, kv_lens, *tail)
            self.combine.launch(kv_lens, out, *tail_c)
            return out
        # Earlier calls' errors, before this call launches anything: a bad input its split
        # kernel records is raised after the waits (next check), never between this rank's
        # kernels, where a rank raising early left its peers at the launch gate (H200, W=2).
        group.check()
        self.split.launch(q, k_cache, v_cache, kv_lens, *tail)
        ws = self.ws
        ws.calls += 1
        with group.waiting_launch("flash_decode", ws.calls):
            self.start.launch()
            self.combine.launch(kv_lens, out, *tail_c)
            self.merge.launch(out)
        if group.sync_check:
            group.synchronize()
        return out


def _bound_split_kv(q, k, v, lens, o_part, lse_part, scale, plan, cfg: dict, errors: tuple, *,
                    direct: bool = False, vary=(), table=None) -> launcher.BoundKernel:
    """``_launch_split_kv`` bound (the tensors in ``vary`` per call)."""
    args, kwargs, grid = _split_kv_args(q, k, v, lens, o_part, lse_part, scale, plan, cfg, direct,
                                        errors, table)
    return launcher.BoundKernel(_kernels.split_kv_kernel, grid, args, kwargs, vary=vary,
                                device=q.device)


def _bound_combine(o_part, lse_part, lens, out, buf, buf_table, plan, rank, world_size, seq_len,
                   paged: bool = False):
    """``chunk_combine_kernel`` bound (``lens`` and ``out`` per call; paged: ``seq_len`` too)."""
    args, kwargs, grid = _combine_args(o_part, lse_part, lens, out, buf, buf_table, plan, rank,
                                       world_size, seq_len)
    return launcher.BoundKernel(_kernels.chunk_combine_kernel, grid, args, kwargs,
                                vary=("lens_ptr", "out_ptr") + (("seq_len",) if paged else ()),
                                device=out.device)


def split_variants(device: torch.device, pairs: int, deterministic: bool) -> tuple:
    """Every ``(config, FLUSH)`` split-KV variant a waiting call can launch, given what the
    ranks agree on (dtype, B, heads, D, mode, page size; ``_validate``): the per-rank cache
    length only chooses among these (``_split_config``'s key bound, ``partition``'s chunks
    per program). Deterministic: ``SPLIT_CONFIG``, one partial per program or several;
    default: one partial per program, ``SPLIT_CONFIG`` or (enough pairs) the wide one."""
    if deterministic:
        return ((SPLIT_CONFIG, False), (SPLIT_CONFIG, True))
    wide = _split_config(device, pairs, 0, False)
    return ((SPLIT_CONFIG, False),) + (((wide, False),) if wide is not SPLIT_CONFIG else ())


def _compile_split_variants(q, k, v, lens, o_part, lse_part, scale, plan, cfg, errors, table,
                            deterministic: bool, pairs: int) -> None:
    """Compile (inside the plan's build) the split-KV variants of ``split_variants`` this plan
    does not launch.

    Why: ``agreement`` makes every rank meet before a call of a new signature waits, so what
    that call compiles never holds a peer's wait; but which variant a call launches also
    follows the rank's own cache length (``S_max``, a table's width), which no signature
    holds. Compiling all of them at the signature's first plan leaves later plans (a longer
    cache, a wider table) nothing to compile while peers spin (DESIGN.md §4). Later builds
    find them in Triton's cache (a look-up each)."""
    flush = plan[1] != plan[0]
    for cfg2, flush2 in split_variants(q.device, pairs, deterministic):
        if (cfg2 is cfg or cfg2 == cfg) and flush2 == flush:
            continue  # the plan's own
        plan2 = (plan[0], 2 * plan[0] if flush2 else plan[0], plan[2], 1)
        _bound_split_kv(q, k, v, lens, o_part, lse_part, scale, plan2, cfg2, errors, table=table)


def _combine(o: torch.Tensor, lse: torch.Tensor):
    """The kernels' merge of ``n`` partials per pair (``o [P, n, D]``, ``lse [P, n]``; fp32):
    max first, weights ``e^(lse - max)`` (0 when empty), weighted mean; returns ``(o, lse)``."""
    top = lse.max(dim=1).values
    safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - safe[:, None]))
    total = w.sum(dim=1)
    has = total > 0
    out = (o * w[:, :, None]).sum(dim=1) / torch.where(has, total, torch.ones_like(total))[:, None]
    return out, torch.where(has, top + torch.log(torch.where(has, total, torch.ones_like(total))),
                            torch.full_like(top, float("-inf")))


def _merge_over_process_group(group: Group, o_part, lse_part, kv_lens, plan, b, hq, d) -> torch.Tensor:
    """Groups without symmetric memory (torch backend): the same merge in torch (the sums may
    associate differently from the kernels'), the per-rank partials exchanged with
    ``gather_tensors``."""
    from ..reference import gather_tensors

    part, num_parts = plan[0], plan[2]
    lens = kv_lens.to(torch.int64).clamp(min=0).repeat_interleave(hq)  # [B * Hq]; as the kernels
    valid = ((lens + part - 1) // part).clamp(max=num_parts)          # clamp (an error recorded)
    written = torch.arange(num_parts, device=o_part.device)[None, :] < valid[:, None]
    lse = torch.where(written, lse_part.view(b * hq, num_parts), float("-inf"))
    o = torch.where(written[:, :, None], o_part.view(b * hq, num_parts, d), 0.0)
    o, lse = _combine(o, lse)
    parts = gather_tensors(torch.cat([o, lse[:, None]], dim=1), group)
    stacked = torch.stack(parts, dim=1)  # [P, W, D + 1], ranks in order
    return _combine(stacked[:, :, :d], stacked[:, :, d])[0].view(b, hq, d)


def _fake(q, k_cache, v_cache, kv_lens, group_name, softmax_scale, deterministic):
    return q.new_empty(q.shape)


define_op("flash_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, str group_name, "
          "float softmax_scale, bool deterministic) -> Tensor", _impl, _fake)


def _impl_paged(q, k_cache, v_cache, kv_lens, block_table, group_name, softmax_scale,
                deterministic):
    return _impl(q, k_cache, v_cache, kv_lens, group_name, softmax_scale, deterministic,
                 block_table=block_table)


def _fake_paged(q, k_cache, v_cache, kv_lens, block_table, group_name, softmax_scale,
                deterministic):
    return q.new_empty(q.shape)


# a second op, not an optional argument of the first: the contiguous op's schema (and every
# compiled graph holding it) stays as it was
define_op("flash_decode_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, "
          "Tensor block_table, str group_name, float softmax_scale, bool deterministic) -> Tensor",
          _impl_paged, _fake_paged)


PRECOMPILE_PAGES = (1, 16, 64, 256)
"""Page sizes ``precompile`` covers: the defaults of SGLang (1), vLLM (16), TensorRT-LLM and
FlashMLA (64) and FlashAttention's paged KV (256). Other sizes compile at their first call, as
every call's plan does (the first call of a page size is a new agreed signature, so the ranks
meet before it waits, and its first plan compiles every variant later calls can pick)."""


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """Split-KV (dtype x head_dim x common GQA groups, FLUSH off / on, both configs, direct;
    paged: the variants a call can pick, ``split_variants`` and direct, for
    ``PRECOMPILE_PAGES``), the combine (final and pushing) and the merge, as one-rank launches
    (``runtime.precompile``)."""
    sig, sig_table, claim, record = one_rank_pad(device, (0, 1, 0, 1))
    lens = torch.full((1,), 64, dtype=torch.int32, device=device)
    errors = (claim, record, 0)
    one_part, two_parts = (64, 64, 1, 1), (64, 128, 2, 1)  # FLUSH off / on (keys 64..127 unused)
    paged_variants = ((one_part, SPLIT_CONFIG, False), (two_parts, SPLIT_CONFIG, False),
                      (one_part, WIDE_SPLIT_CONFIG, False), (one_part, SPLIT_CONFIG, True),
                      (one_part, WIDE_SPLIT_CONFIG, True))  # (plan, config, direct)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    for dtype in (d for d in GPU_DTYPES if d in dtypes):
        for d in HEAD_DIMS:
            for g in (1, 4, 8):
                q = torch.ones(1, g, d, dtype=dtype, device=device)
                kv = torch.ones(1, 64, 1, d, dtype=dtype, device=device)
                o_part = torch.empty(2 * g * d, dtype=torch.float32, device=device)
                lse_part = torch.empty(2 * g, dtype=torch.float32, device=device)
                for plan, cfg in itertools.product((one_part, two_parts), (SPLIT_CONFIG, WIDE_SPLIT_CONFIG)):
                    _bound_split_kv(q, kv, kv, lens, o_part, lse_part, 0.1, plan, cfg, errors)
                for cfg in (SPLIT_CONFIG, WIDE_SPLIT_CONFIG):  # one rank, one partial: the output
                    _bound_split_kv(q, kv, kv, lens, q.clone(), q, 0.1, one_part, cfg, errors,
                                    direct=True)
                for page in PRECOMPILE_PAGES:
                    pages = torch.ones(1, page, 1, d, dtype=dtype, device=device)
                    for plan, cfg, direct_ in paged_variants:
                        o, lse = (q.clone(), q) if direct_ else (o_part, lse_part)
                        _bound_split_kv(q, pages, pages, lens, o, lse, 0.1, plan, cfg, errors,
                                        direct=direct_, table=table)
            buf = torch.zeros(d + 1, dtype=torch.float32, device=device)
            buf_table = pointer_table(buf)
            out = torch.empty(1, 1, d, dtype=dtype, device=device)
            _bound_combine(o_part[:2 * d], lse_part[:2], lens, out, buf, buf_table, two_parts, 0, 1,
                           64)
            launcher.BoundKernel(_kernels.chunk_combine_kernel, (1,),
                                 (o_part[:2 * d], lse_part[:2], lens, out, buf, buf_table, 1, 1, 64,
                                  2, 0, 1, 64),
                                 dict(D=d, FINAL=False, **COMBINE_CONFIG), device=device)  # pushing
            launcher.BoundKernel(_kernels.decode_merge_kernel, (1,),
                                 (out, buf, sig, sig_table, claim, record, 1, 0, 1, 10**6, 0),
                                 dict(D=d, BLOCK_P=MERGE_BLOCK_P, num_warps=4), device=device)


register_precompile(PURPOSE, _precompile, ("flash_decode",))
