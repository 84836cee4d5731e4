"""``Group``: what every op receives (rank, world size, device, symmetric memory, error record).

Backends subclass it (``virtual``, ``nvshmem``, ``torch``). Op schemas cannot carry Python
objects, so a group travels through ``torch.ops.ditron.*`` as its ``group_name`` and is resolved
with ``resolve_group`` (the same idea as PyTorch's ProcessGroup names).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Optional

import torch

from .. import _env
from ..errors import DitronError, DitronInputError, DitronSizeMismatchError, DitronTimeoutError
from .plan import PlanCache
from .tracing import tracing
from .error_record import (ERR_EPOCH, ERR_KIND, ERR_OP, ERR_PEER, ERR_RANK, ERR_STATUS, ERR_WORDS,
                           KIND_BAD_INPUT, KIND_SIZE_MISMATCH)

_registry: dict[str, "Group"] = {}
_registry_lock = threading.Lock()


class _Context(threading.local):
    """This thread's current group (``using_group``). A ``threading.local``, not a
    ``ContextVar``: torch.compile traces reads of it and guards on what it read, per thread,
    where it refuses ``ContextVar.get``. The default is set per thread in ``__init__`` (which
    ``threading.local`` runs in each thread), not as a class attribute: torch 2.11's Dynamo
    reads a class attribute statically and would see None on every thread."""

    def __init__(self):
        self.group: Optional["Group"] = None


_context = _Context()
_default: Optional["Group"] = None
CONTEXT = ""
"""The ``group_name`` an op gets under torch.compile when the caller passed ``group=None``: the
op resolves it when it runs, to the context group of the thread running it (``resolve_group``),
so one compiled graph serves every rank and every launch."""

NULL_CONTEXT = contextlib.nullcontext()
"""What ``waiting_launch`` returns where there is nothing to do (made once: no per-call object)."""

_op_names: list[str] = ["<none>"]
_BAD_INPUTS = {"flash_decode": "kv_lens", "flash_decode_paged": "block_table.flatten()"}
"""The argument a kernel checks the values of, per op (error records name the op, not it)."""
_op_lock = threading.Lock()


def op_id(name: str) -> int:
    """Small integer naming an op inside error records (process-local)."""
    with _op_lock:
        if name not in _op_names:
            _op_names.append(name)
        return _op_names.index(name)


@dataclasses.dataclass
class SymmetricBuffer:
    """One symmetric allocation: this rank's bytes plus every rank's base address.

    Attributes
    ----------
    local : torch.Tensor
        ``uint8 [nbytes]`` on the group's device, this rank's copy.
    ptr_table : torch.Tensor
        ``int64 [world_size]`` on the group's device: base address of each rank's copy, usable
        from kernels of this rank (peer-mapped addresses on multi-GPU).
    handle : Any
        Backend bookkeeping for the collective free.
    peers : list of torch.Tensor, optional
        ``uint8 [nbytes]`` views of every rank's copy that this rank's streams can ``copy_``
        into (copy-engine transfers); None where the backend has none.
    """

    local: torch.Tensor
    ptr_table: torch.Tensor
    handle: Any = None
    peers: Optional[list] = None

    @property
    def nbytes(self) -> int:
        return self.local.numel()


class Group:
    """A set of ranks that run ops together.

    Attributes
    ----------
    rank, world_size : int
    local_rank, local_world_size : int
        Position inside this host (equal to rank/world_size on one host).
    device : torch.device
    group_name : str
        Stable name resolvable with ``resolve_group`` (unique per rank in a virtual world).
    backend : str
        ``"virtual"``, ``"nvshmem"`` or ``"torch"``.
    timeout_s : float
        Bound of every device-side wait (default ``DITRON_TIMEOUT_S``, 10 s).
    """

    backend = "abstract"

    def __init__(self, rank: int, world_size: int, device: torch.device, group_name: str,
                 *, local_rank: Optional[int] = None, local_world_size: Optional[int] = None,
                 timeout_s: Optional[float] = None):
        self.rank, self.world_size = rank, world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.local_world_size = world_size if local_world_size is None else local_world_size
        self.device = torch.device(device)
        # what Tensor.get_device() returns for a tensor on it (-1: CPU)
        self.device_index = (self.device.index if self.device.index is not None
                             else torch.cuda.current_device()) if self.device.type == "cuda" else -1
        self.group_name = group_name
        self._timeout_s = float(timeout_s) if timeout_s is not None else _env.default_timeout_s()
        self._workspaces: dict[str, Any] = {}
        # objects that hold this group's memory outside its workspaces (MoE Buffers), by name:
        # dropped with the group (``drop_owned``), so one never closed cannot outlive it
        self._owned: dict[str, Any] = {}
        self.plans = PlanCache(self)
        self._validated: dict = {}  # call keys whose arguments passed the checks (``_validation.memo``)
        self._agreed: set = set()  # signatures all ranks agreed on (``agreement.agree``)
        self.sync_check = _env.sync_check()  # read once: no environment read on the call path
        self._failure: Optional[BaseException] = None
        self._error_record: Optional[torch.Tensor] = None
        self._error_status = None  # numpy view of the record (a host read costs no torch op)
        self._error_claim: Optional[torch.Tensor] = None
        self._side: Optional[tuple] = None

    # -- host control plane (implemented by backends) ----------------------------------------
    def barrier(self) -> None:
        """Host barrier over all ranks (does not order device work)."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> list:
        """Host all-gather of a small picklable object (control plane only)."""
        raise NotImplementedError

    def _alloc_symmetric(self, nbytes: int) -> SymmetricBuffer:
        raise DitronError(f"group {self.group_name!r} ({self.backend}) has no symmetric memory")

    def _free_symmetric(self, buf: SymmetricBuffer) -> None:
        raise NotImplementedError

    # -- symmetric memory ----------------------------------------------------------------------
    @property
    def has_symmetric_memory(self) -> bool:
        return type(self)._alloc_symmetric is not Group._alloc_symmetric

    def alloc_symmetric(self, nbytes: int) -> SymmetricBuffer:
        """Collective: allocate ``nbytes`` zeroed bytes on every rank and exchange base addresses.

        Raises ``DitronError`` during CUDA-graph capture (allocate by warming up first).
        """
        self.refuse_during_capture(f"needs {nbytes} bytes of new symmetric memory")
        return self._alloc_symmetric(int(nbytes))

    def refuse_during_capture(self, what: str) -> None:
        """Raise ``DitronError`` if this rank's stream is capturing a CUDA graph: ``what`` is
        one-time set-up (an allocation, an upload) that a replay could not repeat."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise DitronError(
                f"ditron: group {self.group_name!r} {what} during CUDA-graph capture; run the op "
                "once with the same (or larger) sizes before capturing so it is set up.")

    @property
    def ranks_per_device(self) -> int:
        """Ranks of this group sharing this rank's device (W in a virtual world, else 1)."""
        return 1

    @property
    def shared_address_space(self) -> bool:
        """Whether every rank's kernels can read any tensor of every rank at the address its
        owner sees (one process, one device: the virtual world). Elsewhere peers reach only
        symmetric memory."""
        return False

    def sm_share(self) -> int:
        """This rank's share of its GPU's SMs: kernels that wait on peers size their grids to
        it, so every rank's waiting programs are resident together."""
        return max(1, sm_count(self.device) // self.ranks_per_device)

    def free_symmetric(self, buf: SymmetricBuffer) -> None:
        """Collective free (every rank, same order)."""
        self._free_symmetric(buf)

    def workspace(self, purpose: str):
        """The long-lived workspace of this group for ``purpose`` (created on first use)."""
        from .workspace import Workspace

        ws = self._workspaces.get(purpose)
        if ws is None:
            ws = self._workspaces[purpose] = Workspace(self, purpose)
        return ws

    # -- errors ----------------------------------------------------------------------------------
    def _error_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(host-readable int64 record, device int64 claim word) that kernels write on timeout."""
        if self._error_record is None:
            pin = self.device.type == "cuda"
            self._error_record = torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=pin)
            self._error_status = self._error_record.numpy()
            self._error_claim = torch.zeros(1, dtype=torch.int64, device=self.device)
        return self._error_record, self._error_claim

    def check(self) -> None:
        """Raise ``DitronTimeoutError`` if a kernel of this rank recorded an expired wait.

        Reads host memory only (no device synchronization). Once failed, a group stays failed.
        """
        if self._failure is not None:
            raise self._failure
        status = self._error_status
        if status is None or status[ERR_STATUS] == 0:
            return
        values = self._error_record.tolist()
        name = _op_names[values[ERR_OP]] if 0 <= values[ERR_OP] < len(_op_names) else "?"
        if values[ERR_KIND] == KIND_BAD_INPUT:
            err: DitronError = DitronInputError(
                name, _BAD_INPUTS.get(name, "an argument"), values[ERR_RANK], values[ERR_PEER],
                values[ERR_EPOCH], "it is outside the range the op accepts (the kernel clamped it)")
        elif values[ERR_KIND] == KIND_SIZE_MISMATCH:
            err = DitronSizeMismatchError(
                name, values[ERR_RANK], values[ERR_PEER], values[ERR_EPOCH],
                detail=f"rank {values[ERR_PEER]} sent a different number of elements than this "
                       "rank expected (sizes must agree on every rank)")
        else:
            err = DitronTimeoutError(name, values[ERR_RANK], values[ERR_PEER], values[ERR_EPOCH])
        self._failure = err
        try:
            raise err
        finally:
            del err  # this frame (in err's traceback) must not hold err: no cycle keeps the caller's tensors

    def waiting_launch(self, op: str = "?", epoch: int = -1):
        """Context manager around the launch of a kernel that waits on peers.

        A no-op except in a GPU virtual world, where it keeps the ranks' launches together (see
        ``VirtualGroup.waiting_launch``).
        """
        return NULL_CONTEXT

    def meet_before_next_wait(self) -> None:
        """Every rank calls this together when a call has a new signature (``agreement.agree``):
        the next ``waiting_launch`` first meets the peers (``barrier``), once.

        Why: the call's plans compile its kernels (``plan.PlanCache``); one process may finish
        compiling long before a peer, and its waiting kernel would then spin for the peer's
        compile time (more than the wait bound when the Triton cache is cold). A new signature
        is rank-uniform where plan keys are not (strides, rows), so every rank meets at the
        same call. The meeting replaces ``waiting_launch`` on this object until it ran, so a
        repeated call checks nothing new.
        """
        self.waiting_launch = self._meet_then_launch

    def _meet_then_launch(self, op: str = "?", epoch: int = -1):
        del self.waiting_launch  # the class's again: later calls meet nothing
        if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.barrier()  # (capturing: no plan was built, so nothing compiled; every rank skips)
        return self.waiting_launch(op, epoch)

    def launch_step(self, op: str = "?", epoch: int = -1) -> None:
        """Inside ``waiting_launch``: a no-op except in a GPU virtual world, where every rank's
        launches so far are queued before any rank goes on (``VirtualGroup.launch_step``)."""

    def side_stream(self) -> tuple:
        """``(stream, fork event, join event)`` of this rank as raw handles (``cuda_driver``),
        made once: the fused ops' copy-engine work runs on the side stream between a fork and
        a join. The torch objects that own them live as long as the group."""
        if self._side is None:
            stream = torch.cuda.Stream(self.device)
            events = (torch.cuda.Event(), torch.cuda.Event())
            for event in events:
                event.record(stream)  # created now (torch makes events on first record)
            stream.synchronize()
            self._side_owners = (stream, events)
            self._side = (stream.cuda_stream, events[0].cuda_event, events[1].cuda_event)
        return self._side

    def synchronize(self) -> None:
        """Wait for this rank's current stream, then ``check``."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.check()

    @property
    def timeout_s(self) -> float:
        """Bound of every device-side wait, seconds."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        """A new bound applies from the next call: plans bind the bound into their kernels'
        arguments, so every ``PlanCache`` of the group rebuilds its plans when it changed."""
        value = float(value)
        if not 0 < value < float("inf"):
            raise ValueError(f"ditron: Group.timeout_s must be a positive finite number of seconds, "
                             f"got {value!r}")
        if value != self._timeout_s and self.device.type == "cuda" \
                and torch.cuda.is_current_stream_capturing():
            raise DitronError("ditron: Group.timeout_s changed during CUDA-graph capture; set it "
                              "before capturing (a graph replays the bound it captured)")
        self._timeout_s = value

    def timeout_us(self) -> int:
        """The wait bound in µs, passed to kernels as a 32-bit int (a value that needed 64 bits
        would select another kernel specialization, i.e. a compile while peers wait)."""
        return max(1, min(int(self.timeout_s * 1e6), 2**31 - 1))

    # -- lifetime --------------------------------------------------------------------------------
    def own(self, name: str, resource: Any) -> None:
        """Register ``resource`` (it has a ``drop()`` method) as living no longer than this
        group: ``drop_owned`` drops it when the group ends (a virtual world's launch returned,
        or NVSHMEM is finalized). Its ``close`` calls ``disown``."""
        self._owned[name] = resource

    def disown(self, name: str) -> None:
        self._owned.pop(name, None)

    def drop_owned(self) -> None:
        """Drop every resource still owned: not collective (the group's device work has
        ended): a resource a failed rank never closed would otherwise stay in its process-wide
        registry, with its device memory, for the life of the process. The first error of a
        drop is raised after every resource was dropped."""
        owned, self._owned = list(self._owned.values()), {}
        first = None
        for resource in owned:
            try:
                resource.drop()
            except Exception as exc:  # noqa: BLE001 - the others are dropped too, then raised
                first = first or exc
        if first is not None:
            raise first

    def _release_workspaces(self) -> None:
        self.plans.clear()  # plans view the workspaces
        for ws in list(self._workspaces.values()):
            ws.release()
        self._workspaces.clear()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device}, name={self.group_name!r})")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    device = torch.device(device)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def register_group(group: Group) -> None:
    with _registry_lock:
        if group.group_name in _registry and _registry[group.group_name] is not group:
            raise ValueError(f"ditron: a different group is already registered as {group.group_name!r}")
        _registry[group.group_name] = group


def unregister_group(group: Group) -> None:
    with _registry_lock:
        if _registry.get(group.group_name) is group:
            del _registry[group.group_name]


def resolve_group(group_name: str) -> Group:
    """The ``Group`` registered under ``group_name`` (what op implementations call);
    ``CONTEXT`` names this thread's context group; ``torch:<pg name>``, when none is registered
    under it, the ``TorchGroup`` over that process group, made now (``torch_group_over``)."""
    if group_name == CONTEXT:
        return current_group(None)
    try:
        return _registry[group_name]
    except KeyError:
        pass
    found = _torch_group_on_demand(group_name)
    if found is None:
        raise ValueError(
            f"ditron: no group named {group_name!r} in this process; create one with "
            "ditron_ops.launch(...) (virtual ranks), ditron_ops.init_nvshmem(...) or "
            "ditron_ops.TorchGroup(...)")
    return found


TORCH_PREFIX = "torch:"
"""``TorchGroup`` names are ``torch:<process group name>``."""
_on_demand_lock = threading.Lock()


def torch_group_over(pg) -> Group:
    """The ``TorchGroup`` registered over the process group ``pg``, made and registered if
    there is none. One registered under the same name over another process group (destroyed,
    then created again under its name) is replaced."""
    from .torch_backend import TorchGroup

    name = TORCH_PREFIX + (getattr(pg, "group_name", "") or "world")
    with _on_demand_lock:
        found = _registry.get(name)
        if found is not None and getattr(found, "pg", None) is pg:
            return found
        if found is not None:
            unregister_group(found)
        made = TorchGroup(pg)
        made.made_on_demand = True
        return made


def _torch_group_on_demand(group_name: str) -> Optional[Group]:
    """``torch:<pg name>`` is what ``ditron_ops.compile`` writes into graphs for a process group
    without symmetric memory: a graph loaded from inductor's cache runs in a process where the
    pass never ran, so its ``TorchGroup`` is made on first use. None when no live process group
    has that name."""
    if not group_name.startswith(TORCH_PREFIX):
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg_name = group_name[len(TORCH_PREFIX):]
    try:
        pg = (dist.group.WORLD if pg_name == "world"
              else dist.distributed_c10d._resolve_process_group(pg_name))
    except Exception:  # noqa: BLE001 - no such process group: the caller's error says so
        return None
    return torch_group_over(pg) if pg is not None else None


def set_default_group(group: Optional[Group]) -> None:
    """The group used when an op gets ``group=None`` outside ``launch`` (e.g. under torchrun)."""
    global _default
    _default = group


@contextlib.contextmanager
def using_group(group: Group):
    """Make ``group`` the current group of this thread (``group=None`` resolves to it)."""
    previous, _context.group = _context.group, group
    try:
        yield group
    finally:
        _context.group = previous


def current_group(group: Optional[Group] = None) -> Group:
    """Resolve an op's ``group`` argument: explicit, else the thread's context group, else the
    default."""
    if group is not None:
        if not isinstance(group, Group):
            raise TypeError(f"ditron: group must be a ditron_ops Group, got {type(group).__name__}")
        return group
    found = _context.group or _default
    if found is None:
        raise ValueError("ditron: no group given and none is current; pass group=, run inside "
                         "ditron_ops.launch(...), or call ditron_ops.init_nvshmem()/set_default_group()")
    return found


def call_group(given: Optional[Group]) -> tuple[Group, str]:
    """A public op's ``(group, group_name)`` for its ``group`` argument ``given``: the resolved
    group, and the name its ``torch.ops.ditron`` op receives. That name is ``CONTEXT`` under
    torch.compile when ``given`` is None in a virtual world: a graph traced on one rank must not
    name that rank's group, since every rank and every later launch runs it. Elsewhere a process
    is one rank, and its compiled backward may run on autograd's device thread, where no
    context group is set: the graph names the group."""
    group = current_group(given)
    if given is None and tracing() and group.backend == "virtual":
        return group, CONTEXT  # (a process of its own per rank elsewhere: its name is stable)
    return group, group.group_name


def name_for_rows(name: str, group: Group, rows) -> str:
    """The op's ``group_name`` when its output has ``rows[rank]`` rows: a ``CONTEXT`` graph of
    uneven ``rows`` would give every rank the tracing rank's shape, so the group's own name goes
    in instead (torch.compile then guards on it: one graph per rank)."""
    if name == CONTEXT and len(set(rows)) > 1:
        return group.group_name
    return name
