"""``torch.ops.ditron.moe_dispatch`` / ``moe_dispatch_cached`` / ``moe_combine`` (+ ``_out``):
schemas, fake implementations and autograd.

The Buffer travels as its name (``Buffer.name``; op schemas cannot carry objects). Handles travel
as their five tensors ``(src_of_row, dest, counts, offsets, cstart)``; rows are flat
(``[R, H]``: ``Buffer.dispatch`` views ``expert_padded`` outputs as ``[E_local, W T_max, H]``).

Autograd (every rank runs backward: the backward calls are collectives too)::

    dispatch          grad x[t]      = sum_j grad_recv_x[row(t, j)]        a combine, unit weights
                      grad w[t, j]   = grad_recv_w[row(t, j)]              a combine of one-hot rows
    combine           grad y[row]    = w[t, j] * grad_out[t]              a cached dispatch of grad_out
                      grad w[t, j]   = <grad_out[t], y[row(t, j)]>         a combine of one-hot rows

"A combine of one-hot rows": row r of ``z [R, k8]`` holds the value at column j(r), so the
unit-weight combine returns ``out[t, j] = value[row(t, j)]`` (8-column fp32 rows, 0 for dropped
slots).
"""
from __future__ import annotations

import torch

from .._library import define_op
from .buffer import resolve_buffer

_HANDLE = "Tensor src_of_row, Tensor dest, Tensor counts, Tensor offsets, Tensor cstart"


def _dispatch_impl(x, topk_idx, topk_weights, buffer_name, layout, expert_alignment, deterministic,
                   fp8, round_scale, zero_unused):
    return resolve_buffer(buffer_name).run_dispatch(x, topk_idx, topk_weights, layout, expert_alignment,
                                                    deterministic, fp8, round_scale, zero_unused)


def _received(buf, x, rows: int, fp8: bool):
    h = buf.hidden
    return (x.new_empty((rows, h), dtype=torch.float8_e4m3fn if fp8 else x.dtype),
            x.new_empty((rows, h // 128) if fp8 else (0,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


def _dispatch_fake(x, topk_idx, topk_weights, buffer_name, layout, expert_alignment, deterministic,
                   fp8, round_scale, zero_unused):
    buf = resolve_buffer(buffer_name)
    rows = buf.rows(layout, expert_alignment)
    el = buf.experts_local
    i32 = dict(dtype=torch.int32)
    return (*_received(buf, x, rows, fp8), x.new_empty((el,), **i32), x.new_empty((el + 1,), **i32),
            x.new_empty((el + 1,), **i32), x.new_empty((rows,), **i32),
            x.new_empty(tuple(topk_idx.shape), **i32))


define_op("moe_dispatch(Tensor x, Tensor topk_idx, Tensor? topk_weights, str buffer_name, str layout, "
          "int expert_alignment, bool deterministic, bool fp8, bool round_scale, bool zero_unused) -> "
          "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _dispatch_impl, _dispatch_fake)


def _cached_impl(x, topk_weights, src_of_row, dest, counts, offsets, cstart, buffer_name, fp8,
                 round_scale, zero_unused):
    buf = resolve_buffer(buffer_name)
    handle = (src_of_row, dest, counts, offsets, cstart)
    return buf.run_dispatch(x, None, topk_weights, "", 1, False, fp8, round_scale, zero_unused,
                            handle=handle)


def _cached_fake(x, topk_weights, src_of_row, dest, counts, offsets, cstart, buffer_name, fp8,
                 round_scale, zero_unused):
    return _received(resolve_buffer(buffer_name), x, src_of_row.shape[0], fp8)


define_op(f"moe_dispatch_cached(Tensor x, Tensor? topk_weights, {_HANDLE}, str buffer_name, bool fp8, "
          "bool round_scale, bool zero_unused) -> (Tensor, Tensor, Tensor)", _cached_impl, _cached_fake)


def _combine_impl(y, topk_weights, src_of_row, dest, counts, offsets, cstart, buffer_name):
    return resolve_buffer(buffer_name).run_combine(y, topk_weights, (src_of_row, dest, counts, offsets, cstart))


def _combine_fake(y, topk_weights, src_of_row, dest, counts, offsets, cstart, buffer_name):
    return y.new_empty((dest.shape[0], y.shape[1]))


define_op(f"moe_combine(Tensor y, Tensor? topk_weights, {_HANDLE}, str buffer_name) -> Tensor",
          _combine_impl, _combine_fake)


def _combine_out_impl(y, topk_weights, src_of_row, dest, counts, offsets, cstart, buffer_name, out):
    resolve_buffer(buffer_name).run_combine(y, topk_weights, (src_of_row, dest, counts, offsets, cstart),
                                            out=out)


def _combine_out_fake(y, topk_weights, src_of_row, dest, counts, offsets, cstart, buffer_name, out):
    return None


define_op(f"moe_combine_out(Tensor y, Tensor? topk_weights, {_HANDLE}, str buffer_name, "
          "Tensor(a!) out) -> ()", _combine_out_impl, _combine_out_fake)


# ---- autograd ----------------------------------------------------------------------------------

def _per_slot(values: torch.Tensor, handle: tuple, buffer_name: str, topk: int) -> torch.Tensor:
    """``out[t, j] = values[row of (t, j)]`` (0 for dropped slots): a unit-weight combine of
    one-hot rows, ``fp32 [T, k]``."""
    src = handle[0]
    cols = (topk + 7) // 8 * 8
    slot = torch.remainder(src.clamp(min=0), topk).long()
    z = values.new_zeros((src.shape[0], cols), dtype=torch.float32)
    z.scatter_(1, slot[:, None], torch.where(src >= 0, values.float(), 0.0)[:, None])
    return torch.ops.ditron.moe_combine(z, None, *handle, buffer_name)[:, :topk]


def _to_tokens(ctx, handle: tuple, grad_rows, grad_w, need_x: bool, need_w: bool):
    """Gradients of a dispatch's inputs from those of its outputs (rows -> tokens)."""
    grad_x = grad_weights = None
    if need_x and grad_rows is not None:
        if ctx.fp8:
            raise RuntimeError("ditron moe_dispatch: an fp8 dispatch has no backward; dispatch "
                               "with a Buffer(fp8=False) to train through it")
        grad_x = torch.ops.ditron.moe_combine(grad_rows.contiguous(), None, *handle, ctx.name)
    if need_w and grad_w is not None:
        grad_weights = _per_slot(grad_w, handle, ctx.name, ctx.topk)
    return grad_x, grad_weights


def _dispatch_setup(ctx, inputs, output):
    x, topk_idx, _, name, _, _, _, fp8, _, _ = inputs
    ctx.name, ctx.fp8, ctx.topk = name, fp8, topk_idx.shape[1]
    ctx.save_for_backward(*output[6:8], *output[3:6])  # src_of_row, dest, counts, offsets, cstart
    ctx.mark_non_differentiable(*output[1:2], *output[3:])


def _dispatch_backward(ctx, grad_x, grad_s, grad_w, *_):
    src, dest, counts, offsets, cstart = ctx.saved_tensors
    gx, gw = _to_tokens(ctx, (src, dest, counts, offsets, cstart), grad_x, grad_w,
                        ctx.needs_input_grad[0], ctx.needs_input_grad[2])
    return gx, None, gw, None, None, None, None, None, None, None


def _cached_setup(ctx, inputs, output):
    x, _, src, dest, counts, offsets, cstart, name, fp8, _, _ = inputs
    ctx.name, ctx.fp8, ctx.topk = name, fp8, dest.shape[1]
    ctx.save_for_backward(src, dest, counts, offsets, cstart)
    ctx.mark_non_differentiable(output[1])


def _cached_backward(ctx, grad_x, grad_s, grad_w):
    handle = ctx.saved_tensors
    gx, gw = _to_tokens(ctx, handle, grad_x, grad_w, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    return (gx, gw) + (None,) * 9


def _is_staging(buffer_name: str, y: torch.Tensor) -> bool:
    try:
        return y.data_ptr() == resolve_buffer(buffer_name).combine_input().data_ptr()
    except Exception:  # noqa: BLE001 - fake and functional tensors have no address
        return False


def _combine_setup(ctx, inputs, output):
    y, w, src, dest, counts, offsets, cstart, name = inputs
    ctx.name, ctx.has_w = name, w is not None
    keep_y = ctx.needs_input_grad[1]
    if keep_y and _is_staging(name, y):
        y = y.clone()  # the staging is rewritten by later combines' callers
    ctx.save_for_backward(y if keep_y else None, w, src, dest, counts, offsets, cstart)


def _combine_backward(ctx, grad_out):
    y, w, src, dest, counts, offsets, cstart = ctx.saved_tensors
    handle = (src, dest, counts, offsets, cstart)
    grad_y = grad_w = None
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return (None,) * 8
    rows, _, row_w = torch.ops.ditron.moe_dispatch_cached(grad_out.contiguous(), w, *handle, ctx.name,
                                                          False, False, True)
    if ctx.needs_input_grad[0]:
        grad_y = (rows.float() * row_w[:, None]).to(rows.dtype) if ctx.has_w else rows
    if ctx.needs_input_grad[1]:
        grad_w = _per_slot((rows.float() * y.float()).sum(1), handle, ctx.name, dest.shape[1])
    return grad_y, grad_w, None, None, None, None, None, None


torch.library.register_autograd("ditron::moe_dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("ditron::moe_dispatch_cached", _cached_backward, setup_context=_cached_setup)
torch.library.register_autograd("ditron::moe_combine", _combine_backward, setup_context=_combine_setup)
