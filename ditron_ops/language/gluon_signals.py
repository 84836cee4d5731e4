"""Gluon twins of ``language.signals``' bounded waits, for warp-specialized (Gluon) kernels.

The protocol is ``signals``' (DESIGN.md §4): local flags read with a system-scope acquire,
``flag >= target``, one deadline per kernel from ``%globaltimer``, the first error of a rank
claimed and recorded (op, rank, peer, epoch, kind), waits that stop once this rank recorded a
timeout or a size mismatch. Why twins: a Gluon kernel calls only Gluon functions. GPU only (the
interpreter runs no Gluon); the module imports on a Triton without Gluon, defining nothing
callable.
"""
from __future__ import annotations

from ..runtime.error_record import (ERR_EPOCH, ERR_KIND, ERR_OP, ERR_PEER, ERR_RANK,
                                     KIND_BAD_INPUT, KIND_TIMEOUT)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    HAVE_GLUON = True
except ImportError:
    gluon = gl = None
    HAVE_GLUON = False

_jit = gluon.jit if HAVE_GLUON else (lambda fn: fn)
_c = gl.constexpr if HAVE_GLUON else (lambda v: v)
_OP, _RANK, _PEER, _EPOCH, _KIND = (_c(v) for v in (ERR_OP, ERR_RANK, ERR_PEER, ERR_EPOCH, ERR_KIND))
TIMEOUT = _c(KIND_TIMEOUT)
BAD_INPUT = _c(KIND_BAD_INPUT)


@_jit
def now_ns():
    """%globaltimer in ns."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@_jit
def fence_sys():
    """System-scope sequentially consistent fence."""
    gl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@_jit
def fence_proxy_async():
    """Order this thread's earlier acquires before its later TMA (async-proxy) global reads."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@_jit
def record_error(claim_ptr, record_ptr, op_id, rank, peer, epoch, kind):
    """``signals.record_error``: the first error of this rank into the host-readable record."""
    zero = (op_id * 0).to(gl.int64)
    code = zero + kind
    old = gl.atomic_cas(claim_ptr, zero, code, sem="relaxed", scope="gpu")
    if old == 0:
        gl.store(record_ptr + _OP, op_id.to(gl.int64))
        gl.store(record_ptr + _RANK, rank.to(gl.int64))
        gl.store(record_ptr + _PEER, peer.to(gl.int64))
        gl.store(record_ptr + _EPOCH, epoch.to(gl.int64))
        gl.store(record_ptr + _KIND, code)
        fence_sys()
        gl.store(record_ptr, zero + 1)  # ERR_STATUS
    elif (old == BAD_INPUT) & (code != BAD_INPUT):
        gl.atomic_cas(claim_ptr, zero + BAD_INPUT, code, sem="relaxed", scope="gpu")


@_jit
def wait_at_least(flag_ptr, target, deadline_ns, claim_ptr, record_ptr, op_id, rank, peer,
                  epoch):
    """``signals.wait_at_least``: spin until the local flag ``>= target`` (acquire), the
    deadline, or a recorded error that stops waits; True when the flag arrived. No closing
    CTA barrier (the tl twin's): the callers are single-warp partitions, whose threads run
    the loop in lockstep."""
    target = target.to(gl.int64)
    value = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys").to(gl.int64)
    now = now_ns()
    claim = gl.load(claim_ptr, volatile=True)
    failed = (claim != 0) & (claim != BAD_INPUT)
    while (value < target) & (now < deadline_ns) & (not failed):
        value = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys").to(gl.int64)
        now = now_ns()
        claim = gl.load(claim_ptr, volatile=True)
        failed = (claim != 0) & (claim != BAD_INPUT)
    arrived = value >= target
    if not arrived:
        record_error(claim_ptr, record_ptr, op_id, rank, peer, epoch, TIMEOUT)
    return arrived


@_jit
def peer_base(table_ptr, peer, rank, local_base):
    """``signals.peer_base``: rank ``peer``'s base of the symmetric buffer whose base here is
    ``local_base``, as ``local_base + offset`` (the compiler keeps its alignment)."""
    delta = gl.load(table_ptr + peer) - gl.load(table_ptr + rank)  # bytes, a multiple of 16
    elem: gl.constexpr = local_base.dtype.element_ty.primitive_bitwidth // 8
    return local_base + (delta // 16) * (16 // elem)
