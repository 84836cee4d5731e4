"""The only module that reads environment variables.

| variable            | default | meaning                                                              |
|---------------------|---------|----------------------------------------------------------------------|
| ``TRITON_INTERPRET``| unset   | ``1`` runs every ditron kernel in the Triton interpreter (CPU).      |
| ``DITRON_TIMEOUT_S``| ``10``  | bound of every device-side wait, seconds (``Group.timeout_s``).      |
| ``DITRON_SYNC_CHECK``| ``0``  | ``1``: every op synchronizes its stream and checks the error record. |

Without a CUDA device the interpreter is chosen automatically, so a CPU-only machine needs no
variable at all.
"""
from __future__ import annotations

import functools
import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def use_interpreter() -> bool:
    """True when kernels run in the Triton interpreter (set once per process)."""
    if _flag("TRITON_INTERPRET"):
        return True
    import torch

    return not torch.cuda.is_available()


def default_timeout_s() -> float:
    value = os.environ.get("DITRON_TIMEOUT_S", "10")
    try:
        timeout = float(value)
    except ValueError:
        raise ValueError(f"DITRON_TIMEOUT_S must be a number of seconds, got {value!r}") from None
    if timeout <= 0:
        raise ValueError(f"DITRON_TIMEOUT_S must be positive, got {timeout}")
    return timeout


def sync_check() -> bool:
    return _flag("DITRON_SYNC_CHECK")
