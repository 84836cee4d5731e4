"""Deterministic mode: ``with ditron_ops.deterministic(): ...`` or ``deterministic=True`` per call.

The mode is resolved in each public function and passed to the op as an explicit argument, so
``torch.compile`` sees it (and guards on it). A thread-local: nest-safe, restored on exceptions,
and per thread (each virtual rank has its own; asyncio tasks of one thread share it).
"""
from .mode import deterministic, is_deterministic, resolve_deterministic

__all__ = ["deterministic", "is_deterministic", "resolve_deterministic"]
