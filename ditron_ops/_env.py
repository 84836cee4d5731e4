"""The only module that reads environment variables (all of them read once, off the call path).

| variable            | default | meaning                                                              |
|---------------------|---------|----------------------------------------------------------------------|
| ``TRITON_INTERPRET``| unset   | ``1`` runs every ditron kernel in the Triton interpreter (CPU).      |
| ``DITRON_TIMEOUT_S``| ``10``  | bound of every device-side wait, seconds (``Group.timeout_s``).      |
| ``DITRON_SYNC_CHECK``| ``0``  | ``1``: every op synchronizes its stream and checks the error record (read when a group is made). |
| ``NVSHMEM_LIB_DIR`` | unset   | directory of ``libnvshmem_device.bc`` (``language.nvshmem``).        |
| ``CUDA_DEVICE_MAX_CONNECTIONS`` | (CUDA's 8) | set to 32 by ``prepare_cuda_for_virtual_ranks`` (entry points; no measured effect). |
| ``CUDA_MODULE_LOADING``| (CUDA's) | set to ``EAGER`` by ``prepare_cuda_for_virtual_ranks``.          |

Without a CUDA device the interpreter is chosen automatically, so a CPU-only machine needs no
variable at all. Experiment switches are arguments, not variables: the benches' CLI
(``--timing``, ``--only``, ``--lowp-partials``, ``--commit``), ``launch(..., gate=)``, and the
multi-GPU checks' ``--skip`` / ``--dump-after``.
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


def prepare_cuda_for_virtual_ranks() -> None:
    """Set the CUDA variables virtual ranks need, before CUDA starts (no-op afterwards or if set).

    * ``CUDA_DEVICE_MAX_CONNECTIONS=32``: more hardware queues for the ranks' streams; no
      measured effect on the H200's stalls (``VirtualGroup.waiting_launch`` fixed them), kept
      because more queues cost nothing. History: benchmarks/NOTES.md, virtual world.
    * ``CUDA_MODULE_LOADING=EAGER``: with lazy loading the first use of a kernel loads its module,
      which can wait for running kernels, i.e. for peers spinning on this rank.

    Entry points that run virtual worlds (tests, ``python -m ditron_ops``, the benches) call it,
    and so does ``torchrun_group`` (a process's lazy load can equally stall a peer's kernel
    spinning on it); notebook users should set both variables before importing torch.
    """
    import torch

    if not torch.cuda.is_initialized():
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def sync_check() -> bool:
    return _flag("DITRON_SYNC_CHECK")


def nvshmem_lib_dir() -> "str | None":
    """``NVSHMEM_LIB_DIR``: directory holding ``libnvshmem_device.bc``, or None when unset."""
    value = os.environ.get("NVSHMEM_LIB_DIR", "").strip()
    return value or None
