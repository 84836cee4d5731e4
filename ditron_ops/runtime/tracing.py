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
    """True inside code that torch.compile (Dynamo) or torch.export is tracing."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()
