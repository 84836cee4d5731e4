"""Map a torch process group (as a compiled graph names it) to the ditron group that runs our ops.

A post-grad graph names the group of a functional collective by its string ``group_name``
(``torch.ops._c10d_functional.all_gather_into_tensor(x, W, "0")``). The rewrite needs the ditron
``Group`` whose ``group_name`` the ``torch.ops.ditron.*`` op will receive:

1. an ``NvshmemGroup`` bootstrapped over that process group (torchrun with nvshmem4py);
2. else a ``TorchGroup`` over it (one is created and registered the first time);
3. a process group of PyTorch's threaded backend (``torch.testing._internal.distributed.
   multi_threaded_pg``, W ranks as threads of one process) maps to the calling thread's virtual
   group when it has the same rank and size: the op then names ``CONTEXT`` and resolves, when it
   runs, to the context group of the thread running it (one graph serves every rank).

Decisions
---------
- Cached per process-group name, once: the lookup walks the registry (cheap, but it runs for
  every collective of every compiled graph).
- nvshmem before torch: a process group with symmetric memory behind it gets the fused kernels.
- No mapping is a typed error (``GroupMappingError``); the pass catches it and leaves the pattern,
  with the error's text as the reason.
"""
from __future__ import annotations

import threading
from typing import Optional

from ..errors import DitronError
from ..runtime import group as _group

_cache: dict[str, _group.Group] = {}
_lock = threading.Lock()


class GroupMappingError(DitronError, ValueError):
    """A process group of a compiled graph has no ditron group (nor could one be made)."""


def _process_group(pg_name: str):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise GroupMappingError(f"ditron.compile: the graph names process group {pg_name!r} but "
                                "torch.distributed is not initialised in this process")
    try:
        return dist.distributed_c10d._resolve_process_group(pg_name)
    except Exception as exc:  # noqa: BLE001 - the registry's own error, re-typed
        raise GroupMappingError(f"ditron.compile: no process group named {pg_name!r} in this "
                                f"process ({type(exc).__name__}: {exc})") from None


def _backend_name(pg) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001 - a process group outside the default world's bookkeeping
        return getattr(pg, "name", lambda: "?")().lower() if hasattr(pg, "name") else "?"


def _registered_over(pg, pg_name: str) -> Optional[_group.Group]:
    """The registered non-virtual group whose process group is ``pg`` (the same object, or
    one of the same name: pybind may hand out a new wrapper), nvshmem first."""
    with _group._registry_lock:
        groups = list(_group._registry.values())
    found = [g for g in groups if getattr(g, "pg", None) is not None
             and (g.pg is pg or getattr(g.pg, "group_name", None) == pg_name)]
    for backend in ("nvshmem", "torch"):
        for g in found:
            if g.backend == backend:
                return g
    return None


def _virtual_for(pg) -> _group.Group:
    """The calling thread's virtual group standing for one rank of a threaded process group."""
    import torch.distributed as dist

    current = _group._context.group or _group._default
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    if current is None or current.backend != "virtual":
        raise GroupMappingError(
            "ditron.compile: a threaded process group maps to a virtual world only inside "
            "ditron_ops.launch(...); this thread has no virtual group")
    if (current.rank, current.world_size) != (rank, size):
        raise GroupMappingError(
            f"ditron.compile: threaded process group rank {rank} of {size} does not match this "
            f"thread's virtual group (rank {current.rank} of {current.world_size})")
    return current


def ditron_group(pg_name: str) -> tuple[_group.Group, str]:
    """The ditron group for the process group named ``pg_name``, and the name ops receive.

    Parameters
    ----------
    pg_name : str
        A functional collective's ``group_name`` argument.

    Returns
    -------
    (Group, str)
        The group, and its ``group_name`` (``CONTEXT`` for a virtual group: resolved per thread
        when the op runs).

    Raises
    ------
    GroupMappingError
        torch.distributed is not initialised, the name is unknown, or no ditron group fits.
    """
    with _lock:
        cached = _cache.get(pg_name)
    if cached is not None and _group._registry.get(cached.group_name) is cached:
        return cached, cached.group_name
    pg = _process_group(pg_name)
    backend = _backend_name(pg)
    if backend == "threaded":  # per thread, never cached: each rank thread has its own group
        return _virtual_for(pg), _group.CONTEXT
    found = _registered_over(pg, pg_name)
    if found is None:
        from ..runtime.torch_backend import TorchGroup

        try:
            found = TorchGroup(pg)
        except Exception as exc:  # noqa: BLE001 - re-typed with the group's name
            raise GroupMappingError(f"ditron.compile: could not wrap process group {pg_name!r} "
                                    f"({backend}) in a TorchGroup: {exc}") from None
    with _lock:
        _cache[pg_name] = found
    return found, found.group_name


def clear_cache() -> None:
    """Forget every mapping (tests; after a process group was destroyed)."""
    with _lock:
        _cache.clear()


def registry_fingerprint() -> tuple:
    """The registered non-virtual groups as ``(name, backend)``: part of the pass's cache key,
    so a cached compiled graph is reused only where the groups it names exist."""
    with _group._registry_lock:
        return tuple(sorted((name, g.backend) for name, g in _group._registry.items()
                            if g.backend != "virtual"))
