"""The virtual world: W ranks as threads of one process on one device.

Each rank is a Python thread with its own CUDA stream (torch's current stream is thread-local), so
user code is the same SPMD function it would be under torchrun. Symmetric buffers are plain
allocations on the one device; the pointer table holds every rank's address. On a CPU-only
process the kernels run in the Triton interpreter, one thread per rank.

``launch(fn, world_size=4)`` runs ``fn(group)`` on every rank and returns the per-rank results.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from .. import _env
from ..errors import DitronError, DitronTimeoutError
from .group import Group, SymmetricBuffer, register_group, unregister_group, using_group
from .warmup import warmup

_world_ids = itertools.count()


def _default_device() -> torch.device:
    if not _env.use_interpreter() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class VirtualWorld:
    """Shared state of the W virtual ranks (barrier, object exchange, streams, allocations)."""

    def __init__(self, world_size: int, device: Optional[torch.device] = None,
                 timeout_s: Optional[float] = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ditron.launch: world_size must be a positive int, got {world_size!r}")
        device = _default_device() if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cpu" and not _env.use_interpreter():
            raise ValueError("ditron.launch: a CPU virtual world needs the Triton interpreter; this "
                             "process compiles for the GPU (set TRITON_INTERPRET=1 before importing "
                             "ditron_ops, or use a CUDA device)")
        if device.type == "cuda" and _env.use_interpreter():
            raise ValueError("ditron.launch: TRITON_INTERPRET=1 runs kernels on the CPU; use device='cpu'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"ditron.launch: unsupported device {device}")
        self.world_size, self.device = world_size, device
        self.name = f"virtual{next(_world_ids)}"
        timeout = _env.default_timeout_s() if timeout_s is None else float(timeout_s)
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._keep: dict[int, list[torch.Tensor]] = {}
        self.streams = ([torch.cuda.Stream(device) for _ in range(world_size)]
                        if device.type == "cuda" else [None] * world_size)
        self.groups = [VirtualGroup(self, r, timeout) for r in range(world_size)]
        for g in self.groups:
            g._error_tensors()  # pinned allocation here, not while peers' kernels spin

    def barrier(self, timeout_s: float) -> None:
        try:
            self._barrier.wait(timeout=max(timeout_s, 1.0))
        except threading.BrokenBarrierError:
            raise DitronTimeoutError("host barrier", -1, -1, -1,
                                     detail=f"virtual world {self.name}: a rank failed or did not "
                                            f"reach the host barrier within {timeout_s:.1f} s") from None

    def abort(self) -> None:
        self._barrier.abort()

    def close(self) -> None:
        """Drop every rank's memory (after all ranks' device work has finished)."""
        for g in self.groups:
            g._workspaces.clear()
        self._slots = [None] * self.world_size


class VirtualGroup(Group):
    """One rank of a ``VirtualWorld``."""

    backend = "virtual"

    def __init__(self, world: VirtualWorld, rank: int, timeout_s: float):
        super().__init__(rank, world.world_size, world.device, f"{world.name}/rank{rank}",
                         timeout_s=timeout_s)
        self.world = world

    @property
    def stream(self) -> Optional[torch.cuda.Stream]:
        return self.world.streams[self.rank]

    def barrier(self) -> None:
        self.world.barrier(self.timeout_s)

    def all_gather_object(self, obj: Any) -> list:
        self.world._slots[self.rank] = obj
        self.barrier()
        out = list(self.world._slots)
        self.barrier()
        return out

    def _alloc_symmetric(self, nbytes: int) -> SymmetricBuffer:
        local = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # zeros visible to peers' streams
        addresses = self.all_gather_object(local.data_ptr())
        table = torch.tensor(addresses, dtype=torch.int64, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return SymmetricBuffer(local=local, ptr_table=table)

    def _free_symmetric(self, buf: SymmetricBuffer) -> None:
        # Peers may still read/write this rank's memory until they pass the barrier.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.barrier()
        buf.local = buf.ptr_table = None


def _root_cause(errors: Sequence[Optional[BaseException]]) -> tuple[int, BaseException]:
    """The error to re-raise: a rank's own failure before the timeouts it caused in peers."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    for r, e in failed:
        if not isinstance(e, DitronTimeoutError):
            return r, e
    for r, e in failed:  # a kernel-recorded error before the host-barrier timeouts it caused
        if e.op != "host barrier":
            return r, e
    return failed[0]


def launch(fn: Callable[..., Any], world_size: int, device=None, *, args: tuple = (),
           timeout_s: Optional[float] = None) -> list:
    """Run ``fn(group, *args)`` on ``world_size`` virtual ranks and return the per-rank results.

    Parameters
    ----------
    fn : callable
        SPMD function; receives this rank's ``Group`` first. Inside it ``group=None`` in any op
        resolves to this group. Each rank runs in its own thread, on its own CUDA stream.
    world_size : int
        Number of virtual ranks W >= 1.
    device : torch.device or str, optional
        ``"cuda"`` (default when a GPU is present) or ``"cpu"`` (Triton interpreter).
    args : tuple
        Extra positional arguments passed to every rank.
    timeout_s : float, optional
        Bound of every device-side wait (default ``DITRON_TIMEOUT_S`` or 10 s).

    Returns
    -------
    list
        ``[fn(group_0), ..., fn(group_{W-1})]``.

    Raises
    ------
    Exception
        The failing rank's own exception (with a note naming the rank); ranks that only timed out
        waiting for it are not reported over it.
    """
    world = VirtualWorld(world_size, device, timeout_s)
    warmup(world.device)
    results: list[Any] = [None] * world_size
    errors: list[Optional[BaseException]] = [None] * world_size

    def body(rank: int) -> None:
        group = world.groups[rank]
        register_group(group)
        try:
            stream_ctx = (torch.cuda.stream(group.stream) if group.stream is not None
                          else contextlib.nullcontext())
            if world.device.type == "cuda":
                torch.cuda.set_device(world.device)
            with stream_ctx, using_group(group):
                results[rank] = fn(group, *args)
                if group._failure is None:  # an error fn already saw is not raised twice
                    group.synchronize()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
            errors[rank] = exc
            world.abort()
        finally:
            unregister_group(group)

    threads = [threading.Thread(target=body, args=(r,), name=f"ditron-{world.name}-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)  # kernels of failed ranks end by their deadline
    world.close()
    if any(e is not None for e in errors):
        rank, err = _root_cause(errors)
        if hasattr(err, "add_note"):
            err.add_note(f"(raised on virtual rank {rank} of {world_size})")
        raise err
    return results
