"""Whether the calling code is being traced by torch.compile, per thread.

``torch.compiler.is_compiling()`` reads a process-wide flag that stays True for a whole compile
session (torch 2.13, ``_compile_session_context``): while one virtual rank's thread compiles,
every other rank's eager call would see True and skip what only tracing may skip (the
agreement exchange, the validation memo), and the ranks fall out of step.
``torch.compiler.is_dynamo_compiling()`` is False when run and constant True where Dynamo
traces it, so it answers for the calling thread alone; ``is_exporting`` covers torch.export.
"""
from __future__ import annotations

import torch


def tracing() -> bool:
    """True inside code that torch.compile (Dynamo or AOTAutograd, whose fake-tensor mode is
    this thread's) or torch.export is tracing. ``is_exporting`` is process-wide too: a rank
    thread exporting while its peers run eagerly is not supported."""
    return (torch.compiler.is_dynamo_compiling()
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
            or torch.compiler.is_exporting())
