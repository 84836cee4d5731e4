"""The ``deterministic()`` context manager and the per-call flag resolution."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional


class _Mode(threading.local):
    """This thread's mode. A ``threading.local``, not a ``ContextVar``: torch.compile traces a
    read of it and guards on the value, so a compiled function recompiles when the mode it was
    traced under changes (it refuses ``ContextVar.get``). The default is set per thread in
    ``__init__``, not as a class attribute, which torch 2.11's Dynamo would read statically."""

    def __init__(self):
        self.enabled = False


_mode = _Mode()


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Make ops called inside the block deterministic (or not, with ``enabled=False``).

    Nest-safe: the previous mode is restored on exit, also when the block raises.
    """
    previous, _mode.enabled = _mode.enabled, bool(enabled)
    try:
        yield
    finally:
        _mode.enabled = previous


def is_deterministic() -> bool:
    """The mode of the calling thread."""
    return _mode.enabled


def resolve_deterministic(flag: Optional[bool]) -> bool:
    """A call's explicit flag, else the context's mode.

    Under ``torch.compile`` the mode is read when the function is traced, and the compiled
    function is guarded on it: calling it under the other mode traces it again.
    """
    if flag is None:
        return _mode.enabled
    if not isinstance(flag, bool):
        raise TypeError(f"ditron: deterministic must be True, False or None, got {flag!r}")
    return flag
