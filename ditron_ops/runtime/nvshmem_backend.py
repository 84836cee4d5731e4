"""The nvshmem backend: one process per GPU (torchrun), NVSHMEM owned by nvshmem4py.

``init_nvshmem()`` bootstraps NVSHMEM over an initialised ``torch.distributed`` process group::

    rank 0: uid = nvshmem.core.get_unique_id()          others: get_unique_id(empty=True)
            dist.broadcast(raw bytes of uid._data)  ->  written back into uid._data
    every rank: nvshmem.core.init(device=cuda.core Device(idx), uid=uid, rank, nranks, "uid")

Symmetric buffers are ``nvshmem.core.tensor`` allocations (collective ``nvshmem_malloc``);
the pointer table holds ``get_peer_tensor(t, pe).data_ptr()`` (``nvshmem_ptr``: the
NVLink/P2P mapping of each peer's copy), so ditron kernels reach peers by plain loads, stores
and atomics. A peer that is not load/store reachable (another node) is refused with a clear
error. Frees are collective (``free_tensor``) and must all happen before ``finalize``;
``finalize_nvshmem`` does that for every buffer the group still owns.

Kernels that call the NVSHMEM device wrappers (``ditron_ops.language.nvshmem``) are launched
with ``extern_libs=nvshmem.extern_libs()``; ``init_nvshmem`` installs the hook that runs
``nvshmemx_cumodule_init`` on their modules.
"""
from __future__ import annotations

import importlib
import socket
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import DitronError
from . import nvshmem_modules
from . import group as _group_module
from .group import Group, SymmetricBuffer, register_group, set_default_group, unregister_group

__all__ = ["NvshmemGroup", "init_nvshmem", "finalize_nvshmem", "nvshmem_available"]

_owner: Optional["NvshmemGroup"] = None
_owner_lock = threading.RLock()


def nvshmem_available() -> bool:
    """True when a CUDA device is present and ``nvshmem.core`` (nvshmem4py) imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import nvshmem.core  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _import_nvshmem():
    try:
        import nvshmem.core as nvs  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        raise DitronError("ditron.init_nvshmem: nvshmem4py is not importable "
                          f"({type(exc).__name__}: {exc}); install it with "
                          "pip install 'ditron_ops[cu13]' (or [cu12]) next to the NVSHMEM wheel "
                          "your torch uses") from exc
    return nvs


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device  # noqa: PLC0415
    except ImportError:
        from cuda.core.experimental import Device  # noqa: PLC0415 - cuda.core < 0.4
    dev = Device(index)
    dev.set_current()
    return dev


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"ditron.init_nvshmem: device must be a CUDA device, got {dev}")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _broadcast_unique_id(nvs, rank: int, pg, device: torch.device):
    """Rank 0's NVSHMEM unique id on every rank (raw bytes over ``dist.broadcast``)."""
    import numpy as np  # noqa: PLC0415

    uid = nvs.get_unique_id(empty=(rank != 0))
    raw = np.ndarray.view(uid._data, np.ndarray).view(np.uint8)  # shares uid's memory
    backend = str(dist.get_backend(pg)).lower()
    on_cpu = "gloo" in backend or "mpi" in backend
    payload = torch.from_numpy(raw.copy())
    if not on_cpu:
        payload = payload.to(device)
    dist.broadcast(payload, src=dist.get_global_rank(pg, 0), group=pg)
    if rank != 0:
        raw[:] = payload.cpu().numpy()
    return uid


def _host_layout(pg, rank: int, device: torch.device) -> tuple[int, int]:
    """(local_rank, local_world_size) from every rank's hostname (collective)."""
    hosts: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(hosts, (socket.gethostname(), device.index), group=pg)
    mine = hosts[rank][0]
    same = [r for r, (host, _) in enumerate(hosts) if host == mine]
    return same.index(rank), len(same)


class NvshmemGroup(Group):
    """The NVSHMEM world of this process (create it with ``init_nvshmem``).

    Attributes
    ----------
    pg : torch.distributed.ProcessGroup
        The process group NVSHMEM was bootstrapped over; PE number == rank in ``pg``.
    libnvshmem_version : str
        Version of the loaded ``libnvshmem_host`` ("?" when nvshmem4py cannot tell).
    barrier_timeout_s : float
        Host bound of ``barrier`` (a peer that never arrives raises instead of hanging).

    Constraints
    -----------
    * ``barrier``, ``alloc_symmetric``, ``free_symmetric``, ``workspace`` growth and
      ``finalize_nvshmem`` are collective: every rank calls them, in the same order, with the
      same sizes.
    * One owner of NVSHMEM per process, used from one thread (NVSHMEM's rule).
    * Every peer must be load/store reachable (NVLink/P2P, one node); NVLink multicast (NVLS)
      is never used and must stay off.
    """

    backend = "nvshmem"
    barrier_timeout_s = 300.0

    def __init__(self, nvs, pg, rank: int, world_size: int, device: torch.device,
                 local_rank: int, local_world_size: int, timeout_s: Optional[float]):
        name = f"nvshmem:{getattr(pg, 'group_name', 'world') or 'world'}"
        super().__init__(rank, world_size, device, name, local_rank=local_rank,
                         local_world_size=local_world_size, timeout_s=timeout_s)
        self.pg = pg
        self._nvs = nvs
        self._live: list[SymmetricBuffer] = []   # allocation order
        self._finalized = False
        try:
            self.libnvshmem_version = str(nvs.get_version().libnvshmem_version)
        except Exception:  # noqa: BLE001 - diagnostics only
            self.libnvshmem_version = "?"

    def _check_live(self) -> None:
        if self._finalized:
            raise DitronError(f"ditron: group {self.group_name!r} was finalized "
                              "(finalize_nvshmem); create a new one with init_nvshmem()")

    def barrier(self) -> None:
        """Collective: ``nvshmem barrier_all`` on the current stream, then wait for it.

        NVSHMEM's own barrier is used (not ``dist.barrier``) because it also completes every
        NVSHMEM operation issued before it and orders the stream's earlier device work across
        PEs, works the same under a gloo or an NCCL process group, and is one of the few host
        collectives allowed with several PEs per GPU. Waiting for it on the host makes it a
        host barrier too; the wait is bounded by ``barrier_timeout_s``.

        Raises
        ------
        DitronError
            During CUDA-graph capture, after finalize, or when peers do not arrive in time.
        """
        self._check_live()
        stream = torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            raise DitronError(f"ditron: group {self.group_name!r}: host barrier during CUDA-graph "
                              "capture; warm the op up before capturing")
        wrap = getattr(self._nvs, "NvshmemStream", None)
        with torch.cuda.device(self.device):
            self._nvs.barrier_all(stream=wrap(stream) if wrap is not None else stream)
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + self.barrier_timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise DitronError(f"ditron: group {self.group_name!r}: rank {self.rank} waited "
                                  f"{self.barrier_timeout_s:.0f} s in the NVSHMEM barrier; a peer "
                                  "never arrived (all ranks must make the same collective calls "
                                  "in the same order)")
            time.sleep(2e-4)

    def all_gather_object(self, obj: Any) -> list:
        """Host all-gather over ``pg`` (control plane only)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _alloc_symmetric(self, nbytes: int) -> SymmetricBuffer:
        if nbytes <= 0:
            raise ValueError(f"ditron: symmetric allocation needs a positive size, got {nbytes}")
        self._check_live()
        nvs = self._nvs
        with torch.cuda.device(self.device):
            try:
                local = nvs.tensor((nbytes,), dtype=torch.uint8)
            except Exception as exc:  # noqa: BLE001
                raise DitronError(f"ditron: group {self.group_name!r}: NVSHMEM could not allocate "
                                  f"{nbytes} symmetric bytes ({exc!r}); raise "
                                  "NVSHMEM_SYMMETRIC_SIZE if the heap is full") from exc
            assert local.device == self.device, (local.device, self.device)
            buf = SymmetricBuffer(local=local, ptr_table=None, handle=local)
            self._live.append(buf)  # freed by finalize_nvshmem even if the table fails below
            local.zero_()
            addresses, peers = [], []
            for pe in range(self.world_size):
                if pe == self.rank:
                    addresses.append(local.data_ptr())
                    peers.append(local)
                    continue
                cause: Optional[BaseException] = None
                try:
                    peer = nvs.get_peer_tensor(local, pe)
                except Exception as exc:  # noqa: BLE001
                    peer, cause = None, exc
                if peer is None or peer.data_ptr() == 0:
                    raise DitronError(
                        f"ditron: group {self.group_name!r}: rank {self.rank} cannot map the "
                        f"symmetric memory of peer {pe} (nvshmem_ptr returned NULL): the GPUs are "
                        "not NVLink/P2P reachable (e.g. another node). ditron kernels load and "
                        "store to every peer directly; run the group inside one NVLink domain."
                    ) from cause
                addresses.append(peer.data_ptr())
                peers.append(peer)
            buf.peers = peers
            buf.ptr_table = torch.tensor(addresses, dtype=torch.int64, device=self.device)
        self.barrier()  # every rank zeroed its copy before any rank writes into it
        return buf

    def _free_symmetric(self, buf: SymmetricBuffer) -> None:
        tensor = buf.handle
        if tensor is None:
            return
        self._check_live()
        torch.cuda.current_stream(self.device).synchronize()
        self.barrier()  # peers may write into this rank's copy until they pass here
        self._live = [b for b in self._live if b is not buf]
        buf.local = buf.ptr_table = buf.handle = buf.peers = None
        with torch.cuda.device(self.device):
            try:
                self._nvs.free_tensor(tensor)
            except Exception as exc:  # noqa: BLE001
                raise DitronError(f"ditron: group {self.group_name!r}: NVSHMEM free failed "
                                  f"({exc!r})") from exc

    def _ensure_compatible(self, pg, device, timeout_s) -> "NvshmemGroup":
        problems = []
        if pg is not self.pg:
            problems.append("a different process group")
        if device is not None and _resolve_device(device) != self.device:
            problems.append(f"device {_resolve_device(device)} (owner: {self.device})")
        if timeout_s is not None and float(timeout_s) != self.timeout_s:
            problems.append(f"timeout_s={timeout_s} (owner: {self.timeout_s})")
        if problems:
            raise DitronError(f"ditron.init_nvshmem: NVSHMEM is already owned in this process by "
                              f"{self!r}; this call asked for {', '.join(problems)}. One owner per "
                              "process: call finalize_nvshmem() first")
        return self


def _check_pe(rank: int, world: int) -> None:
    try:
        from nvshmem import bindings  # noqa: PLC0415

        pe, npes = bindings.my_pe(), bindings.n_pes()
    except Exception:  # noqa: BLE001 - sanity check only
        return
    if (pe, npes) != (rank, world):
        raise DitronError(f"ditron.init_nvshmem: NVSHMEM reports PE {pe} of {npes}, expected "
                          f"rank {rank} of {world}")


def init_nvshmem(pg: Optional[dist.ProcessGroup] = None, device=None,
                 timeout_s: Optional[float] = None) -> NvshmemGroup:
    """Initialise NVSHMEM over a process group and return this rank's ``NvshmemGroup``.

    Parameters
    ----------
    pg : torch.distributed.ProcessGroup, optional
        Group to bootstrap over (default WORLD); NVSHMEM PE numbers are ranks in ``pg``.
        gloo (CPU) and NCCL (CUDA) groups both work.
    device : int, str or torch.device, optional
        This rank's GPU (default ``torch.cuda.current_device()``: under torchrun call
        ``torch.cuda.set_device(local_rank)`` first, or pass it). It becomes the current device.
    timeout_s : float, optional
        Bound of every device-side wait (default ``DITRON_TIMEOUT_S``, 10 s).

    Returns
    -------
    NvshmemGroup
        Registered (``resolve_group(group.group_name)``) and made the default group, after
        every rank reported success (if one failed, all finalize NVSHMEM and raise). Nothing is
        compiled here: each call's plan compiles what it launches, and a call with a new
        signature has the ranks meet before its first waiting kernel
        (``Group.meet_before_next_wait``), so no kernel spins while a peer compiles
        (``ditron_ops.precompile`` fills the cache ahead of time). A second call in the same
        process with a compatible request returns the same object.

    Raises
    ------
    ValueError
        torch.distributed is not initialised, or this process is not in ``pg``.
    DitronError
        No CUDA device, nvshmem4py missing, NVSHMEM initialised by someone else in this
        process, an incompatible second call, or NVSHMEM's init failed.

    Constraints
    -----------
    Collective over ``pg``: every rank calls it, once, before any NVSHMEM kernel. One owner of
    NVSHMEM per process (do not also use torch's NVSHMEM symmetric-memory backend). Keep NVLink
    multicast (NVLS) off. Several PEs on one GPU run in NVSHMEM's limited MPG mode without MPS
    (device RMA works; only ``barrier_all`` works among host collectives, which is all this
    backend uses).
    """
    global _owner
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ditron.init_nvshmem: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group(...) first (the NVSHMEM unique "
                         "id is broadcast over it)")
    pg = dist.group.WORLD if pg is None else pg
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if rank < 0:
        raise ValueError("ditron.init_nvshmem: this process is not a member of pg")
    with _owner_lock:
        if _owner is not None:
            return _owner._ensure_compatible(pg, device, timeout_s)
        if not torch.cuda.is_available():
            raise DitronError("ditron.init_nvshmem: needs a CUDA device; on a CPU-only machine "
                              "use ditron_ops.launch(...) (virtual ranks) or TorchGroup")
        nvs = _import_nvshmem()
        if nvshmem_modules.nvshmem_live():
            raise DitronError("ditron.init_nvshmem: NVSHMEM is already initialised in this "
                              "process by another owner; only one owner per process")
        dev = _resolve_device(device)
        torch.cuda.set_device(dev)
        local_rank, local_world = _host_layout(pg, rank, dev)
        cuda_dev = _cuda_core_device(dev.index)
        uid = _broadcast_unique_id(nvs, rank, pg, dev)
        # Dynamo's modules are imported (compiled from source on a fresh machine) before NVSHMEM
        # starts: a process that first imported them after init crashed in Python's compiler
        # (source_to_code, SIGSEGV) on an H100 and an H200; with them imported first the
        # compile-pass bench ran. ~1 s once per process.
        importlib.import_module("torch._dynamo")  # (an import statement would make torch local)
        try:
            nvs.init(device=cuda_dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        except Exception as exc:  # noqa: BLE001
            raise DitronError(f"ditron.init_nvshmem: NVSHMEM init failed on rank {rank}/{world} "
                              f"({exc!r}); NVSHMEM_DEBUG=INFO prints the cause") from exc
        failure: Optional[BaseException] = None
        try:
            group = NvshmemGroup(nvs, pg, rank, world, dev, local_rank, local_world, timeout_s)
            _check_pe(rank, world)
            nvshmem_modules.install_module_init_hook()
            nvshmem_modules.on_nvshmem_init()  # modules loaded earlier (or before a previous finalize)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers know
            failure = exc
        # every rank learns whether all set up; on any failure all finalize and raise
        oks: list[Any] = [None] * world
        dist.all_gather_object(oks, failure is None, group=pg)
        if not all(oks):
            nvshmem_modules.on_nvshmem_finalize()
            nvs.finalize()  # leave no NVSHMEM without an owner behind
            if failure is not None:
                raise failure
            failed = [q for q, ok in enumerate(oks) if not ok]
            raise DitronError(f"ditron.init_nvshmem: rank(s) {failed} failed to set up (see "
                              "their errors); NVSHMEM was finalized on every rank")
        register_group(group)
        set_default_group(group)
        _owner = group
        return group


def finalize_nvshmem(group: Optional[NvshmemGroup] = None) -> None:
    """Free every symmetric buffer of the group, finalize NVSHMEM and unregister the group.

    Releases the group's workspaces, then the buffers it still owns (newest first), each with a
    collective ``free_tensor``, then ``nvshmem.core.finalize()``. No-op when NVSHMEM is not
    owned by ditron in this process.

    Parameters
    ----------
    group : NvshmemGroup, optional
        The owner (default: the current one); another group raises ``ValueError``.

    Constraints
    -----------
    Collective: every rank calls it after its last NVSHMEM kernel, with the same buffers live.
    Re-initialising later in the same process re-inits every Triton module inited before, but
    fresh processes are the reliable way to init/finalize repeatedly.
    """
    global _owner
    with _owner_lock:
        owner = _owner
        if owner is None:
            return
        if group is not None and group is not owner:
            raise ValueError(f"ditron.finalize_nvshmem: {group!r} is not the NVSHMEM owner "
                             f"{owner!r}")
        try:
            with torch.cuda.device(owner.device):
                torch.cuda.current_stream(owner.device).synchronize()
                owner.drop_owned()  # unclosed MoE Buffers: their memory is in _live, freed below
                owner._release_workspaces()
                for buf in reversed(list(owner._live)):
                    owner._free_symmetric(buf)
                nvshmem_modules.on_nvshmem_finalize()
                owner._nvs.finalize()
        finally:
            owner._finalized = True
            unregister_group(owner)
            if _group_module._default is owner:
                set_default_group(None)
            _owner = None
