"""``all_to_all``: split a tensor along one dim across the ranks and concatenate what arrives
along another, with no permute before or after the exchange.

Schedule (one kernel per call, see ``_all_to_all_kernels``)::

    rank r:  push part d (slice d of scatter_dim), written straight at its place in rank d's
             output layout (slot r of gather_dim) -> every rank d | wait all | copy staging -> out

The copy out of the staging buffer is one flat copy: peers can only store into symmetric memory
(one process per GPU), and the returned tensor must outlive the workspace's double buffering.
Ulysses attention uses it as ``all_to_all(x, 2, 1)`` (heads out, sequence in) and back.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import reference
from .._library import define_op
from .._validation import check_tensor, memo
from ..runtime.agreement import agree
from ..runtime.group import Group, call_group, op_id, resolve_group
from ..runtime.lazy import lazy_import
from ..runtime.plan import call_key
from ..runtime.precompile import one_rank_pad, pointer_table, register_precompile

# Triton, the kernels and their launch code: imported on first use (``runtime.lazy``)
launcher = lazy_import("..runtime.launcher", globals())
_kernels = lazy_import("._all_to_all_kernels", globals())
_launch = lazy_import("._launch", globals())

PURPOSE = "all_to_all"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GPU_BLOCKS = (16, 256)
_INTERPRETER_BLOCKS = (8, 64)
"""Copy tiles ``(rows, elements)``: 4096 elements a tile on the GPU (16 KiB of fp32), small in
the interpreter (its cost is per element of every tile)."""


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
               group: Optional[Group] = None) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into W parts, send part d to rank d, and concatenate
    the parts received along ``gather_dim`` in rank order.

    Parameters
    ----------
    x : torch.Tensor
        Any shape, fp16/bf16/fp32, the same shape on every rank; ``x.shape[scatter_dim]`` a
        multiple of the world size W.
    scatter_dim, gather_dim : int
        Dims to split and to concatenate (negative counts from the end). Equal dims give
        ``all_to_all_single``: dim 0 split in W row blocks, the blocks received stacked in rank
        order.
    group : Group, optional

    Returns
    -------
    torch.Tensor
        Contiguous; ``x``'s shape with ``scatter_dim`` divided by W and ``gather_dim``
        multiplied by W (unchanged when the dims are equal). Its part ``s`` along
        ``gather_dim`` is rank s's part ``rank`` along ``scatter_dim``.

    Constraints
    -----------
    Collective: every rank calls it in the same order with the same shape, dtype and dims
    (checked in the kernel: a disagreement raises ``DitronSizeMismatchError``). Runs on the
    current stream; does not synchronize. Differentiable: the gradient is the all-to-all with
    the dims swapped. Exact (a copy): bitwise identical run to run.

    Examples
    --------
    >>> import torch, ditron_ops
    >>> def body(group):  # [S_r = 1, H = 2]: heads scattered, the sequence gathered
    ...     x = torch.tensor([[10.0 * group.rank, 10.0 * group.rank + 1]], device=group.device)
    ...     return ditron_ops.all_to_all(x, 1, 0, group).tolist()
    >>> ditron_ops.launch(body, 2)
    [[[0.0], [10.0]], [[1.0], [11.0]]]
    """
    group, name = call_group(group)
    dims = memo(group, call_key("all_to_all", x, scatter_dim, gather_dim),
                lambda: _validate(group, x, scatter_dim, gather_dim))
    return torch.ops.ditron.all_to_all(x, name, dims[0], dims[1])


def _validate(group: Group, x, scatter_dim, gather_dim) -> tuple[int, int]:
    """The call's checks (typed errors naming the argument); the dims, made non-negative."""
    check_tensor("all_to_all", "x", x, group, DTYPES, min_dim=1)
    dims = []
    for name, dim in (("scatter_dim", scatter_dim), ("gather_dim", gather_dim)):
        if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
            raise ValueError(f"ditron.all_to_all: {name} must be an int in [{-x.dim()}, {x.dim()}) "
                             f"for x of shape {tuple(x.shape)}, got {dim!r}")
        dims.append(dim % x.dim())
    if x.shape[dims[0]] % group.world_size:
        raise ValueError(f"ditron.all_to_all: x.shape[{dims[0]}] = {x.shape[dims[0]]} must be a "
                         f"multiple of the world size {group.world_size}")
    agree(group, "all_to_all", (("dtype", x.dtype), ("x.shape", tuple(x.shape)),
                                ("(scatter_dim, gather_dim)", tuple(dims))))
    return tuple(dims)


def out_shape(shape, world_size: int, scatter_dim: int, gather_dim: int) -> list:
    """The output shape of ``all_to_all`` for an input of ``shape``."""
    shape = list(shape)
    if scatter_dim != gather_dim:
        shape[scatter_dim] //= world_size
        shape[gather_dim] *= world_size
    return shape


def _canonical(shape, w: int, rank_dims: tuple[int, int]) -> dict:
    """The kernel's view of one exchange: ``[P0, Dp, P1, Dq, P2]`` with ``p <= q`` the exchanged
    dims, the part's extents ``LP x LQ`` and the offset rules (``_all_to_all_kernels``)."""
    sc, ga = rank_dims
    p, q = min(sc, ga), max(sc, ga)
    prod = lambda dims: math.prod(shape[i] for i in dims)  # noqa: E731
    if sc == ga:  # all_to_all_single: [P0, Dp, P2], q a unit dim
        dp = shape[p]
        return dict(p0=prod(range(p)), lp=dp // w, p1=1, lq=1, p2=prod(range(p + 1, len(shape))),
                    sdp=dp, a1=dp // w, ddp=dp, a2=dp // w, sdq=1, a3=0, ddq=1, a4=0)
    dp, dq = shape[p], shape[q]
    base = dict(p0=prod(range(p)), p1=prod(range(p + 1, q)), p2=prod(range(q + 1, len(shape))),
                sdp=dp, sdq=dq)
    if sc == p:  # the outer dim splits: part d = its rows, placed after rank r's slot along q
        base.update(lp=dp // w, a1=dp // w, ddp=dp // w, a2=0, lq=dq, a3=0, ddq=dq * w, a4=dq)
    else:        # the inner dim splits: part d = a column block, placed at row block r along p
        base.update(lp=dp, a1=0, ddp=dp * w, a2=dp, lq=dq // w, a3=dq // w, ddq=dq // w, a4=0)
    return base


def _fingerprint(shape, dtype: torch.dtype, dims: tuple[int, int]) -> int:
    """A nonzero 30-bit summary of what all ranks must agree on (a 32-bit kernel argument: a
    64-bit value would select another specialization)."""
    text = f"{tuple(shape)}/{dtype}/{dims}"
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % ((1 << 30) - 35)
    return h + 1


def _impl(x: torch.Tensor, group_name: str, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    group = resolve_group(group_name)
    w = group.world_size
    if w == 1:
        return x.clone(memory_format=torch.contiguous_format)
    if not group.has_symmetric_memory:
        return reference.all_to_all(x, group, scatter_dim, gather_dim)
    out = x.new_empty(out_shape(x.shape, w, scatter_dim, gather_dim))
    if x.numel() == 0:
        return out
    x = _launch.aligned(x)
    group.check()
    key = ("all_to_all", x.dtype, tuple(x.shape), scatter_dim, gather_dim)
    plan = group.plans.get(key, lambda previous=None: _AllToAllPlan(  # (allocates nothing)
        group, x, out, scatter_dim, gather_dim))
    ws = plan.ws
    ws.calls += 1
    with group.waiting_launch("all_to_all", ws.calls):
        plan.kernel.launch(x, out)
    if group.sync_check:
        group.synchronize()
    return out


class _AllToAllPlan:
    """The bound ``all_to_all_kernel`` launch of one (dtype, shape, dims)."""

    def __init__(self, group: Group, x, out, scatter_dim: int, gather_dim: int):
        self.ws = ws = group.workspace(PURPOSE)
        elem = x.element_size()
        view = _canonical(list(x.shape), group.world_size, (scatter_dim, gather_dim))
        vec = 16 // elem if view["p2"] % (16 // elem) == 0 else 1
        self.data = data = ws.ensure_data(2 * (-(-x.numel() * elem // 256) * 256))
        half_elems = data.nbytes // 2 // 256 * 256 // elem  # fixed halves of the current buffer
        record, claim = group._error_tensors()
        rows, cols = _INTERPRETER_BLOCKS if x.device.type != "cuda" else _GPU_BLOCKS
        ints = (group.rank, group.world_size, *_view_args(view), x.numel(), half_elems,
                _fingerprint(x.shape, x.dtype, (scatter_dim, gather_dim)), group.timeout_us(),
                op_id("all_to_all"))
        if max(ints) >= 2**31:  # a 64-bit argument would compile another variant mid-call
            raise ValueError(f"ditron.all_to_all: {max(ints)} elements (2^31 or more) in one "
                             "call; exchange it in parts")
        self.kernel = launcher.BoundKernel(
            _kernels.all_to_all_kernel, (_launch.programs_per_rank(group),),
            (x, out, data.local.view(x.dtype), data.ptr_table, ws.signal_pad(), ws.signal.ptr_table,
             claim, record, *ints),
            dict(BLOCK_R=rows, BLOCK_C=cols, VEC=vec, num_warps=4),
            vary=("x_ptr", "out_ptr"), device=x.device)

    def stale(self) -> bool:
        """The workspace grew since: the halves are of a freed buffer."""
        return self.ws.data is not self.data


def _view_args(view: dict) -> tuple:
    return tuple(view[k] for k in ("p0", "lp", "p1", "lq", "p2", "sdp", "a1", "ddp", "a2", "sdq",
                                   "a3", "ddq", "a4"))


def _fake(x, group_name, scatter_dim, gather_dim):
    w = resolve_group(group_name).world_size
    return x.new_empty(out_shape(x.shape, w, scatter_dim, gather_dim))


define_op("all_to_all(Tensor x, str group_name, int scatter_dim, int gather_dim) -> Tensor",
          _impl, _fake)


def _setup(ctx, inputs, output):
    _, ctx.group_name, ctx.scatter_dim, ctx.gather_dim = inputs


def _backward(ctx, grad):
    """The inverse exchange: the dims swap roles."""
    return (torch.ops.ditron.all_to_all(grad.contiguous(), ctx.group_name, ctx.gather_dim,
                                        ctx.scatter_dim), None, None, None)


torch.library.register_autograd("ditron::all_to_all", _backward, setup_context=_setup)


def _precompile(device: torch.device, dtypes: tuple) -> None:
    """Every (dtype, VEC) variant as a one-rank launch (``runtime.precompile``)."""
    sig, sig_table, claim, record = one_rank_pad(device)
    rows, cols = _GPU_BLOCKS if device.type == "cuda" else _INTERPRETER_BLOCKS
    for dtype in (d for d in DTYPES if d in dtypes):
        for p2 in (64, 3):  # VEC on / off
            x = torch.arange(4 * p2, dtype=torch.float32, device=device).to(dtype).view(4, p2)
            out = torch.empty_like(x)
            buf = torch.zeros(4096, dtype=dtype, device=device)
            view = _canonical([4, p2], 1, (0, 0))
            vec = 16 // x.element_size() if p2 % (16 // x.element_size()) == 0 else 1
            launcher.BoundKernel(_kernels.all_to_all_kernel, (4,),
                                 (x, out, buf, pointer_table(buf), sig, sig_table, claim, record,
                                  0, 1, *_view_args(view), x.numel(), 2048, 1, 10**7, 0),
                                 dict(BLOCK_R=rows, BLOCK_C=cols, VEC=vec, num_warps=4),
                                 device=device)


register_precompile(PURPOSE, _precompile, ("all_to_all",))
