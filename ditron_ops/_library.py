"""The ``torch.ops.ditron`` library: one ``Library("ditron", "DEF")`` and small helpers.

Every op is defined with a schema (groups travel as ``str group_name``), a fake (shape-only)
implementation for torch.compile / FakeTensor, and one implementation registered for CPU and CUDA.
What the eager shortcuts (``autograd_scope``, ``direct``) save: benchmarks/NOTES.md, eager host
cost.
"""
from __future__ import annotations

from typing import Callable

import contextlib

import torch

from .runtime.tracing import tracing

lib = torch.library.Library("ditron", "DEF")
_NO_SCOPE = contextlib.nullcontext()


def define_op(schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``ditron::<schema>`` with ``impl`` for CPU and CUDA and ``fake`` for meta tensors."""
    name = schema.split("(", 1)[0]
    lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, impl, key)
    torch.library.register_fake(f"ditron::{name}", fake, lib=lib)


def autograd_scope(*tensors):
    """Around an eager call of an op with an autograd formula: below the autograd layer when no
    input needs a gradient, else nothing. Skipping the layer is what its own no-grad path does
    after two Python frames and a redispatch (about 10 µs of the H200 machine's CPU per call);
    under torch.compile the op is traced as it is."""
    if tracing():
        return _NO_SCOPE
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _NO_SCOPE
    return torch._C._AutoDispatchBelowAutograd()


def direct(*tensors) -> bool:
    """True when an eager call may run the op's implementation without the dispatcher: not
    under torch.compile, no torch-function or dispatch mode active (FakeTensor, profilers'
    modes, user modes see the op as usual), plain tensors, and no gradient to record. The
    implementation is the function the dispatcher would call; skipping the dispatch saves its
    argument boxing and the Python re-entry (about 5 µs of the H200 machine's CPU per call)."""
    if (tracing() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True
