"""Backward of ``ag_gemm`` and ``gemm_rs``: each is the other's (DESIGN §6).

Tensor parallel MLP, per rank r (W ranks; a row shard enters, a row shard leaves)::

    forward   h_r = ag_gemm(x_r, w1_r)         [ΣM, N_r]   (all-gather rows, column shard of w1)
              y_r = gemm_rs(h_r, w2_r)         [M_r, K]    (reduce-scatter the partial products)
    backward  dx_r  = gemm_rs(dh_r, w1_r^T)    rows of Σ_s dh_s @ w1_s^T
              dw1_r = gathered(x)^T @ dh_r
              dh_r  = ag_gemm(dy_r, w2_r^T)    all-gather dy, times this rank's w2 slice
              dw2_r = h_r^T @ gathered(dy)

Registered with ``torch.library.register_autograd`` on the ops, so eager, compiled and
``opcheck`` code share it. Backward calls are collectives too: every rank runs backward.
"""
from __future__ import annotations

import torch

from ..runtime.group import resolve_group


def _ag_setup(ctx, inputs, output):
    a, b, bias, group_name, shard_sizes, return_gathered, impl = inputs
    _, gathered = output
    ctx.group_name, ctx.shard_sizes, ctx.impl, ctx.has_bias = group_name, list(shard_sizes), impl, bias is not None
    ctx.save_for_backward(a, b, gathered if return_gathered else None)


def _ag_backward(ctx, grad_out, grad_gathered):
    # the collectives are the ops themselves, not the public wrappers: AOTAutograd traces this
    # with fake tensors, where a wrapper's validation and agreement must not run
    a, b, gathered = ctx.saved_tensors
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.ditron.gemm_rs(grad_out.contiguous(), b.t(), ctx.group_name,
                                          ctx.shard_sizes, False, ctx.impl)
    if ctx.needs_input_grad[1]:
        if gathered is None:
            gathered = torch.ops.ditron.all_gather(a, ctx.group_name, ctx.shard_sizes)
        grad_b = gathered.t() @ grad_out
    if grad_gathered is not None and grad_gathered.numel() and ctx.needs_input_grad[0]:
        # (the rank is read here: ag_gemm passes its group's own name when it returns the
        # gathered rows, so a compiled backward is traced per rank)
        start = sum(ctx.shard_sizes[:resolve_group(ctx.group_name).rank])
        grad_a = grad_a + grad_gathered[start:start + a.shape[0]]
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_out.sum(0)
    return grad_a, grad_b, grad_bias, None, None, None, None


def _rs_setup(ctx, inputs, output):
    a, b, group_name, shard_sizes, deterministic, impl = inputs
    ctx.group_name, ctx.shard_sizes, ctx.impl = group_name, list(shard_sizes), impl
    ctx.save_for_backward(a, b)


def _rs_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    grad_a = grad_b = None
    out, gathered = torch.ops.ditron.ag_gemm(grad_out.contiguous(), b.t(), None, ctx.group_name,
                                             ctx.shard_sizes, ctx.needs_input_grad[1], ctx.impl)
    if ctx.needs_input_grad[0]:
        grad_a = out
    if ctx.needs_input_grad[1]:
        grad_b = a.t() @ gathered
    return grad_a, grad_b, None, None, None, None


torch.library.register_autograd("ditron::ag_gemm", _ag_backward, setup_context=_ag_setup)
torch.library.register_autograd("ditron::gemm_rs", _rs_backward, setup_context=_rs_setup)
