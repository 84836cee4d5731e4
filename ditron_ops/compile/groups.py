"""Map a torch process group (as a compiled graph names it) to the ditron group that runs our ops.

A post-grad graph names the group of a functional collective by its string ``group_name``
(``torch.ops._c10d_functional.all_gather_into_tensor(x, W, "0")``). The rewrite needs the ditron
``Group`` whose ``group_name`` the ``torch.ops.ditron.*`` op will receive:

1. an ``NvshmemGroup`` bootstrapped over that process group (torchrun with nvshmem4py): the
   graph names ``nvshmem:<pg name>``, which ``init_nvshmem`` registers in every process;
2. else a ``TorchGroup`` over it: the graph names ``torch:<pg name>``, which ``resolve_group``
   turns into a ``TorchGroup`` the first time it is used in a process (a graph loaded from
   inductor's cache in a new process finds none registered: the pass did not run there);
3. a process group of PyTorch's threaded backend (``torch.testing._internal.distributed.
   multi_threaded_pg``, W ranks as threads of one process) maps to the calling thread's virtual
   group when it has the same rank and size: the op then names ``CONTEXT`` and resolves, when it
   runs, to the context group of the thread running it (one graph serves every rank).

Decisions
---------
- Cached per process-group *object* (a ``WeakKeyDictionary``): a process group destroyed and
  created again under the same name is a new key, and a cached ``TorchGroup`` is mapped again
  once an ``NvshmemGroup`` is registered over its process group (``init_nvshmem`` called later).
- nvshmem before torch: a process group with symmetric memory behind it gets the fused kernels.
- No mapping is a typed error (``GroupMappingError``); the pass catches it and leaves the pattern,
  with the error's text as the reason.
- The pass's cache key holds ``mapping_fingerprint()``: only the process state that changes what
  the mapping returns (the NVSHMEM groups, the calling thread's virtual world), never the
  ``TorchGroup``s registered so far (they are made on demand, at compile or at run time).
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

from ..errors import DitronError
from ..runtime import group as _group

_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # ProcessGroup -> Group
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


def _registered_over(pg, backend: Optional[str] = None) -> Optional[_group.Group]:
    """The registered non-virtual group over the process group object ``pg`` (nvshmem first),
    or only of ``backend``."""
    with _group._registry_lock:
        groups = list(_group._registry.values())
    found = [g for g in groups if getattr(g, "pg", None) is pg]
    for name in (backend,) if backend else ("nvshmem", "torch"):
        for g in found:
            if g.backend == name:
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


def _valid(cached: Optional[_group.Group], pg) -> bool:
    """A cached mapping still holds: registered under its name, over ``pg``, and not a
    ``TorchGroup`` where an ``NvshmemGroup`` has been registered over ``pg`` since."""
    if cached is None or _group._registry.get(cached.group_name) is not cached:
        return False
    if getattr(cached, "pg", None) is not pg:
        return False
    return cached.backend == "nvshmem" or _registered_over(pg, "nvshmem") is None


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
    pg = _process_group(pg_name)
    backend = _backend_name(pg)
    if backend == "threaded":  # per thread, never cached: each rank thread has its own group
        return _virtual_for(pg), _group.CONTEXT
    with _lock:
        cached = _cache.get(pg)
        if _valid(cached, pg):
            return cached, cached.group_name
        found = _registered_over(pg)
        if found is None:
            try:
                found = _group.torch_group_over(pg)
            except Exception as exc:  # noqa: BLE001 - re-typed with the group's name
                raise GroupMappingError(f"ditron.compile: could not wrap process group "
                                        f"{pg_name!r} ({backend}) in a TorchGroup: {exc}") from None
        _cache[pg] = found
    return found, found.group_name


def clear_cache() -> None:
    """Forget every mapping (tests)."""
    with _lock:
        _cache.clear()


def mapping_fingerprint() -> tuple:
    """What of this process decides the mapping beyond the graph itself: the registered NVSHMEM
    groups as ``(name, world size)`` and the calling thread's virtual world size (or None). Part
    of the pass's cache key; ``TorchGroup``s are not (the graph's ``torch:<pg name>`` resolves to
    one on first use in any process)."""
    with _group._registry_lock:
        nvshmem = tuple(sorted((name, g.world_size) for name, g in _group._registry.items()
                               if g.backend == "nvshmem"))
    current = _group._context.group or _group._default
    virtual = current.world_size if current is not None and current.backend == "virtual" else None
    return nvshmem, virtual


def drop_stale() -> None:
    """Unregister the ``TorchGroup``s made on demand (``runtime.group.torch_group_over``) whose
    process group is no longer the live one of their name (destroyed, maybe created again): a
    graph naming ``torch:<pg name>`` then gets a ``TorchGroup`` over the live one. Called when
    the pass computes its cache key, i.e. before inductor may load a cached graph."""
    import torch.distributed as dist

    with _group._registry_lock:
        made = [g for g in _group._registry.values() if getattr(g, "made_on_demand", False)]
    for g in made:
        live = None
        if dist.is_available() and dist.is_initialized():
            try:
                live = dist.distributed_c10d._resolve_process_group(
                    g.group_name[len(_group.TORCH_PREFIX):])
            except Exception:  # noqa: BLE001 - no live process group of that name
                live = None
        if live is None or live is not getattr(g, "pg", None):
            _group.unregister_group(g)
