"""The virtual world: W ranks as threads of one process on one device.

Each rank is a Python thread with its own CUDA stream (torch's current stream is thread-local), so
user code is the same SPMD function it would be under torchrun. Symmetric buffers are plain
allocations on the one device; the pointer table holds every rank's address. On a CPU-only
process the kernels run in the Triton interpreter, one thread per rank.

``launch(fn, world_size=4)`` runs ``fn(group)`` on every rank and returns the per-rank results.
It compiles nothing up front: a call's plan compiles the kernels that call launches
(``plan.PlanCache``, ``compiler.batch``) before the call's launch gate, and the ranks' host
barriers (the gate among them) do not count time while the process compiles, so peers wait
for a rank compiling its first call however long it takes (``VirtualWorld.meet``).
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .. import _env
from ..errors import DitronTimeoutError, clear_frames
from . import compiler
from .group import (NULL_CONTEXT, Group, SymmetricBuffer, register_group, unregister_group,
                    using_group)

_world_ids = itertools.count()
_TORCH_COMPILE_POLL_S = 0.2
"""How often a barrier waiter looks whether a torch.compile session still runs."""


def _default_device() -> torch.device:
    if not _env.use_interpreter() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CompileAwareBarrier:
    """``threading.Barrier`` whose timeout does not count time while the process compiles.

    A waiter's deadline is ``timeout`` after the later of its arrival and the moment the
    process last stopped compiling (``compiler.paused_since``), and never passes while a
    compile or module load runs (``compiler.busy``) or a rank is inside a ``torch.compile``
    session (an inductor compile takes longer than any wait bound; Dynamo serializes the
    ranks' compiles, so a peer can sit behind another's): a rank building its first call's plan
    is waited for, a rank that never comes is still reported ``timeout`` after compiling ended.
    Waking on release costs what ``threading.Barrier`` costs (one condition notify).
    """

    def __init__(self, parties: int):
        self.parties = parties
        self._cond = threading.Condition(threading.Lock())
        self._count = 0
        self._generation = 0
        self._broken = False
        self._torch_compiled = 0.0  # when a waiter last saw a torch.compile session running

    def wait(self, timeout: float) -> None:
        """Wait for all parties; ``threading.BrokenBarrierError`` on timeout or ``abort``."""
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._count += 1
            if self._count == self.parties:
                self._count = 0
                self._generation += 1
                self._cond.notify_all()
                return
            arrived = time.monotonic()
            while generation == self._generation and not self._broken:
                if compiler.busy():  # the deadline lies at least ``timeout`` past its end
                    self._cond.wait(timeout)
                    continue
                if torch.compiler.is_compiling():  # a peer inside torch.compile (process-wide
                    self._torch_compiled = time.monotonic()  # flag): no end signal, so poll
                    self._cond.wait(_TORCH_COMPILE_POLL_S)
                    continue
                left = (max(arrived, compiler.paused_since(), self._torch_compiled) + timeout
                        - time.monotonic())
                if left <= 0:
                    self._broken = True
                    self._cond.notify_all()
                    break
                self._cond.wait(min(left, _TORCH_COMPILE_POLL_S))  # (sees a compile start)
            if generation == self._generation:
                raise threading.BrokenBarrierError

    def abort(self) -> None:
        """Break the barrier: every waiter (and every later one) raises."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class VirtualWorld:
    """Shared state of the W virtual ranks (barrier, object exchange, streams, allocations)."""

    def __init__(self, world_size: int, device: Optional[torch.device] = None,
                 timeout_s: Optional[float] = None, gate: bool = True):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ditron.launch: world_size must be a positive int, got {world_size!r}")
        device = _default_device() if device is None else torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"ditron.launch: device {str(device)!r} but this process has no CUDA "
                             "device (torch.cuda.is_available() is False); use device='cpu'")
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
        # the launch gate (``VirtualGroup.waiting_launch``): GPU worlds of several ranks only
        self.gate = gate and device.type == "cuda" and world_size > 1
        self.name = f"virtual{next(_world_ids)}"
        timeout = _env.default_timeout_s() if timeout_s is None else float(timeout_s)
        self._barrier = CompileAwareBarrier(world_size)
        self._meet_lock = threading.Lock()
        self._meet_count = [0] * world_size  # barrier waits per rank (who is missing on timeout)
        self._failed: list[int] = []  # ranks whose function raised (``abort``)
        self._slots: list[Any] = [None] * world_size
        self._keep: dict[int, list[torch.Tensor]] = {}
        self.streams = ([torch.cuda.Stream(device) for _ in range(world_size)]
                        if device.type == "cuda" else [None] * world_size)
        self.groups = [VirtualGroup(self, r, timeout) for r in range(world_size)]
        for g in self.groups:
            g._error_tensors()  # pinned allocation here, not while peers' kernels spin

    def meet(self, rank: int, timeout_s: float, op: str, epoch=None, what: str = "") -> None:
        """Wait until every rank meets here (host barriers and launch gates share one barrier).
        Raises ``DitronTimeoutError`` naming ``op``, ``epoch`` and the ranks that did not come
        (or that failed) after ``timeout_s``."""
        with self._meet_lock:
            self._meet_count[rank] += 1
            mine = self._meet_count[rank]
        try:
            self._barrier.wait(timeout=max(timeout_s, 1.0))
        except threading.BrokenBarrierError:
            with self._meet_lock:
                failed = [q for q in self._failed if q != rank]
                missing = [q for q, c in enumerate(self._meet_count) if c < mine and q not in failed]
            where = what or f"the {op} host barrier"
            if failed:
                detail = f"rank {_ranks(failed)} raised an error before reaching {where}"
            elif missing:
                detail = f"rank {_ranks(missing)} did not reach {where} within {timeout_s:.1f} s"
            else:
                detail = f"the ranks did not all reach {where} within {timeout_s:.1f} s"
            peer = (failed or missing or [None])[0]
            raise DitronTimeoutError(op, rank, peer, epoch, detail=detail) from None

    def barrier(self, rank: int, timeout_s: float) -> None:
        self.meet(rank, timeout_s, "host barrier", what=f"the host barrier of {self.name}")

    def abort(self, rank: int) -> None:
        """Rank ``rank`` failed: wake every rank waiting to meet it."""
        with self._meet_lock:
            self._failed.append(rank)
        self._barrier.abort()

    def close(self) -> None:
        """Drop every rank's memory (after all ranks' device work has finished)."""
        for g in self.groups:
            g.drop_owned()  # MoE Buffers a rank did not close (it failed, or a peer did)
            g.plans.clear()
            g._workspaces.clear()
            g._failure = None  # (went to the caller; else a cycle: group -> error -> frames -> group)
        self._slots = [None] * self.world_size


class VirtualGroup(Group):
    """One rank of a ``VirtualWorld``."""

    backend = "virtual"

    def __init__(self, world: VirtualWorld, rank: int, timeout_s: float):
        super().__init__(rank, world.world_size, world.device, f"{world.name}/rank{rank}",
                         timeout_s=timeout_s)
        self.world = world
        self._gating = False  # inside a gated ``waiting_launch`` (``launch_step`` meets too)

    @property
    def ranks_per_device(self) -> int:
        return self.world_size

    @property
    def shared_address_space(self) -> bool:
        return True  # the ranks are threads of one process on one device

    @property
    def stream(self) -> Optional[torch.cuda.Stream]:
        return self.world.streams[self.rank]

    def barrier(self) -> None:
        """Meet every rank; a peer that does not come fails this group (as a kernel's expired
        wait does): the ranks are out of step, and the launch's end must not wait on it again."""
        try:
            self.world.barrier(self.rank, self.timeout_s)
        except DitronTimeoutError as err:
            self._failure = err
            raise

    def waiting_launch(self, op: str = "?", epoch: int = -1):
        """Launch a waiting kernel into an idle stream, and only after every rank has done so.

        Why: a rank's kernel queued behind other work of its stream (an upload, a small torch
        kernel) sometimes never started while its peers' kernels spun waiting for it (H200, W=4
        and W=8: 7 of 96 short test sequences timed out without this gate, 0 of 224 with it;
        benchmarks/NOTES.md, virtual world). Ranks share one GPU's hardware queues, so a
        dependency of one rank's stream can sit in front of a peer's kernel. Here every rank
        drains its stream, meets the others, launches, and meets them again before queuing more
        work, so waiting kernels never queue behind dependent work. Costs a stream
        synchronization and two host barriers per call, only in GPU virtual worlds of W > 1
        (``launch(..., gate=False)`` turns it off), never during CUDA-graph capture. A rank that
        never comes raises ``DitronTimeoutError`` naming ``op``, the missing peer and ``epoch``
        (this rank's call count of the op's workspace).
        """
        if not self.world.gate:
            return NULL_CONTEXT
        return self._gated_launch(op, epoch)

    @contextlib.contextmanager
    def _gated_launch(self, op: str, epoch: int):
        gate = not torch.cuda.is_current_stream_capturing()
        if gate:
            torch.cuda.current_stream(self.device).synchronize()
            self._gate(op, epoch)
        self._gating = gate
        try:
            yield
        finally:
            self._gating = False
        if gate:
            self._gate(op, epoch)

    def meet_before_next_wait(self) -> None:
        """With the launch gate on, the gate is the meeting: every rank reaches it after
        building its plans, and its barrier waits out compiles (``CompileAwareBarrier``)."""
        if not self.world.gate:
            super().meet_before_next_wait()

    def launch_step(self, op: str = "?", epoch: int = -1) -> None:
        """Inside ``waiting_launch``: meet the other ranks again, so that every rank's kernels
        launched so far are queued before any rank queues the next ones.

        Needed before a kernel on another stream that waits (stream event) for a kernel that
        waits on peers: otherwise a rank's kernel held by its event (ag_gemm's pull kernel,
        behind its start barrier) can sit in a hardware queue in front of a peer's start
        barrier, which then never runs until the waits expire (H200, virtual W=8, pull mode:
        4 of 4 runs timed out without it, 6 of 6 passed with it; benchmarks/NOTES.md, virtual
        world).
        """
        if self._gating:
            self._gate(op, epoch)

    def _gate(self, op: str, epoch: int) -> None:
        try:
            self.world.meet(self.rank, self.timeout_s, op, epoch,
                            what="the launch of this call")
        except DitronTimeoutError as err:
            self._failure = err
            raise

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
        peers = self.all_gather_object(local)
        table = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return SymmetricBuffer(local=local, ptr_table=table, peers=peers)

    def _free_symmetric(self, buf: SymmetricBuffer) -> None:
        # Peers may still read/write this rank's memory until they pass the barrier.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.barrier()
        buf.local = buf.ptr_table = buf.peers = None


def _peers_compile_while_one_traces(world_size: int) -> tuple:
    """``(launch's context, each rank thread's context)`` under which a rank entering a
    ``torch.compile``d function goes on to Dynamo (whose compile lock serializes the ranks)
    while a peer FX-traces.

    Why: Dynamo refuses to run a compiled function while FX tracing is on, and that flag is
    process-wide, so a peer's make_fx (``aot_eager``, ``inductor``) made another rank's call
    raise "FX to symbolically trace a dynamo-optimized function" (H200, W=8, ``aot_eager``).
    Dynamo's config patches are per thread in newer torch (each rank patches its own) and
    process-wide in older torch (``launch`` patches once around the ranks, so no rank's exit
    undoes it for a peer). Only where Dynamo is already imported (a compiled function exists)
    and has the setting."""
    none = contextlib.nullcontext
    dynamo = sys.modules.get("torch._dynamo")
    config = getattr(dynamo, "config", None)
    if world_size == 1 or not hasattr(config, "force_compile_during_fx_trace"):
        return none, none

    def patch():
        return config.patch(force_compile_during_fx_trace=True)
    return (none, patch) if _patches_per_thread(config) else (patch, none)


_PATCHES_PER_THREAD: Optional[bool] = None


def _patches_per_thread(config) -> bool:
    """Whether a ``config.patch`` in one thread is invisible to others (asked once)."""
    global _PATCHES_PER_THREAD
    if _PATCHES_PER_THREAD is None:
        seen = []
        with config.patch(force_compile_during_fx_trace=not config.force_compile_during_fx_trace):
            mine = config.force_compile_during_fx_trace
            probe = threading.Thread(target=lambda: seen.append(config.force_compile_during_fx_trace))
            probe.start()
            probe.join()
        _PATCHES_PER_THREAD = seen[0] != mine
    return _PATCHES_PER_THREAD


def _ranks(ranks: list) -> str:
    return ", ".join(str(q) for q in ranks)


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
           timeout_s: Optional[float] = None, gate: bool = True) -> list:
    """Run ``fn(group, *args)`` on ``world_size`` virtual ranks and return the per-rank results.

    Parameters
    ----------
    fn : callable
        SPMD function; receives this rank's ``Group`` first. Inside it ``group=None`` in any op
        resolves to this group. Each rank runs in its own thread, on its own CUDA stream, which
        starts after the work queued on the caller's current stream when ``launch`` is called
        (tensors the caller just wrote are ready); ``launch`` returns after every rank's work,
        so the caller may use the results on any stream.
    world_size : int
        Number of virtual ranks W >= 1.
    device : torch.device or str, optional
        ``"cuda"`` (default when a GPU is present) or ``"cpu"`` (Triton interpreter).
    args : tuple
        Extra positional arguments passed to every rank.
    timeout_s : float, optional
        Bound of every device-side wait (default ``DITRON_TIMEOUT_S`` or 10 s).
    gate : bool
        Launch the ranks' waiting kernels together on a GPU (``VirtualGroup.waiting_launch``;
        default on; off only to study what it prevents).

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
    world = VirtualWorld(world_size, device, timeout_s, gate)
    results: list[Any] = [None] * world_size
    errors: list[Optional[BaseException]] = [None] * world_size
    # The ranks' streams start after the work the caller queued so far (inputs it just wrote,
    # weights still being copied); the caller's memory stays alive until the synchronize below,
    # so the allocator cannot hand it to anyone while a rank reads it.
    ready = None
    if world.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(world.device))

    launch_dynamo, rank_dynamo = _peers_compile_while_one_traces(world_size)

    def body(rank: int) -> None:
        group = world.groups[rank]
        register_group(group)
        try:
            stream_ctx = (torch.cuda.stream(group.stream) if group.stream is not None
                          else contextlib.nullcontext())
            if world.device.type == "cuda":
                torch.cuda.set_device(world.device)
                group.stream.wait_event(ready)
            # Backward runs on this rank's thread: autograd's one CUDA worker thread would run
            # every rank's backward nodes in turn, and a node that meets its peers (the launch
            # gate, a plan's allocation) would wait for ranks queued behind it.
            with stream_ctx, using_group(group), torch.autograd.set_multithreading_enabled(False), \
                    rank_dynamo():
                results[rank] = fn(group, *args)
                if group._failure is None:  # an error fn already saw is not raised twice
                    group.synchronize()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
            errors[rank] = exc
            world.abort(rank)
        finally:
            unregister_group(group)

    threads = [threading.Thread(target=body, args=(r,), name=f"ditron-{world.name}-rank{r}", daemon=True)
               for r in range(world_size)]
    with launch_dynamo():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    try:
        if world.device.type == "cuda":  # the caller's stream (and every other) after the ranks';
            torch.cuda.synchronize(world.device)  # failed ranks' kernels end by their deadline
    finally:
        world.close()
    if any(e is not None for e in errors):
        rank, err = _root_cause(errors)
        for other in errors:  # not reported: the tensors their frames hold go now
            if other is not None and other is not err:
                clear_frames(other)
        if hasattr(err, "add_note"):
            err.add_note(f"(raised on virtual rank {rank} of {world_size})")
        try:
            raise err
        finally:
            # the traceback holds this frame and the ranks' frames, whose ``errors`` (a cell of
            # ``body``) holds the traceback: a reference cycle that kept the failed ranks'
            # tensors until Python's cycle collector ran (it runs on object counts, not bytes)
            errors = err = None
    return results
