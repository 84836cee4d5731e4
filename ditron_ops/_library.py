"""The ``torch.ops.ditron`` library: one ``Library("ditron", "DEF")`` and small helpers.

Every op is defined with a schema (groups travel as ``str group_name``), a fake (shape-only)
implementation for torch.compile / FakeTensor, and one implementation registered for CPU and CUDA.
"""
from __future__ import annotations

from typing import Callable

import torch

lib = torch.library.Library("ditron", "DEF")


def define_op(schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``ditron::<schema>`` with ``impl`` for CPU and CUDA and ``fake`` for meta tensors."""
    name = schema.split("(", 1)[0]
    lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, impl, key)
    torch.library.register_fake(f"ditron::{name}", fake, lib=lib)
