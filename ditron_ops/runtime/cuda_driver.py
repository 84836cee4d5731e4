"""The few CUDA driver calls the fused ops' side streams need, through ``ctypes`` on
``libcuda.so.1``: a device-to-device copy, an event record and a stream wait on raw handles;
and the per-thread local memory a bound kernel needs, reserved before it is launched
(``reserve_local_memory``).

``torch`` offers the same through ``Tensor.copy_``, ``Event.record`` and ``Stream.wait_event``,
but each of those resolves devices and streams in Python and dispatches through ATen (about
12 µs for one 1 KiB ``copy_`` on the H200 machine's CPU). A plan knows its addresses and
streams, so it calls the driver directly (about 1 µs a call). The calls are stream-ordered and
CUDA-graph capturable like their runtime twins; every result is checked. History:
benchmarks/NOTES.md, eager host cost.
"""
from __future__ import annotations

import ctypes
from typing import Optional

from ..errors import DitronError

_lib: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        handle, ptr, size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        lib.cuMemcpyDtoDAsync_v2.argtypes = [ptr, ptr, size, handle]
        lib.cuEventRecord.argtypes = [handle, handle]
        lib.cuStreamWaitEvent.argtypes = [handle, handle, ctypes.c_uint]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, handle]
        lib.cuCtxGetLimit.argtypes = [ctypes.POINTER(size), ctypes.c_int]
        lib.cuCtxSetLimit.argtypes = [ctypes.c_int, size]
        _lib = lib
    return _lib


def _fail(call: str, status: int) -> None:
    text = ctypes.c_char_p()
    _driver().cuGetErrorString(status, ctypes.byref(text))
    name = text.value.decode() if text.value else f"CUresult {status}"
    raise DitronError(f"ditron: {call} failed: {name}")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from device address ``src`` to ``dst`` (local or peer-mapped) on ``stream``."""
    status = _driver().cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream)
    if status:
        _fail("cuMemcpyDtoDAsync", status)


def record(event: int, stream: int) -> None:
    status = _driver().cuEventRecord(event, stream)
    if status:
        _fail("cuEventRecord", status)


def wait(stream: int, event: int) -> None:
    """``stream`` waits for ``event``'s last record (device-side; the host does not block)."""
    status = _driver().cuStreamWaitEvent(stream, event, 0)
    if status:
        _fail("cuStreamWaitEvent", status)


_LOCAL_SIZE_BYTES, _STACK_SIZE = 3, 0  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, CU_LIMIT_STACK_SIZE


def reserve_local_memory(function: int) -> None:
    """Raise the current context's per-thread stack limit to ``function``'s local memory (spills)
    where it is below: the driver reserves ``max(limit, a launched kernel's local size)`` per
    thread and grows the reservation at the launch of a kernel needing more, which waits for the
    whole device to idle. Inside a fused op's launch that wait never ends: peers' kernels spin
    for this rank's next kernel (benchmarks/NOTES.md, virtual world). Called where a kernel is
    bound, in the device's current context: while plans are built, before the launch gate, when
    no peer's kernel waits for this rank (raising the limit may itself wait for the device)."""
    lib = _driver()
    local = ctypes.c_int()
    status = lib.cuFuncGetAttribute(ctypes.byref(local), _LOCAL_SIZE_BYTES, function)
    if status:
        _fail("cuFuncGetAttribute", status)
    limit = ctypes.c_size_t()
    status = lib.cuCtxGetLimit(ctypes.byref(limit), _STACK_SIZE)
    if status:
        _fail("cuCtxGetLimit", status)
    if local.value > limit.value:
        status = lib.cuCtxSetLimit(_STACK_SIZE, -(-local.value // 16) * 16)
        if status:
            _fail("cuCtxSetLimit", status)
