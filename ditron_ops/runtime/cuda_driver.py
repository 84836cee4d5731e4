"""The few CUDA driver calls the fused ops' side streams need, through ``ctypes`` on
``libcuda.so.1``: a device-to-device copy, an event record and a stream wait on raw handles.

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
