"""``Buffer``: expert-parallel token exchange (``dispatch`` tokens to the ranks of their experts,
``combine`` the experts' outputs back, weighted) with device-side sizes.

A Buffer is sized once (``Buffer.size_hint`` says how much symmetric memory per rank) and then
used for every MoE layer of a model, call after call, eagerly or from CUDA graphs::

    buf = ditron_ops.moe.Buffer(group, num_experts=256, max_tokens_per_rank=4096, hidden=7168,
                                topk=8)
    d = buf.dispatch(x, topk_idx, topk_weights, layout="expert_contig", expert_alignment=128)
    y = experts(d.x, d.offsets)          # grouped GEMMs over each local expert's rows
    out = buf.combine(y, d.handle)       # [T, H]: sum_k topk_weights[t, k] * y[row of (t, k)]

Nothing on the call path waits for the device: every rank's counts are exchanged and prefix
summed on the device, outputs have static shapes (``expert_padded``: ``[E_local, W * T_max, H]``;
``expert_contig``: ``[CAP + E_local * (alignment - 1), H]`` with the used rows given by
``offsets``), so dispatch and combine can be captured in a CUDA graph. Signals carry epochs and
are never cleared: no cleaning call between calls, layouts or modes.

Placement: a received row's position is a pure function of the global routing (expert, then
source rank, then source token, then k) with ``deterministic=True`` (or inside
``ditron_ops.deterministic()``); the default mode counts positions with integer atomics (the
rows of one (expert, source) pair may come in any order). The combine is the same in both
modes: fp32, slots in k order, one rounding, so its result never depends on placement, on
other tokens or on timing.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Optional

import torch

from ..deterministic import resolve_deterministic
from ..errors import DitronError
from ..runtime.agreement import agree
from ..runtime.group import Group, current_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import PlanCache

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
_kernels = lazy_import("._kernels", globals())
_launch = lazy_import("._launch", globals())

LAYOUTS = ("expert_padded", "expert_contig")
_ids = itertools.count()
_buffers: dict[str, "Buffer"] = {}
_lock = threading.Lock()


class MoEError(DitronError):
    """A problem a dispatch found on the device, raised by the next host check on every rank
    that saw it.

    Attributes
    ----------
    kind : str
        ``"overflow"``, ``"expert_ids"`` or ``"tokens"``.
    rank : int
        The rank whose input or receive buffer it concerns.
    epoch : int
        The dispatch (per Buffer, counted on the device) it happened in.
    """

    def __init__(self, kind: str, rank: int, epoch: int, message: str):
        self.kind, self.rank, self.epoch = kind, rank, epoch
        super().__init__(message)


class MoEOverflowError(MoEError):
    """More entries for an expert than the layout holds (rows past the capacity were dropped).

    Attributes
    ----------
    expert, count, room : int
        The first overflowing expert (global id), the entries it was sent, the rows it had.
    """


class MoEInputError(MoEError):
    """A rank passed routing ids outside ``[-1, num_experts)`` or more tokens than
    ``max_tokens_per_rank`` (its tokens were left out of that dispatch)."""


@dataclasses.dataclass
class MoEHandle:
    """What ``combine`` (and a cached-layout ``dispatch``) needs of a dispatch: plain tensors.

    Attributes
    ----------
    src_of_row : torch.Tensor
        ``int32 [R]``: source of each received row, ``rank * T_max * k + t * k + j``; -1 for
        unused rows.
    dest : torch.Tensor
        ``int32 [T, k]``: where each of this rank's entries went, ``owner * CAP + compact row``;
        -1 for ``topk_idx == -1`` and dropped entries.
    counts : torch.Tensor
        ``int32 [E_local]``: rows received per local expert.
    offsets : torch.Tensor
        ``int32 [E_local + 1]``: first row of each local expert in the layout.
    cstart : torch.Tensor
        ``int32 [E_local + 1]``: first compact row of each local expert; the last entry is the
        number of entries sent to this rank.
    layout : str
    expert_alignment : int
    topk_weights : torch.Tensor or None
        The weights given to the dispatch (``combine``'s default).
    buffer_name : str
    """

    src_of_row: torch.Tensor
    dest: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    cstart: torch.Tensor
    layout: str
    expert_alignment: int
    topk_weights: Optional[torch.Tensor]
    buffer_name: str

    def tensors(self) -> tuple:
        return self.src_of_row, self.dest, self.counts, self.offsets, self.cstart


@dataclasses.dataclass
class MoEDispatch:
    """The result of ``Buffer.dispatch``.

    Attributes
    ----------
    x : torch.Tensor
        Received tokens: ``expert_padded`` ``[E_local, W * T_max, H]`` (expert e's rows
        ``[0, counts[e])``), ``expert_contig`` ``[CAP + E_local * (alignment - 1), H]`` (expert
        e's rows ``[offsets[e], offsets[e] + counts[e])``, padded to ``offsets[e + 1]``). Buffer
        dtype, or ``float8_e4m3fn`` with ``fp8``. Unused rows are unspecified (zeros when the
        call records autograd).
    scales : torch.Tensor or None
        fp8: ``fp32 [..., H / 128]`` per row (dequantize: ``x.float() * scale`` per 128 channels).
    counts, offsets : torch.Tensor
        ``int32 [E_local]`` and ``int32 [E_local + 1]`` on the device.
    weights : torch.Tensor
        ``fp32``, one per row (``[E_local, W * T_max]`` or ``[rows]``); 0 for unused rows.
    handle : MoEHandle
    """

    x: torch.Tensor
    scales: Optional[torch.Tensor]
    counts: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    handle: MoEHandle


def resolve_buffer(name: str) -> "Buffer":
    """The open Buffer registered under ``name`` (what the op implementations call)."""
    try:
        return _buffers[name]
    except KeyError:
        raise ValueError(f"ditron.moe: no open Buffer named {name!r} in this process (closed?)") from None


def programs_per_rank(group: Group) -> int:
    """``_launch.programs_per_rank`` (a name of this module: tests replace it)."""
    return _launch.programs_per_rank(group)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ditron.moe.Buffer: {name} must be a positive int, got {value!r}")
    return value


def _aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Contiguous and 16-byte aligned (what the bound kernels were built for)."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class Buffer:
    """A long-lived symmetric workspace for MoE dispatch and combine on one group.

    Parameters
    ----------
    group : Group, optional
        Defaults to the current group. Needs symmetric memory (virtual or nvshmem backend).
    num_experts : int
        E, a multiple of the world size W; expert e lives on rank ``e // (E / W)``.
    max_tokens_per_rank : int
        T_max: the most tokens any rank passes to one dispatch.
    hidden : int
        H, a multiple of 8 (of 128 with ``fp8``).
    topk : int
        k, routing slots per token.
    dtype : torch.dtype
        Token dtype: bf16 / fp16 / fp32 (the interpreter: fp16 / fp32).
    fp8 : bool
        Quantize dispatched tokens to e4m3 per token and 128 channels, in the dispatch kernel
        or, from 4M token values per rank (``max_tokens_per_rank x hidden``), in a kernel of
        its own before it (``_launch.fp8_variant``; the same bits either way):
        ``moe.reference.quantize_fp8``'s codes and scales bit for bit for finite tokens; a
        group holding +-inf has scale inf, +-0 codes and NaN codes for the infinities as
        there (a NaN code's sign may differ); a group holding NaN has NaN codes for its NaNs,
        its scale and other codes unspecified (the kernels' amax may skip NaN, torch's not).
    round_scale : bool
        fp8: round each scale up to a power of two.
    max_recv_tokens : int, optional
        CAP, the most entries one rank can receive (default ``W * T_max * min(k, E / W)``:
        everything, when no token names an expert twice). Smaller saves memory; entries past it
        are dropped and reported (``MoEOverflowError``).

    Constraints
    -----------
    Collective: every rank creates (and ``close``s) its Buffers in the same order with the same
    arguments. A Buffer serves any number of layers; calls run on the current stream, are
    collectives (every rank calls ``dispatch`` / ``combine`` in the same order) and never
    synchronize. ``combine`` returns only after every rank read this rank's staging, so a caller
    may write the next expert outputs into ``combine_input()`` right after.

    Examples
    --------
    Four experts, two per rank; the third token of each rank picks one expert (-1: none):

    >>> import torch, ditron_ops
    >>> def body(group):
    ...     x = torch.arange(8.0, device=group.device).repeat(3, 1) + group.rank   # [T = 3, H = 8]
    ...     idx = torch.tensor([[0, 3], [1, 2], [2, -1]], device=group.device)
    ...     w = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 0.0]], device=group.device)
    ...     with ditron_ops.moe.Buffer(group, num_experts=4, max_tokens_per_rank=3, hidden=8,
    ...                                topk=2, dtype=torch.float32) as buf:
    ...         d = buf.dispatch(x, idx, w, layout="expert_contig")
    ...         counts = d.counts.tolist()            # tokens received per local expert
    ...         out = buf.combine(d.x, d.handle)      # identity experts: sum_j w_j x = x
    ...     return counts, torch.equal(out, x)
    >>> ditron_ops.launch(body, 2)
    [([2, 2], True), ([4, 2], True)]
    """

    def __init__(self, group: Optional[Group] = None, *, num_experts: int, max_tokens_per_rank: int,
                 hidden: int, topk: int, dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                 round_scale: bool = False, max_recv_tokens: Optional[int] = None):
        group = current_group(group)
        regions = _regions(group.world_size, num_experts, max_tokens_per_rank, hidden, topk, dtype,
                           fp8, max_recv_tokens)
        if group.device.type != "cuda" and dtype == torch.bfloat16:
            raise TypeError("ditron.moe.Buffer: bf16 needs a GPU (the Triton interpreter's bf16 "
                            "arithmetic is wrong); use fp16 or fp32 on CPU")
        if not group.has_symmetric_memory:
            raise DitronError(f"ditron.moe.Buffer: group {group.group_name!r} ({group.backend}) has "
                              "no symmetric memory; use a virtual or nvshmem group (the plain torch "
                              "exchange is ditron_ops.moe.reference)")
        agree(group, "moe.Buffer", (
            ("num_experts", num_experts), ("max_tokens_per_rank", max_tokens_per_rank),
            ("hidden", hidden), ("topk", topk), ("dtype", dtype), ("fp8", bool(fp8)),
            ("round_scale", bool(round_scale)), ("max_recv_tokens", regions.capacity)))
        self.group, self.regions = group, regions
        self.num_experts, self.max_tokens, self.hidden, self.topk = num_experts, max_tokens_per_rank, hidden, topk
        self.dtype, self.fp8, self.round_scale = dtype, bool(fp8), bool(round_scale)
        self.capacity = regions.capacity
        self.experts_local = num_experts // group.world_size
        self.sym = group.alloc_symmetric(regions.nbytes)
        self.views = regions.views(self.sym.local)
        # every rank must wait for the same number of programs: agree on the smallest share
        self.programs = min(group.all_gather_object(programs_per_rank(group)))
        self.scratch = _launch.Scratch(regions, self.programs, group.device)
        self.combine_in_place = group.shared_address_space
        """Whether ``combine`` reads each rank's expert outputs where they are (default where
        every rank's kernels address every rank's tensors: a virtual world) instead of copying
        them into the symmetric staging first (every other backend; set False to run that path
        in a virtual world, e.g. to measure it). Same results either way, per rank: each rank's
        combine tells its peers where its rows are."""
        pin = group.device.type == "cuda"
        self.record = torch.zeros(8, dtype=torch.int64, pin_memory=pin)
        self._status = self.record.numpy()
        self.claim = torch.zeros(1, dtype=torch.int64, device=group.device)
        self._failure: Optional[BaseException] = None
        self._held_y: Optional[torch.Tensor] = None  # run_combine's in-place input
        self._fp8_quant = _launch.fp8_variant(max_tokens_per_rank, hidden)  # ``_fp8_variant``
        self.plans = PlanCache(group)  # plans view this Buffer's memory: they go with it
        self.dispatch_calls = self.combine_calls = 0
        self.name = f"{group.group_name}/moe{next(_ids)}"
        with _lock:
            _buffers[self.name] = self
        group.own(self.name, self)  # dropped with the group if never closed (``drop``)

    # -- sizes --------------------------------------------------------------------------------------
    @staticmethod
    def size_hint(world_size: int, *, num_experts: int, max_tokens_per_rank: int, hidden: int,
                  topk: int, dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                  max_recv_tokens: Optional[int] = None) -> int:
        """Symmetric bytes per rank a Buffer with these arguments allocates (private scratch:
        about ``20 * T_max * k`` more bytes)."""
        return _regions(world_size, num_experts, max_tokens_per_rank, hidden, topk, dtype, fp8,
                        max_recv_tokens).nbytes

    @property
    def nbytes(self) -> int:
        """Device bytes this Buffer holds per rank (symmetric + scratch)."""
        sc = self.scratch
        return self.regions.nbytes + sum(t.numel() * t.element_size() for t in
                                         (sc.idx32, sc.pos, sc.hist, sc.count, sc.bad, sc.tables,
                                          sc.route))

    def rows(self, layout: str, expert_alignment: int = 1) -> int:
        """Received rows of ``layout`` (the outputs' first dimension, flattened)."""
        if layout == "expert_padded":
            return self.experts_local * self.group.world_size * self.max_tokens
        return self.capacity + self.experts_local * (expert_alignment - 1)

    @property
    def _fp8_variant(self) -> str:
        """How fp8 dispatches quantize (``_launch.FP8_VARIANTS``, the same bits): by default
        ``_launch.fp8_variant`` of the token bound; settable for the bench's A/B of the
        quantization (``ditron_ops.bench.moe``) and the tests.

        Set on every rank at the same point of its call sequence, like a collective call; a
        change has the ranks meet before the next waiting launch (``Group.meet_before_next_wait``,
        what a new agreed call signature does). Why: the variant is in the dispatch plan key
        but not in the signature the ranks agree on, so the next dispatch may compile its
        kernels on one rank while a peer's dispatch kernel already waits (past the wait bound
        with a cold Triton cache). A setter rather than a constructor argument: the bench
        times every variant on one Buffer. Not agreed on: ranks that disagree exchange the
        same bytes."""
        return self._fp8_quant

    @_fp8_variant.setter
    def _fp8_variant(self, variant: str) -> None:
        if variant not in _launch.FP8_VARIANTS:
            raise ValueError(f"moe Buffer: fp8 variant {variant!r} is not one of "
                             f"{_launch.FP8_VARIANTS}")
        if variant != self._fp8_quant and self.group.world_size > 1:
            self.group.meet_before_next_wait()
        self._fp8_quant = variant

    # -- public calls ---------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, layout: str = "expert_padded",
                 expert_alignment: int = 1, deterministic: Optional[bool] = None,
                 handle: Optional[MoEHandle] = None) -> MoEDispatch:
        """Send every token to the ranks of its experts.

        Parameters
        ----------
        x : torch.Tensor
            ``[T, H]`` in the Buffer's dtype, ``T <= max_tokens_per_rank`` (0 allowed).
        topk_idx : torch.Tensor
            ``int32/int64 [T, k]``: expert per slot, -1 for none. Not needed with ``handle``.
        topk_weights : torch.Tensor, optional
            ``fp32 [T, k]``: received per row (``MoEDispatch.weights``) and ``combine``'s default.
        layout : str
            ``"expert_padded"`` or ``"expert_contig"`` (see ``MoEDispatch.x``).
        expert_alignment : int
            ``expert_contig``: each expert's row count is padded to a multiple of it.
        deterministic : bool, optional
            Defaults to the ``ditron_ops.deterministic()`` mode. True: each row's position is a
            pure function of the global routing (bitwise reproducible, batch invariant). False:
            positions inside one (expert, source rank) block come from integer atomics.
        handle : MoEHandle, optional
            Reuse a previous dispatch's layout (same routing and token count): no layout
            kernels, no count exchange; ``topk_idx`` is ignored.

        Returns
        -------
        MoEDispatch

        Raises
        ------
        TypeError, ValueError
            Bad dtypes, shapes or arguments: before any launch. A token count above
            ``max_tokens_per_rank`` raises ValueError here after a launch that sends nothing,
            so the peers raise ``MoEInputError`` at their next check instead of waiting.
        MoEError, DitronTimeoutError
            A problem an earlier call recorded on the device.

        Constraints
        -----------
        Collective: all ranks call it in the same order with the same layout, alignment and
        mode, and pass ``topk_weights`` all or none (peers read them). Ids outside
        ``[-1, E)`` are treated as -1 and reported on every rank (``MoEInputError``) at the
        next check; receive overflow (``max_recv_tokens``, or a token naming an expert twice
        with ``expert_padded``) drops the extra rows and raises ``MoEOverflowError`` on the
        receiving rank at its next check. fp8 dispatches have no backward.
        """
        if handle is not None:
            return self._dispatch_cached(x, topk_weights, handle)
        if layout not in LAYOUTS:
            raise ValueError(f"ditron.moe.dispatch: layout must be one of {LAYOUTS}, got {layout!r}")
        alignment = _positive("expert_alignment", expert_alignment)
        if layout == "expert_padded" and alignment != 1:
            raise ValueError("ditron.moe.dispatch: expert_alignment applies to layout='expert_contig'")
        det = resolve_deterministic(deterministic)
        # (a set lookup per call: the signature has no per-rank part to key a memo on)
        agree(self.group, "moe.dispatch", (("layout", layout), ("expert_alignment", alignment),
                                           ("deterministic", det),
                                           ("topk_weights given", topk_weights is not None)))
        self._check_inputs("dispatch", x, topk_idx, topk_weights)
        zero = torch.is_grad_enabled() and (x.requires_grad or (
            topk_weights is not None and topk_weights.requires_grad))
        outs = torch.ops.ditron.moe_dispatch(x, topk_idx, topk_weights, self.name, layout, alignment,
                                             det, self.fp8, self.round_scale, zero)
        recv_x, scales, recv_w, counts, offsets, cstart, src, dest = outs
        handle = MoEHandle(src, dest, counts, offsets, cstart, layout, alignment, topk_weights, self.name)
        return self._result(recv_x, scales, recv_w, handle)

    def combine(self, y: torch.Tensor, handle: MoEHandle, topk_weights: Optional[torch.Tensor] = None,
                *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum every token's expert outputs with its top-k weights: ``out[t] = sum_j w[t, j] *
        y[row of (t, j)]`` in fp32, j in order, rounded once.

        Parameters
        ----------
        y : torch.Tensor
            Expert outputs in the dispatch's layout (``MoEDispatch.x``'s shape), Buffer dtype
            (not fp8). Only rows holding received tokens are read. Passing ``combine_input()``
            (layout ``expert_contig`` with alignment 1) skips the staging copy (a virtual world
            makes none: peers read ``y`` in place, ``combine_in_place``).
        handle : MoEHandle
        topk_weights : torch.Tensor, optional
            ``fp32 [T, k]``; default: the dispatch's weights, else 1 (a plain sum).
        out : torch.Tensor, optional
            ``[T, H]``, written by the kernel (a copy of the result when autograd records).

        Returns
        -------
        torch.Tensor
            ``[T, H]`` in y's dtype; rows of tokens without experts are 0.

        Constraints
        -----------
        Collective. Returns after every rank has read this rank's expert outputs.
        """
        self._check_handle(handle, "combine")
        layout_shape = self._layout_shape(handle, self.hidden)
        from .._validation import check_tensor

        check_tensor("moe.combine", "y", y, self.group, (self.dtype,))
        if tuple(y.shape) != layout_shape:
            raise ValueError(f"ditron.moe.combine: y must have the dispatch layout's shape "
                             f"{layout_shape}, got {tuple(y.shape)}")
        weights = handle.topk_weights if topk_weights is None else topk_weights
        t, k = handle.dest.shape
        if weights is not None:
            self._check_weights("combine", weights, t)
        rows = y.reshape(-1, self.hidden)
        if out is not None:
            check_tensor("moe.combine", "out", out, self.group, (self.dtype,))
            if tuple(out.shape) != (t, self.hidden) or not out.is_contiguous():
                raise ValueError(f"ditron.moe.combine: out must be contiguous {(t, self.hidden)}, "
                                 f"got {tuple(out.shape)}")
            if torch.is_grad_enabled() and (y.requires_grad or (weights is not None and weights.requires_grad)):
                return out.copy_(torch.ops.ditron.moe_combine(rows, weights, *handle.tensors(), self.name))
            torch.ops.ditron.moe_combine_out(rows, weights, *handle.tensors(), self.name, out)
            return out
        return torch.ops.ditron.moe_combine(rows, weights, *handle.tensors(), self.name)

    def combine_input(self) -> torch.Tensor:
        """``[CAP, H]`` view of this rank's combine staging: expert outputs written here in the
        ``expert_contig`` layout with ``expert_alignment=1`` need no staging copy in
        ``combine`` (in a virtual world no input needs one: ``combine_in_place``). Overwritten
        by nothing but the caller (and ``combine``'s own staging copy of other inputs); peers
        read it only during ``combine``."""
        stage = self.views["ystage"].view(self.dtype)
        stride = self.regions.y_row_bytes // stage.element_size()
        return stage.view(self.capacity, stride)[:, :self.hidden]

    def check(self) -> None:
        """Raise the MoE error a dispatch recorded on this rank (host memory read, no sync).
        Once failed, a Buffer stays failed."""
        if self._failure is not None:
            raise self._failure
        if self._status[0] == 0:
            return
        _, kind, src, a, b, c, epoch, _ = self.record.tolist()
        rank = self.group.rank
        if kind == _kernels.OVERFLOW:
            err: MoEError = MoEOverflowError(
                "overflow", rank, epoch,
                f"ditron moe_dispatch: rank {rank} received {b} entries for expert {a} but had room "
                f"for {c} (receive capacity {self.capacity} rows, {self.group.world_size} x "
                f"{self.max_tokens} rows per expert with expert_padded) at dispatch {epoch}; rows "
                "past the room were dropped. Raise max_recv_tokens, or check that no token names "
                "an expert twice.")
            err.expert, err.count, err.room = a, b, c
        elif kind == _kernels.BAD_IDS:
            err = MoEInputError(
                "expert_ids", src, epoch,
                f"ditron moe_dispatch: rank {src} passed topk_idx[{a // self.topk}, {a % self.topk}] "
                f"= {b}, outside [-1, {self.num_experts}) (dispatch {epoch}; such slots were treated "
                "as -1)")
        else:
            err = MoEInputError(
                "tokens", src, epoch,
                f"ditron moe_dispatch: rank {src} passed {a} tokens, more than max_tokens_per_rank "
                f"= {b} (dispatch {epoch}; that rank sent nothing)")
        self._failure = err
        try:
            raise err
        finally:
            del err  # this frame (in err's traceback) must not hold err: no cycle keeps the caller's tensors

    def close(self) -> None:
        """Collective: free the symmetric memory (every rank, after its last call)."""
        sym = self.sym
        if sym is None:
            return
        try:
            self.group.free_symmetric(sym)  # synchronizes first: no kernel still uses the scratch
        finally:
            self.drop()

    def drop(self) -> None:
        """Forget this Buffer without the collective free (not collective): what its group
        calls when it ends with the Buffer still open (``Group.drop_owned``: the launch
        returned, e.g. after a rank failed, or NVSHMEM is finalized, which frees the symmetric
        memory itself). Unregisters it and drops its plans and memory references; later calls
        raise ``ValueError`` (no open Buffer of that name)."""
        with _lock:
            _buffers.pop(self.name, None)
        self.group.disown(self.name)
        self.plans.clear()
        self.views = self.scratch = None
        self.sym = None
        self._failure = None  # its traceback holds the frames (and tensors) of the failed call
        self._held_y = None

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # a failed call: free what can be freed; the error that ended the block stays the error
            self.close()
        except DitronError as close_error:  # peers gone: note it, raise the block's own error
            exc.add_note(f"(closing {self.name} failed too: {close_error})")

    def __repr__(self) -> str:
        return (f"Buffer({self.name}, E={self.num_experts}, T_max={self.max_tokens}, H={self.hidden}, "
                f"k={self.topk}, {str(self.dtype).replace('torch.', '')}{', fp8' if self.fp8 else ''}, "
                f"capacity={self.capacity})")

    # -- helpers --------------------------------------------------------------------------------
    def _dispatch_cached(self, x, topk_weights, handle: MoEHandle) -> MoEDispatch:
        self._check_handle(handle, "dispatch")
        t = handle.dest.shape[0]
        self._check_x("dispatch", x)
        if x.shape[0] != t:
            raise ValueError(f"ditron.moe.dispatch: the handle is of {t} tokens, x has {x.shape[0]}")
        if topk_weights is not None:
            self._check_weights("dispatch", topk_weights, t)
        zero = torch.is_grad_enabled() and (x.requires_grad or (
            topk_weights is not None and topk_weights.requires_grad))
        recv_x, scales, recv_w = torch.ops.ditron.moe_dispatch_cached(
            x, topk_weights, *handle.tensors(), self.name, self.fp8, self.round_scale, zero)
        return self._result(recv_x, scales, recv_w, handle)

    def _result(self, recv_x, scales, recv_w, handle: MoEHandle) -> MoEDispatch:
        if handle.layout == "expert_padded":
            shape = (self.experts_local, self.group.world_size * self.max_tokens)
            recv_x = recv_x.view(*shape, self.hidden)
            recv_w = recv_w.view(shape)
            if self.fp8:
                scales = scales.view(*shape, self.hidden // 128)
        return MoEDispatch(recv_x, scales if self.fp8 else None, handle.counts, handle.offsets,
                           recv_w, handle)

    def _layout_shape(self, handle: MoEHandle, hidden: int) -> tuple:
        if handle.layout == "expert_padded":
            return (self.experts_local, self.group.world_size * self.max_tokens, hidden)
        return (self.rows(handle.layout, handle.expert_alignment), hidden)

    def _check_handle(self, handle, op: str) -> None:
        if not isinstance(handle, MoEHandle):
            raise TypeError(f"ditron.moe.{op}: handle must be the MoEHandle of a dispatch, got "
                            f"{type(handle).__name__}")
        if handle.buffer_name != self.name:
            raise ValueError(f"ditron.moe.{op}: the handle belongs to Buffer {handle.buffer_name!r}, "
                             f"not {self.name!r}")

    def _check_x(self, op: str, x) -> None:
        from .._validation import check_tensor

        check_tensor(f"moe.{op}", "x", x, self.group, (self.dtype,), min_dim=2)
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"ditron.moe.{op}: x must be [T, {self.hidden}], got {tuple(x.shape)}")

    def _check_weights(self, op: str, w, t: int) -> None:
        from .._validation import check_tensor

        check_tensor(f"moe.{op}", "topk_weights", w, self.group, (torch.float32,), min_dim=2)
        if tuple(w.shape) != (t, self.topk):
            raise ValueError(f"ditron.moe.{op}: topk_weights must be [{t}, {self.topk}], got "
                             f"{tuple(w.shape)}")

    def _check_inputs(self, op: str, x, topk_idx, topk_weights) -> None:
        """Typed errors before any launch; a rank-local token-count problem also launches an
        empty dispatch carrying the error, so the peers learn of it instead of waiting."""
        from .._validation import check_tensor

        self._check_x(op, x)
        check_tensor(f"moe.{op}", "topk_idx", topk_idx, self.group, _launch.INDEX_DTYPES, min_dim=2)
        if topk_idx.dim() != 2 or topk_idx.shape[1] != self.topk:
            raise ValueError(f"ditron.moe.{op}: topk_idx must be [T, {self.topk}], got "
                             f"{tuple(topk_idx.shape)}")
        if topk_weights is not None:
            check_tensor(f"moe.{op}", "topk_weights", topk_weights, self.group, (torch.float32,), min_dim=2)
            if topk_weights.dim() != 2 or topk_weights.shape[1] != self.topk:
                raise ValueError(f"ditron.moe.{op}: topk_weights must be [T, {self.topk}], got "
                                 f"{tuple(topk_weights.shape)}")
        t = x.shape[0]
        problem = None
        if t > self.max_tokens:
            problem = f"x has {t} tokens, more than max_tokens_per_rank = {self.max_tokens}"
        elif topk_idx.shape[0] != t or (topk_weights is not None and topk_weights.shape[0] != t):
            problem = (f"x, topk_idx and topk_weights disagree on the token count "
                       f"({t}, {topk_idx.shape[0]}, {None if topk_weights is None else topk_weights.shape[0]})")
        if problem is None:
            return
        if not (self.group.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._send_nothing(x.dtype, topk_idx.dtype, t)
        raise ValueError(f"ditron.moe.{op}: rank {self.group.rank}: {problem}; the peers will "
                         "raise MoEInputError at their next check")

    def _send_nothing(self, dtype, idx_dtype, claimed: int) -> None:
        """A dispatch with no tokens whose count row says ``claimed`` tokens were refused."""
        x = torch.empty(0, self.hidden, dtype=dtype, device=self.group.device)
        idx = torch.empty(0, self.topk, dtype=idx_dtype, device=self.group.device)
        self.run_dispatch(x, idx, None, "expert_contig", 1, True, self.fp8, self.round_scale, False,
                          bad=(_kernels.BAD_TOKENS, min(claimed, 2**31 - 1)))

    # -- what the ops run ---------------------------------------------------------------------
    def run_dispatch(self, x, topk_idx, topk_weights, layout: str, alignment: int, det: bool,
                     fp8: bool, round_scale: bool, zero: bool, *, handle: Optional[tuple] = None,
                     bad: tuple = (0, 0)) -> tuple:
        """One dispatch on the current stream: ``handle`` (its tensors) reuses a layout."""
        group = self.group
        group.check()
        self.check()
        if fp8 and not self.fp8:
            raise ValueError("ditron.moe.dispatch: fp8 needs a Buffer created with fp8=True")
        x = _aligned(x)
        topk_weights = _aligned(topk_weights)
        cached = handle is not None
        padded = layout == "expert_padded"
        rows = handle[0].shape[0] if cached else self.rows(layout, alignment)
        variant = self._fp8_variant if fp8 else "div"
        key = ("moe_dispatch", x.dtype, None if cached else topk_idx.dtype, fp8, round_scale,
               det and not cached, topk_weights is not None, cached, padded, alignment, variant)
        plan = self.plans.get(key, lambda: _launch.DispatchPlan(
            self, x_dtype=x.dtype, idx_dtype=None if cached else topk_idx.dtype, fp8=fp8,
            round_scale=round_scale, det=det and not cached, has_w=topk_weights is not None,
            cached=cached, padded=padded, alignment=alignment, rows=rows, variant=variant))
        dev, h = group.device, self.hidden
        alloc = torch.zeros if zero else torch.empty
        out_x = alloc((rows, h), dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=dev)
        out_s = alloc((rows, h // 128) if fp8 else (0,), dtype=torch.float32, device=dev)
        out_w = torch.zeros(rows, dtype=torch.float32, device=dev)
        t = x.shape[0]
        if cached:
            src, dest, counts, offsets, cstart = handle
        else:
            el = self.experts_local
            src = torch.full((rows,), -1, dtype=torch.int32, device=dev)
            dest = torch.empty((t, self.topk), dtype=torch.int32, device=dev)
            counts = torch.empty(el, dtype=torch.int32, device=dev)
            offsets = torch.empty(el + 1, dtype=torch.int32, device=dev)
            cstart = torch.empty(el + 1, dtype=torch.int32, device=dev)
            plan.launch_layout(_aligned(topk_idx), t * self.topk)
        plan.launch_stage(x, t)
        self.dispatch_calls += 1
        with group.waiting_launch("moe_dispatch", self.dispatch_calls):
            plan.kernel.launch(x, self.scratch.dummy if topk_weights is None else topk_weights, src,
                               dest, out_x.view(torch.uint8) if fp8 else out_x, out_s, out_w, counts,
                               offsets, cstart, t, bad[0], bad[1])
        if group.sync_check:
            group.synchronize()
            self.check()
        if cached:
            return out_x, out_s, out_w
        return out_x, out_s, out_w, counts, offsets, cstart, src, dest

    def run_combine(self, y, topk_weights, handle: tuple, out: Optional[torch.Tensor] = None):
        """One combine on the current stream (``y``: ``[rows, hidden]``)."""
        group = self.group
        group.check()
        self.check()
        src, dest, counts, offsets, cstart = handle
        hidden = y.shape[1]
        if y.dtype not in (self.dtype, torch.float32) or hidden * y.element_size() > self.regions.y_row_bytes \
                or hidden % (16 // y.element_size()):
            raise ValueError(f"ditron.moe.combine: y [rows, {hidden}] {y.dtype} does not fit this "
                             f"Buffer's staging ({self.hidden} x {self.dtype})")
        stage = self.combine_input()
        copy_y = not (y.dtype == self.dtype and hidden == self.hidden and y.data_ptr() == stage.data_ptr()
                      and y.stride() == stage.stride())
        y = _aligned(y) if copy_y else y
        topk_weights = _aligned(topk_weights)
        in_place = self.combine_in_place
        key = ("moe_combine", y.dtype, hidden, topk_weights is not None, in_place)
        plan = self.plans.get(key, lambda: _launch.CombinePlan(self, dtype=y.dtype, hidden=hidden,
                                                               has_w=topk_weights is not None,
                                                               in_place=in_place))
        t = dest.shape[0]
        if out is None:
            out = torch.empty((t, hidden), dtype=y.dtype, device=group.device)
        self.combine_calls += 1
        with group.waiting_launch("moe_combine", self.combine_calls):
            plan.kernel.launch(y, self.scratch.dummy if topk_weights is None else topk_weights, dest,
                               out, counts, offsets, cstart, t, int(copy_y),
                               hidden if copy_y else stage.stride(0))
        # peers read y in place until their kernels end: held until the next combine or the
        # drop (after the device sync), so an owner whose waits expired cannot free it under them
        self._held_y = y.detach() if in_place else None
        if group.sync_check:
            group.synchronize()
        return out


def _regions(world_size, num_experts, max_tokens, hidden, topk, dtype, fp8,
             max_recv_tokens) -> _launch.Regions:
    """Checked sizes of a Buffer (ValueError / TypeError naming the argument)."""
    for name, value in (("num_experts", num_experts), ("max_tokens_per_rank", max_tokens),
                        ("hidden", hidden), ("topk", topk)):
        _positive(name, value)
    if dtype not in _launch.DTYPES:
        raise TypeError(f"ditron.moe.Buffer: dtype must be one of {_launch.DTYPES}, got {dtype}")
    if num_experts % world_size:
        raise ValueError(f"ditron.moe.Buffer: num_experts = {num_experts} must be a multiple of the "
                         f"world size {world_size}")
    if hidden % 8 or (fp8 and hidden % 128):
        raise ValueError(f"ditron.moe.Buffer: hidden = {hidden} must be a multiple of "
                         f"{128 if fp8 else 8}{' with fp8' if fp8 else ''}")
    el = num_experts // world_size
    capacity = world_size * max_tokens * min(topk, el) if max_recv_tokens is None else \
        _positive("max_recv_tokens", max_recv_tokens)
    if world_size * capacity >= 2**31 or world_size * max_tokens * topk >= 2**31:
        raise ValueError("ditron.moe.Buffer: world_size x max_recv_tokens and world_size x "
                         "max_tokens_per_rank x topk must stay below 2^31 (int32 row ids)")
    return _launch.Regions(world_size, num_experts, max_tokens, topk, hidden, dtype, bool(fp8),
                           capacity)
