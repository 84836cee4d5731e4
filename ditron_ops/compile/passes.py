"""The post-grad graph pass: functional collectives next to matmuls become ``torch.ops.ditron.*``.

Inductor runs it on every graph it compiles (``ditron_ops.compile.enable``), after AOTAutograd
split the program into a forward and a backward graph: each is rewritten on its own, so the
backward of a rewritten forward is rewritten too. Patterns (``c10d`` = ``_c10d_functional``)::

    wait(c10d.all_gather_into_tensor(x))            [-> split(dim 0) -> cat(dim d)]  = R
    mm(R | reshape(R, [-1, K]), B)   (or addmm)                        -> ditron.ag_gemm
    c10d.reduce_scatter_tensor(mm(A, B) [-> reshape] [-> split(dim d) -> cat(dim 0)]) -> ditron.gemm_rs
    c10d.all_reduce(mm(A, B) [-> reshape])                                            -> ditron.gemm_ar
    c10d.all_reduce(x) -> add(residual) -> rms_norm (decomposed)        -> ditron.all_reduce_rmsnorm

Decisions
---------
- A post pass (``post_grad_custom_post_pass``), where PyTorch's own micro-pipeline TP pass runs:
  after inductor's pattern passes, which may rewrite ``addmm`` and views we match on.
- Rows are our ops' layout (rank-major, gather/scatter along rows). A gather or scatter along
  another dim (sequence parallel ``[B, S, H]`` on dim 1) is the same op on rows permuted by a
  view/reshape: free when the dims before it have size 1, one copy otherwise.
- Several matmuls on one gather: one ``ag_gemm`` over concatenated weights when the weights are
  no larger than the gathered rows (``ΣN <= M``: the copy costs less than a pass over A), else one
  ``ag_gemm`` that also returns the gathered rows, which the other matmuls reuse (no second
  gather, ever).
- ``all_reduce -> add -> rms_norm`` is tried before ``mm -> all_reduce``: ``gemm_ar``'s fused path
  is off on multi-GPU groups by measurement, the norm fusion always saves a pass over the rows.
- The deterministic mode is read when the forward graph is compiled and kept on the compile's
  ``TracingContext`` for its backward (compiled later, maybe on another thread).
- Every operand is checked before the graph is touched (shapes, dtypes, devices, the sizes the
  op would reject), and a pattern whose sizes are symbolic (dynamic shapes) is left: the ops'
  size arguments are fixed here. A pattern on a group without symmetric memory is left unless
  ``allow_reference`` (its ops would run the synchronous reference path).
- The norm's fused call goes where the sum is first read; a weight computed later (Gemma's
  ``1 + w``) moves up with what it depends on, if that has no side effects.
- What is not rewritten stays as it was; the report says why.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
from math import prod
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..deterministic import is_deterministic
from .groups import GroupMappingError, ditron_group

log = logging.getLogger("ditron_ops.compile")
aten = torch.ops.aten
OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "all_reduce_rmsnorm")
_CPU_DTYPES = (torch.float16, torch.float32)
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_NORM_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_MODE_ATTR = "_ditron_compile_deterministic"


class _Left(Exception):
    """A pattern that is not rewritten; the message is the reason."""


@dataclasses.dataclass
class Entry:
    """One matched collective: ``op`` it became (or would have), and ``detail`` or the reason."""

    collective: str
    node: str
    op: str
    rewritten: bool
    detail: str


@dataclasses.dataclass
class GraphReport:
    """What the pass did to one graph (``kind``: forward, backward or inference)."""

    kind: str
    deterministic: bool
    entries: list

    def __str__(self) -> str:
        lines = [f"{self.kind} graph (deterministic={self.deterministic}):"]
        for e in self.entries:
            verb = "rewrote" if e.rewritten else "left"
            lines.append(f"  {verb:7s} {e.collective} ({e.node}) -> {e.op}: {e.detail}")
        return "\n".join(lines)


_reports: list[GraphReport] = []
"""Every report of this process, in order (``explain`` reads the ones its call added)."""


# -- graph helpers ------------------------------------------------------------------------------
def _val(node) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _c10d(name: str):
    return getattr(torch.ops._c10d_functional, name).default


def _graph_kind(graph: fx.Graph) -> str:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    return "forward" if any(n.startswith("primals") for n in names) else "inference"


def _ancestors(nodes) -> set:
    seen, todo = set(), [n for n in nodes if isinstance(n, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _fake_mode(graph: fx.Graph):
    from torch._guards import detect_fake_mode

    vals = [_val(n) for n in graph.nodes if isinstance(_val(n), torch.Tensor)]
    return detect_fake_mode(vals)


class _Builder:
    """Inserts nodes before ``anchor`` and fills their ``meta["val"]`` (fake propagation)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor
        self.mode = _fake_mode(graph)

    def __call__(self, target, *args) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        vals = fx.node.map_arg(args, _val)
        if self.mode is not None:
            with self.mode:
                node.meta["val"] = target(*vals)
        else:
            node.meta["val"] = target(*vals)
        return node


def _erase_dead(nodes) -> None:
    for node in sorted(set(nodes), key=_order_key(nodes), reverse=True):
        if node.graph is not None and not node.users and node.op == "call_function":
            node.graph.erase_node(node)


def _order_key(nodes):
    graph = next(iter(nodes)).graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order.get(n, -1)


def _check_dtype(op: str, t, group, allowed_gpu=_GPU_DTYPES) -> None:
    allowed = allowed_gpu if group.device.type == "cuda" else _CPU_DTYPES
    if t.dtype not in allowed:
        raise _Left(f"{op} takes {[str(d).split('.')[-1] for d in allowed]} on "
                    f"{group.device.type}, the graph has {str(t.dtype).split('.')[-1]}")
    if t.device.type != group.device.type or t.get_device() != group.device_index:
        raise _Left(f"tensors on {t.device} but the group's device is {group.device}")


def _static(*vals) -> None:
    """Leave the pattern when a shape it depends on is symbolic (``dynamic=True``, or a dim
    Dynamo made dynamic after a recompile): the ops' sizes (shard rows, algorithm) are fixed
    when the graph is rewritten, and a guard-free SymInt there would be wrong for other sizes."""
    for v in vals:
        if isinstance(v, torch.Tensor) and not all(type(d) is int for d in v.shape):
            raise _Left(f"symbolic (dynamic) shape {tuple(v.shape)}: the op's sizes are fixed at "
                        "compile time (compile with dynamic=False, or mark these dims static)")


_REFERENCE_HINT = ("the op would run its synchronous reference path (torch.distributed + "
                   "matmul), no faster than inductor's async collectives; "
                   "enable(allow_reference=True) rewrites anyway")


def _map(pg_name, allow_reference: bool) -> tuple:
    try:
        group, name = ditron_group(str(pg_name))
    except GroupMappingError as exc:
        raise _Left(str(exc)) from None
    if not group.has_symmetric_memory and not allow_reference:
        raise _Left(f"group {group.group_name!r} ({group.backend}) has no symmetric memory: "
                    + _REFERENCE_HINT)
    return group, name


def _permuted_rows(b: _Builder, x: fx.Node, inner_shape, w: int, dim: int, n: int,
                   to_rank_major: bool) -> fx.Node:
    """Reorder the rows of the 2-D ``x`` between "rank-major" (``[W, *inner, n]``: our ops'
    order) and "gathered along ``dim``" (``[*inner[:dim], W * inner[dim], *inner[dim+1:], n]``).
    A view when every dim before ``dim`` has size 1, one copy otherwise."""
    inner = list(inner_shape)
    if dim == 0 or prod(inner[:dim]) == 1:
        return x
    split = inner[:dim] + [w] + inner[dim:] + [n]     # gathered order, W split out
    perm = [dim] + list(range(dim)) + list(range(dim + 1, len(split)))
    if to_rank_major:
        y = b(aten.reshape.default, x, split)
        y = b(aten.permute.default, y, perm)
    else:
        y = b(aten.reshape.default, x, [w] + inner + [n])
        inverse = [perm.index(i) for i in range(len(perm))]
        y = b(aten.permute.default, y, inverse)
    return b(aten.reshape.default, y, [-1, n])


# -- the all-gather side --------------------------------------------------------------------------
def _gather_result(ag: fx.Node):
    """``(wait, R, gather_dim, nodes)`` of an all-gather: R the gathered tensor the program uses."""
    waits = [u for u in ag.users if u.target is _c10d("wait_tensor")]
    if len(waits) != 1 or len(ag.users) != 1:
        raise _Left("the all-gather's result is used before or besides its wait_tensor")
    wait = waits[0]
    w = _arg(ag, 1, "group_size")
    nodes = [ag, wait]
    users = list(wait.users)
    if len(users) == 1 and users[0].target in (aten.split.Tensor, aten.split_with_sizes.default):
        split = users[0]
        shard = _val(ag.args[0])
        if _arg(split, 2, "dim", 0) != 0:
            raise _Left("the gathered tensor is split on a dim other than 0")
        items = list(split.users)
        if len(items) != w or any(i.target is not operator.getitem for i in items):
            raise _Left("the gathered chunks are not all used as a whole")
        cats = {u for i in items for u in i.users}
        if len(cats) != 1 or any(len(i.users) != 1 for i in items):
            raise _Left("the gathered chunks are reassembled in more than one place")
        cat = cats.pop()
        if cat.target is not aten.cat.default:
            raise _Left(f"the gathered chunks go to {cat.target}, not cat")
        order = [i.args[1] for i in cat.args[0]] if len(cat.args[0]) == w else None
        if order != list(range(w)):
            raise _Left("the gathered chunks are concatenated out of rank order")
        dim = _arg(cat, 1, "dim", 0) % shard.dim()
        return wait, cat, dim, nodes + [split, *items, cat]
    return wait, wait, 0, nodes


def _consumers(r: fx.Node, k: int):
    """``(consumers, others, a2d)``: matmuls of R (``(node, B, bias)``, A = R as ``[-1, K]``),
    the other users of R, and the ``[-1, K]`` view of R they share (or R itself)."""
    if _val(r).dim() == 2:
        a2d, others = r, []
    else:
        views = [u for u in r.users if u.target in _VIEWS and _val(u) is not None
                 and _val(u).dim() == 2 and _val(u).shape[1] == k]
        if len(views) != 1:
            return [], list(r.users), r
        a2d, others = views[0], [u for u in r.users if u is not views[0]]
    cons = []
    for u in list(a2d.users):
        if u.target is aten.mm.default and u.args[0] is a2d:
            found = (u, u.args[1], None)
        elif (u.target is aten.addmm.default and u.args[1] is a2d and not u.kwargs
              and _val(u.args[0]) is not None and _val(u.args[0]).dim() == 1):
            found = (u, u.args[2], u.args[0])
        else:
            others.append(u)
            continue
        if r in _ancestors([found[1], found[2]]):  # B computed from the gathered rows
            others.append(u)
        else:
            cons.append(found)
    return cons, others, a2d


def _rewrite_all_gather(graph: fx.Graph, ag: fx.Node, mode: bool, allow_reference: bool) -> str:
    wait, r, dim, chain = _gather_result(ag)
    shard_node, w, pg = ag.args[0], _arg(ag, 1, "group_size"), _arg(ag, 2, "group_name")
    shard = _val(shard_node)
    if shard is None or shard.dim() < 2:
        raise _Left("the shard is not a matrix (ag_gemm gathers rows of [M_r, K])")
    _static(shard, _val(r))  # first: comparing symbolic sizes would add guards
    if dim == shard.dim() - 1:
        raise _Left("gathered along the last (reduction) dim: not a row gather")
    k = shard.shape[-1]
    cons, others, a2d = _consumers(r, k)
    if not cons:
        raise _Left("no matmul takes the gathered rows as its left operand")
    _static(*(_val(x) for c in cons for x in c))
    for node, b_node, bias in cons:
        bv = _val(b_node)
        if bv is None or bv.dim() != 2 or bv.dtype != shard.dtype or bv.shape[0] != k:
            raise _Left("a matmul's right operand is not a [K, N] matrix of the shard's dtype")
        if bias is not None and (_val(bias).dtype != shard.dtype
                                 or tuple(_val(bias).shape) != (bv.shape[1],)):
            raise _Left("a bias that is not [N] of the shard's dtype (broadcast or promoted)")
        if _val(node).dtype != shard.dtype:
            raise _Left("a matmul's output dtype differs from the shard's")
    group, name = _map(pg, allow_reference)
    _check_dtype("ag_gemm", shard, group)
    if w != group.world_size:
        raise _Left(f"gathers over {w} ranks but the group has {group.world_size}")
    m_r = prod(shard.shape[:-1])
    m = m_r * w
    total_n = sum(_val(b).shape[1] for _, b, _ in cons)
    concat = len(cons) > 1 and total_n <= m and len({c[2] is None for c in cons}) == 1
    keep_gathered = bool(others) or (len(cons) > 1 and not concat)
    order = _order_key(list(graph.nodes))
    first = min([c[0] for c in cons] + list(r.users) + list(a2d.users), key=order)
    # the right operands (and what they depend on) must exist before the fused node: raise them
    lift = sorted((x for x in _ancestors([x for c in cons for x in c[1:]])
                   if order(x) > order(first)), key=order)
    for node in lift:
        first.prepend(node)
    b = _Builder(graph, first)  # ``first`` is erased last: it anchors every insertion
    dead: list = []
    a = b(aten.reshape.default, shard_node, [-1, k]) if shard.dim() != 2 else shard_node
    sizes = [m_r] * w
    if concat:
        weights = b(aten.cat.default, [c[1] for c in cons], 1)
        bias = b(aten.cat.default, [c[2] for c in cons], 0) if cons[0][2] is not None else None
        fused = [(cons, weights, bias)]
    else:
        fused = [(cons[:1], cons[0][1], cons[0][2])]
    for group_cons, weights, bias in fused:
        call = b(torch.ops.ditron.ag_gemm.default, a, weights, bias, name, sizes,
                 keep_gathered, "auto")
        out = b(operator.getitem, call, 0)
        out = _permuted_rows(b, out, shard.shape[:-1], w, dim, _val(weights).shape[1], False)
        start = 0
        for node, wn, _ in group_cons:
            n = _val(wn).shape[1]
            piece = out if len(group_cons) == 1 else b(aten.slice.Tensor, out, 1, start, start + n)
            start += n
            node.replace_all_uses_with(piece)
            dead.append(node)
    if keep_gathered:
        g = b(operator.getitem, call, 1)
        g = _permuted_rows(b, g, shard.shape[:-1], w, dim, k, False)
        g = b(aten.reshape.default, g, list(_val(r).shape))
        r.replace_all_uses_with(g)
        if not concat:
            a_new = b(aten.reshape.default, g, [-1, k])
            for node, wn, bias in cons[1:]:
                new = (b(aten.mm.default, a_new, wn) if bias is None
                       else b(aten.addmm.default, bias, a_new, wn))
                node.replace_all_uses_with(new)
                dead.append(node)
    _erase_dead(dead + ([a2d] if a2d is not r else []) + chain)
    how = ("one call over concatenated weights" if concat else
           "first matmul fused, the others reuse the gathered rows" if len(cons) > 1 else "")
    detail = [f"{len(cons)} matmul(s)", f"gather dim {dim}", f"group {group.group_name!r}"]
    return ", ".join(detail + ([how] if how else []) + (["returns gathered"] if keep_gathered else []))


# -- the reducing side ----------------------------------------------------------------------------
def _producer(x: fx.Node):
    """``(terms, nodes)``: the matmuls ``[(A, B)]`` whose sum is ``x`` (a matmul, or a sum of
    matmuls as a backward adds the input grads of several consumers), each through at most one
    view, and the nodes between them and ``x`` (all used only on this path)."""
    view = None
    if x.target in _VIEWS:
        view, x = x, x.args[0]
    if x.target is aten.addmm.default:
        raise _Left("the product has a bias added before the reduction (it would be summed W times)")
    if x.target is aten.mm.default:
        if view is not None and set(x.users) != {view}:
            raise _Left(f"{x.name} is used besides the reduction (the fused op does not return it)")
        a, b, y = (_val(n) for n in (x.args[0], x.args[1], x))
        if a is None or b is None or y is None:
            raise _Left(f"{x.name} has no shape information")
        _static(a, b, y, _val(view))
        if not (a.dtype == b.dtype == y.dtype):
            raise _Left("the matmul's operands have different dtypes")
        if view is not None and (_val(view) is None or _val(view).dim() == 0
                                 or _val(view).shape[-1] != y.shape[-1]):
            raise _Left("a view between the matmul and the reduction changes its last dim (the "
                        "op's output columns)")
        return [tuple(x.args)], [x] + ([view] if view is not None else [])
    if x.target is aten.add.Tensor and not x.kwargs and view is None:
        terms, nodes = [], [x]
        y = _val(x)
        for arg in x.args:
            if not isinstance(arg, fx.Node) or set(arg.users) != {x}:
                raise _Left("a term of the summed products is used elsewhere")
            t = _val(arg)
            _static(y, t)
            if y is None or t is None or t.shape != y.shape or t.dtype != y.dtype:
                raise _Left("the summed terms differ in shape or dtype from their sum "
                            "(broadcast or type promotion)")
            sub_terms, sub_nodes = _producer(arg)
            terms += sub_terms
            nodes += sub_nodes
        return terms, nodes
    raise _Left(f"the reduced tensor comes from {x.target}, not a matmul")


def _product(b: "_Builder", terms) -> tuple:
    """``(A, B)`` of one matmul equal to the sum of ``terms``: A's concatenated along K, B's
    along K (one GEMM over the summed reduction dims)."""
    if len(terms) == 1:
        return terms[0]
    return (b(aten.cat.default, [a for a, _ in terms], 1),
            b(aten.cat.default, [bb for _, bb in terms], 0))


def _check_terms(terms) -> None:
    """The summed products (already of the sum's shape and dtype, ``_producer``) share M, N
    and one dtype; shapes static."""
    vals = [(_val(a), _val(bb)) for a, bb in terms]
    _static(*(v for pair in vals for v in pair))
    if len({(a.shape[0], bb.shape[1], a.dtype, bb.dtype) for a, bb in vals}) != 1:
        raise _Left("the summed products differ in shape or dtype")


def _single_path(nodes) -> None:
    for a, nxt in zip(nodes, nodes[1:]):
        if set(a.users) - set(nxt if isinstance(nxt, list) else [nxt]):
            raise _Left(f"{a.name} is used besides the reduction (the fused op does not return it)")


def _det_dtype_checks(op: str, a, bv, group) -> None:
    _check_dtype(op, a, group)
    if bv.dtype != a.dtype:
        raise _Left("the matmul's operands have different dtypes")


def _rewrite_reduce_scatter(graph: fx.Graph, rs: fx.Node, mode: bool, allow_reference: bool) -> str:
    x, op, w, pg = rs.args[0], _arg(rs, 1, "reduce_op"), _arg(rs, 2, "group_size"), _arg(rs, 3, "group_name")
    if str(op) != "sum":
        raise _Left(f"reduce op {op!r} (gemm_rs sums)")
    waits = [u for u in rs.users if u.target is _c10d("wait_tensor")]
    if len(waits) != 1:
        raise _Left("the reduce-scatter has no single wait_tensor")
    wait = waits[0]
    dim, chain = 0, []
    if x.target is aten.cat.default and _arg(x, 1, "dim", 0) == 0:
        items = x.args[0]
        split = items[0].args[0] if items and items[0].target is operator.getitem else None
        if (split is None or split.target is not aten.split.Tensor or len(items) != w
                or [i.args for i in items] != [(split, q) for q in range(w)]):
            raise _Left("the reduced tensor is reassembled from something other than W chunks")
        dim = _arg(split, 2, "dim", 0) % _val(split.args[0]).dim()
        chain = [x, *items, split]
        x = split.args[0]
        _single_path([split, list(items)])
        for item in items:
            _single_path([item, chain[0]])
        _single_path([chain[0], rs])
    terms, between = _producer(x)
    _single_path([x, chain[-1] if chain else rs])
    _check_terms(terms)
    a, bv, y = _val(terms[0][0]), _val(terms[0][1]), _val(x)
    _static(y, _val(wait))
    lead = list(y.shape[:-1])
    if dim == len(lead):
        raise _Left("scattered along the last (output column) dim: not a row scatter")
    if y.shape[dim] % w:
        raise _Left(f"dim {dim} ({y.shape[dim]}) does not split into {w} equal parts")
    group, name = _map(pg, allow_reference)
    _det_dtype_checks("gemm_rs", a, bv, group)
    if w != group.world_size:
        raise _Left(f"scatters over {w} ranks but the group has {group.world_size}")
    b = _Builder(graph, wait)
    a_node, b_node = _product(b, terms)
    k = _val(a_node).shape[1]
    inner = lead[:dim] + [lead[dim] // w] + lead[dim + 1:]
    a2d = _permuted_rows(b, a_node, inner, w, dim, k, True)
    rows = prod(inner)
    out = b(torch.ops.ditron.gemm_rs.default, a2d, b_node, name, [rows] * w, mode, "auto")
    out = b(aten.reshape.default, out, list(_val(wait).shape))
    wait.replace_all_uses_with(out)
    for u in list(rs.users):  # the reduce-scatter itself saved for backward
        u.replace_input_with(rs, out)
    _erase_dead([wait, rs, *chain, *between])
    return f"{len(terms)} matmul(s), scatter dim {dim}, group {group.group_name!r}, deterministic={mode}"


def _rewrite_all_reduce(graph: fx.Graph, ar: fx.Node, mode: bool, allow_reference: bool) -> str:
    x, op, pg = ar.args[0], _arg(ar, 1, "reduce_op"), _arg(ar, 2, "group_name")
    if str(op) != "sum":
        raise _Left(f"reduce op {op!r} (gemm_ar sums)")
    waits = [u for u in ar.users if u.target is _c10d("wait_tensor")]
    if len(waits) != 1:
        raise _Left("the all-reduce has no single wait_tensor")
    wait = waits[0]
    terms, between = _producer(x)
    _single_path([x, ar])
    _check_terms(terms)
    _static(_val(x), _val(wait))
    group, name = _map(pg, allow_reference)
    _det_dtype_checks("gemm_ar", _val(terms[0][0]), _val(terms[0][1]), group)
    b = _Builder(graph, wait)
    a_node, b_node = _product(b, terms)
    out = b(torch.ops.ditron.gemm_ar.default, a_node, b_node, name, mode, "auto", "auto")
    out = b(aten.reshape.default, out, list(_val(wait).shape))
    wait.replace_all_uses_with(out)
    for u in list(ar.users):
        u.replace_input_with(ar, out)
    _erase_dead([wait, ar, *between])
    return f"{len(terms)} matmul(s), group {group.group_name!r}, deterministic={mode}"


# -- all_reduce -> add -> rms_norm ------------------------------------------------------------------
def _only(node: fx.Node, target, pred: Callable = lambda u: True) -> Optional[fx.Node]:
    found = [u for u in node.users if u.target is target and pred(u)]
    return found[0] if len(found) == 1 else None


def _skip_convert(node: fx.Node) -> fx.Node:
    """The one ``convert_element_type`` among ``node``'s users (the upcast a low-precision
    RMSNorm starts with, whatever else reads ``node``: the next layer's residual), else ``node``."""
    conv = torch.ops.prims.convert_element_type.default
    ups = [u for u in node.users if u.target is conv]
    return ups[0] if len(ups) == 1 else node


def _eps_add(mean: fx.Node) -> Optional[fx.Node]:
    """``mean + eps`` (``add.Scalar``, or ``add.Tensor`` with a Python number)."""
    found = [u for u in mean.users if u.target in (aten.add.Scalar, aten.add.Tensor)
             and not u.kwargs and len(u.args) == 2 and u.args[0] is mean
             and isinstance(u.args[1], (int, float)) and not isinstance(u.args[1], bool)]
    return found[0] if len(found) == 1 and len(mean.users) == 1 else None


def _lift_before(anchor: fx.Node, inputs, forbidden) -> None:
    """Move the nodes ``inputs`` depend on that come after ``anchor`` to just before it (in
    order). Leaves the pattern when one of them depends on ``forbidden`` (the pattern's own
    nodes) or has side effects (a collective, a mutation)."""
    order = _order_key(list(anchor.graph.nodes))
    late = sorted((n for n in _ancestors(inputs) if order(n) > order(anchor)), key=order)
    if not late:
        return
    if set(forbidden) & _ancestors(late):
        raise _Left("the norm's weight or residual is computed from the sum itself")
    for n in late:
        if n.op != "call_function" or n.is_impure() or "c10d" in str(n.target):
            raise _Left(f"the norm's weight is computed after the sum by {n.target}, which cannot "
                        "be moved (side effects)")
    for n in late:
        anchor.prepend(n)


def _rewrite_all_reduce_rmsnorm(graph: fx.Graph, ar: fx.Node, mode: bool,
                                allow_reference: bool) -> str:
    if not hasattr(torch.ops.ditron, "all_reduce_rmsnorm"):
        raise _Left("torch.ops.ditron.all_reduce_rmsnorm is not registered")
    x_node, op, pg = ar.args[0], _arg(ar, 1, "reduce_op"), _arg(ar, 2, "group_name")
    waits = [u for u in ar.users if u.target is _c10d("wait_tensor")]
    if str(op) != "sum" or len(waits) != 1:
        raise _Left("not a summing all-reduce with one wait_tensor")
    wait = waits[0]
    add = _only(wait, aten.add.Tensor, lambda u: not u.kwargs)
    if add is None:
        raise _Left("the all-reduce's result is not added to a residual")
    if len(wait.users) != 1:
        raise _Left("the all-reduced sum itself is used besides the residual add (in training: "
                    "saved for backward), and all_reduce_rmsnorm does not return it")
    residual = add.args[1] if add.args[0] is wait else add.args[0]
    xv, rv, av = _val(x_node), _val(residual), _val(add)
    _static(xv, rv)
    if (not isinstance(residual, fx.Node) or rv is None or tuple(rv.shape) != tuple(xv.shape)
            or rv.dtype != xv.dtype or av is None or av.dtype != xv.dtype):
        raise _Left("the residual's shape or dtype differs from the reduced tensor's")
    is_square = lambda u: u.args[1] == 2  # noqa: E731
    rf = add if _only(add, aten.pow.Tensor_Scalar, is_square) else _skip_convert(add)
    pw = _only(rf, aten.pow.Tensor_Scalar, is_square)
    if pw is not None and rf is not add and _val(rf).dtype != torch.float32:
        raise _Left(f"the norm's statistics are in {_val(rf).dtype}, not float32 (the op's)")
    mean = pw and _only(pw, aten.mean.dim)
    eps_add = mean and _eps_add(mean)
    rsqrt = eps_add and _only(eps_add, aten.rsqrt.default)
    if rsqrt is None or list(mean.args[1]) not in ([-1], [xv.dim() - 1]) or not _arg(mean, 2, "keepdim"):
        raise _Left("the sum is not followed by an RMSNorm over the last dim")
    normed = _only(rsqrt, aten.mul.Tensor, lambda u: rf in u.args)
    if normed is None:
        raise _Left("the RMSNorm's scaling is not found")
    normed_out = _skip_convert(normed)
    scaled = [u for u in normed_out.users if u.target is aten.mul.Tensor and _val(u) is not None
              and any(_val(a) is not None and _val(a).dim() == 1 for a in u.args if a is not normed_out)]
    if len(scaled) != 1:
        raise _Left("the RMSNorm has no weight multiply")
    scaled = scaled[0]
    weight = next(a for a in scaled.args if a is not normed_out)
    out_node = _skip_convert(scaled)
    if _val(out_node).dtype != xv.dtype:
        raise _Left("the RMSNorm's output dtype differs from the reduced tensor's")
    _static(xv, _val(weight))
    h = xv.shape[-1]
    wv = _val(weight)
    if xv.dim() < 1 or h == 0 or tuple(wv.shape) != (h,):
        raise _Left(f"the norm's weight is {tuple(wv.shape)}, not [H] = [{h}] (broadcast)")
    if wv.dtype not in (xv.dtype, torch.float32):
        raise _Left(f"the norm's weight is {str(wv.dtype).split('.')[-1]}; all_reduce_rmsnorm "
                    "takes x's dtype or float32")
    eps = float(eps_add.args[1])
    if not (math.isfinite(eps) and eps >= 0):
        raise _Left(f"eps {eps!r} is not finite and >= 0")
    group, name = _map(pg, allow_reference)
    _check_dtype("all_reduce_rmsnorm", xv, group, _NORM_GPU_DTYPES)
    _check_dtype("all_reduce_rmsnorm", wv, group, (xv.dtype, torch.float32))
    # insert where the sum is first read: the weight (Gemma's ``1 + w``, computed late) and
    # what it depends on move up to there
    order = _order_key(list(graph.nodes))
    anchor = min(add.users, key=order)
    _lift_before(anchor, [x_node, residual, weight], [ar, wait, add])
    b = _Builder(graph, anchor)
    x2 = b(aten.reshape.default, x_node, [-1, h])
    r2 = b(aten.reshape.default, residual, [-1, h])
    try:
        from ..collectives.all_reduce_rmsnorm import choose_algorithm
        algorithm = choose_algorithm(prod(xv.shape) * xv.element_size(), group.world_size)
    except Exception:  # noqa: BLE001 - another engineer's module may change: a safe choice
        algorithm = "one_shot"
    call = b(torch.ops.ditron.all_reduce_rmsnorm.default, x2, r2, weight, eps, name, algorithm,
             "", mode)
    new_norm = b(aten.reshape.default, b(operator.getitem, call, 0), list(xv.shape))
    new_res = b(aten.reshape.default, b(operator.getitem, call, 1), list(xv.shape))
    out_node.replace_all_uses_with(new_norm)
    add.replace_all_uses_with(new_res)  # what else reads the residual (the norm's backward) stays
    _erase_dead([out_node, scaled, normed_out, normed, rsqrt, eps_add, mean, pw, rf, wait, ar])
    return f"group {group.group_name!r}, eps={eps}, {algorithm}, deterministic={mode}"


# -- the pass -------------------------------------------------------------------------------------
def compile_mode() -> bool:
    """The deterministic mode of the compile under way: read once per ``TracingContext`` (the
    forward's compile), so the backward, compiled later and maybe on another thread, agrees."""
    try:
        from torch._guards import TracingContext
        ctx = TracingContext.try_get()
    except Exception:  # noqa: BLE001
        ctx = None
    if ctx is None:
        return is_deterministic()
    if not hasattr(ctx, _MODE_ATTR):
        setattr(ctx, _MODE_ATTR, is_deterministic())
    return getattr(ctx, _MODE_ATTR)


def run_pass(graph: fx.Graph, ops=OPS, allow_reference: bool = False) -> GraphReport:
    """Rewrite ``graph`` in place; return (and record, and log) what was done.

    ``allow_reference``: also rewrite on groups without symmetric memory (``TorchGroup``),
    whose ops run their synchronous reference path (tests, CPU)."""
    mode = compile_mode()
    report = GraphReport(_graph_kind(graph), mode, [])
    ag_t, rs_t, ar_t = _c10d("all_gather_into_tensor"), _c10d("reduce_scatter_tensor"), _c10d("all_reduce")
    for node in list(graph.nodes):
        if getattr(node, "_erased", False) or node.op != "call_function":
            continue
        if node.target is ag_t:
            tries = [("ag_gemm", _rewrite_all_gather)]
        elif node.target is rs_t:
            tries = [("gemm_rs", _rewrite_reduce_scatter)]
        elif node.target is ar_t:
            tries = [("all_reduce_rmsnorm", _rewrite_all_reduce_rmsnorm),
                     ("gemm_ar", _rewrite_all_reduce)]
        else:
            continue
        collective, name, reasons = str(node.target).split(".")[-2], node.name, []
        for op, rewrite in tries:
            if op not in ops:
                reasons.append((op, "not enabled"))
                continue
            try:
                detail = rewrite(graph, node, mode, allow_reference)
            except _Left as left:
                reasons.append((op, str(left)))
                continue
            if reasons:
                detail += "; not " + "; not ".join(f"{o}: {r}" for o, r in reasons)
            report.entries.append(Entry(collective, name, op, True, detail))
            break
        else:
            if not (len(tries) == 2 and [r for _, r in reasons] == ["not enabled"] * 2):
                op = reasons[-1][0] if len(reasons) == 1 else "/".join(o for o, _ in reasons)
                why = "; ".join(f"{o}: {r}" if len(reasons) > 1 else r for o, r in reasons)
                report.entries.append(Entry(collective, name, op, False, why))
    graph.lint()
    if report.entries:
        _reports.append(report)
        log.info("ditron_ops.compile pass\n%s", report)
    return report
