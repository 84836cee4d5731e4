"""The ``deterministic()`` context manager and the per-call flag resolution."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch

_mode: contextvars.ContextVar[bool] = contextvars.ContextVar("ditron_deterministic", default=False)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Make ops called inside the block deterministic (or not, with ``enabled=False``).

    Nest-safe: the previous mode is restored on exit, also when the block raises.
    """
    token = _mode.set(bool(enabled))
    try:
        yield
    finally:
        _mode.reset(token)


def is_deterministic() -> bool:
    """The mode of the current context."""
    return _mode.get()


@torch.compiler.assume_constant_result
def _context_mode() -> bool:
    return _mode.get()


def resolve_deterministic(flag: Optional[bool]) -> bool:
    """A call's explicit flag, else the context's mode.

    Under ``torch.compile`` the context's mode is read once, when the function is traced; pass
    ``deterministic=`` explicitly in compiled code whose mode changes between calls.
    """
    if flag is None:
        return _context_mode()
    if not isinstance(flag, bool):
        raise TypeError(f"ditron: deterministic must be True, False or None, got {flag!r}")
    return flag
