"""Device-side signal primitives every ditron kernel uses (DESIGN.md §4).

Protocol
--------
* Flags live in the receiver's memory. A producer finishes its data stores, then
  ``signal_add``/``signal_set`` the receiver's flag with a system-scope *release*; the consumer
  ``wait_at_least`` on its *local* flag with an *acquire*. Nobody polls remote memory.
* Flags are never reset: every call has a monotonically increasing epoch and waits are
  ``flag >= target``.
* Every wait is bounded by ``deadline_ns`` (from ``now_ns``); on expiry it writes an error record
  (op, rank, peer, epoch) that the host turns into ``DitronTimeoutError``. Once this rank
  recorded a timeout or a size mismatch its later waits return at once; a recorded bad input
  (``BAD_INPUT``) never shortens a wait.

Two implementations are chosen per process: on the GPU the clock is ``%globaltimer`` and the
error record is ordered by ``fence.sc.sys`` (inline PTX); in the Triton interpreter the clock is
the host's monotonic clock and fences are no-ops (the interpreter runs one program at a time).
Atomics are plain ``tl.atomic_*`` with ``sem``/``scope`` in both.
"""
from __future__ import annotations

import time

import triton.language as tl

from .._env import use_interpreter
from ..runtime.error_record import (ERR_EPOCH, ERR_KIND, ERR_OP, ERR_PEER, ERR_RANK,
                                     KIND_BAD_INPUT, KIND_SIZE_MISMATCH, KIND_TIMEOUT)
from ._jit import jit

# Error record layout (``runtime.error_record``); kernels use constexpr twins (Triton reads only
# constexpr globals).
_OP, _RANK, _PEER, _EPOCH, _KIND = (tl.constexpr(v) for v in (ERR_OP, ERR_RANK, ERR_PEER, ERR_EPOCH, ERR_KIND))
TIMEOUT = tl.constexpr(KIND_TIMEOUT)
SIZE_MISMATCH = tl.constexpr(KIND_SIZE_MISMATCH)
BAD_INPUT = tl.constexpr(KIND_BAD_INPUT)

if use_interpreter():

    def now_ns():
        """Host monotonic clock in ns (interpreter: kernels run as Python in this process).

        Also yields the GIL: the poll loops call it every iteration, and without a yield a
        spinning rank holds the GIL for a whole switch interval (5 ms) while its peers wait.
        """
        time.sleep(0)
        return time.monotonic_ns()

    @jit
    def fence_sys():
        pass

    @jit
    def fence_acq_rel_sys():
        pass

    @jit
    def fence_proxy_async():
        pass

else:

    @jit
    def now_ns():
        """%globaltimer in ns (GPU)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @jit
    def fence_sys():
        """System-scope sequentially consistent fence (orders stores to host and peer memory)."""
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @jit
    def fence_acq_rel_sys():
        """System-scope acquire-release fence: with a relaxed atomic after it, a release of this
        thread's earlier stores (and of those a CTA barrier ordered before it); lighter than
        ``fence_sys``."""
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @jit
    def fence_proxy_async():
        """Order this thread's earlier (generic-proxy) acquires before its later TMA (async-proxy)
        global reads: after waiting for data that other SMs stored with plain stores."""
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@jit
def deadline_after(timeout_ns):
    """Absolute deadline ``timeout_ns`` from now; all waits of one kernel share it."""
    return now_ns() + timeout_ns.to(tl.int64)


@jit
def signal_add(flag_ptr, value):
    """Add ``value`` to a (usually remote) flag with system-scope release after a CTA barrier."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, value, sem="release", scope="sys")


@jit
def signal_set(flag_ptr, value):
    """Store ``value`` to a (usually remote) flag with system-scope release after a CTA barrier."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@jit
def record_error(claim_ptr, record_ptr, op_id, rank, peer, epoch, kind):
    """Write the first error of this rank into the host-readable record (first writer wins).

    The claim word holds the first error's kind (0: none). ``BAD_INPUT`` does not stop waits
    (``wait_at_least``): a later error of another kind that finds it there only raises the claim
    to its own kind (the record keeps the first error), so the waits after it stop again."""
    zero = tl.zeros((), tl.int64)
    code = zero + kind
    old = tl.atomic_cas(claim_ptr, zero, code, sem="relaxed", scope="gpu")
    if old == 0:
        tl.store(record_ptr + _OP, tl.cast(op_id, tl.int64))
        tl.store(record_ptr + _RANK, tl.cast(rank, tl.int64))
        tl.store(record_ptr + _PEER, tl.cast(peer, tl.int64))
        tl.store(record_ptr + _EPOCH, tl.cast(epoch, tl.int64))
        tl.store(record_ptr + _KIND, code)
        fence_sys()
        tl.store(record_ptr, 1)  # ERR_STATUS
    elif (old == BAD_INPUT) & (code != BAD_INPUT):
        tl.atomic_cas(claim_ptr, zero + BAD_INPUT, code, sem="relaxed", scope="gpu")


@jit
def wait_at_least(flag_ptr, target, deadline_ns, claim_ptr, record_ptr, op_id, rank, peer, epoch):
    """Spin until the local flag ``>= target`` (acquire), the deadline passes, or this rank has
    already recorded an error that stops waits (``claim_ptr`` set to a kind other than
    ``BAD_INPUT``: a timeout or a size mismatch).

    Returns True when the flag arrived. On expiry the error record names (op, rank, peer, epoch).
    Why the claim: a call of two waiting kernels (start barrier, then the merge or consumer)
    whose first wait expired would otherwise spin a second whole bound in the next kernel, so
    the error reached the host after twice the bound (ag_gemm, gemm_ar, flash_decode).
    Why not ``BAD_INPUT``: a kernel records a bad argument value (flash_decode's ``kv_lens``,
    block table) and goes on with it clamped; the protocol goes on too, and skipping its waits
    would let this rank overwrite peers' buffers they still read (and, under CUDA-graph replay,
    where nobody checks, run every later call unsynchronized).
    """
    target = target.to(tl.int64)
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys").to(tl.int64)
    now = now_ns()
    claim = tl.load(claim_ptr, volatile=True)
    failed = (claim != 0) & (claim != BAD_INPUT)
    while (value < target) & (now < deadline_ns) & (not failed):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys").to(tl.int64)
        now = now_ns()
        claim = tl.load(claim_ptr, volatile=True)
        failed = (claim != 0) & (claim != BAD_INPUT)
    arrived = value >= target
    if not arrived:
        record_error(claim_ptr, record_ptr, op_id, rank, peer, epoch, TIMEOUT)
    tl.debug_barrier()
    return arrived


@jit
def remote_ptr(table_ptr, peer, like_ptr):
    """Pointer to rank ``peer``'s copy of the buffer ``like_ptr`` points into (same dtype).

    ``table_ptr`` is an int64 table of every rank's base address (symmetric buffer). Symmetric
    bases are 16-byte aligned (every backend allocates them so), which lets loads vectorize.
    """
    return tl.multiple_of(tl.load(table_ptr + peer), 16).to(like_ptr.dtype)


@jit
def peer_base(table_ptr, peer, rank, local_base):
    """Rank ``peer``'s base of the symmetric buffer whose base on this rank (rank ``rank``) is
    ``local_base``: like ``remote_ptr``, but built as ``local_base + offset`` so the compiler
    keeps the 16-byte alignment (vector stores). ``remote_ptr``'s int-to-pointer cast loses it."""
    delta = tl.load(table_ptr + peer) - tl.load(table_ptr + rank)  # bytes, a multiple of 16
    elem: tl.constexpr = local_base.dtype.element_ty.primitive_bitwidth // 8
    return local_base + (delta // 16) * (16 // elem)
