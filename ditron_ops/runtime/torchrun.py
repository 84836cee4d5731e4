"""One rank per process under ``torchrun``: device, process group and ditron group in one place.

``python -m ditron_ops`` and the multi-GPU benches use it::

    with torchrun_group() as group:   # nvshmem on GPUs when nvshmem4py is installed
        ...
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator, Optional

import torch

from .. import _env
from .group import Group, set_default_group

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""NVLink multicast stays off (the lent machines require it): set unless already set."""


def under_torchrun() -> bool:
    """True in a process that ``torchrun`` started with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def started_by_torchrun() -> bool:
    """True in a process that ``torchrun`` started (any number of ranks, one included)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def select_local_device() -> None:
    """On GPUs: make ``LOCAL_RANK``'s GPU current when a launcher set it (before any CUDA work,
    so no process also opens a context on GPU 0). No-op otherwise."""
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available() and not _env.use_interpreter():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


@contextlib.contextmanager
def torchrun_group(backend: Optional[str] = None) -> Iterator[Group]:
    """This process as one rank of the torchrun job, as a ditron ``Group``.

    Parameters
    ----------
    backend : {"nvshmem", "torch"}, optional
        Default: ``"nvshmem"`` on a GPU when nvshmem4py imports, else ``"torch"`` (NCCL on GPUs,
        gloo on CPUs). ``"torch"`` on a GPU leaves NVSHMEM to whoever else wants it (for example
        PyTorch's symmetric memory).

    Yields
    ------
    Group
        The rank's group (default group while the block runs). On exit NVSHMEM is finalized
        (collective) and the process group destroyed.
    """
    import torch.distributed as dist

    from .nvshmem_backend import finalize_nvshmem, init_nvshmem, nvshmem_available
    from .torch_backend import TorchGroup

    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    _env.prepare_cuda_for_virtual_ranks()  # eager module loading: no load while peers spin
    gpu = torch.cuda.is_available() and not _env.use_interpreter()
    select_local_device()
    if backend is None:
        backend = "nvshmem" if gpu and nvshmem_available() else "torch"
    if backend not in ("nvshmem", "torch"):
        raise ValueError(f"ditron: torchrun backend must be 'nvshmem' or 'torch', got {backend!r}")
    owns_pg = not dist.is_initialized()
    if owns_pg:
        dist.init_process_group("nccl" if gpu else "gloo")
    group = init_nvshmem() if backend == "nvshmem" else TorchGroup()
    set_default_group(group)  # one rank per process: group=None resolves to it on every thread
    try:
        yield group
    finally:
        set_default_group(None)
        if backend == "nvshmem":
            finalize_nvshmem(group)
        if owns_pg:
            dist.destroy_process_group()
            if isinstance(group, TorchGroup):
                group.release()
            gc.collect()  # the process group's last references: its threads join here
