"""NVSHMEM device functions for stock Triton (>= 3.4), GPU only.

Stock Triton has no NVSHMEM dialect, but it can call any function of a linked LLVM bitcode
library. Three pieces make that work (measured on the H200 test machine, see
``research/feasibility.md`` §1.3):

1. **Extern wrappers** (this module): ``tl.core.extern_elementwise("", "", args,
   {arg_types: (symbol, ret_type)}, is_pure=False, _semantic=...)``. Addresses travel as
   ``int64`` (pointers are cast with ``ptrtoint``), PE numbers and op codes as ``int32``.
   Stock ``extern_elementwise`` cannot return ``void``, so void functions are declared with an
   ``int32`` result that must not be used (PyTorch does the same). Every wrapper takes any
   integer width or a pointer and casts it, so ``putmem_nbi_block(dst_ptr + off, src, n, pe)``
   works with plain Triton pointers.
2. **Bitcode**: launch every kernel that calls these wrappers with
   ``extern_libs=extern_libs()``. Triton links ``libnvshmem_device.bc`` only into modules that
   have extern calls, and hashes the file into the cache key. ``bitcode_path`` finds it:
   explicit ``lib_dir`` (default ``NVSHMEM_LIB_DIR``), else nvshmem4py >= 0.4's
   ``nvshmem.core.find_device_bitcode_library()``, else ``nvidia/nvshmem/lib`` inside
   site-packages. Linking the 31 MB bitcode makes the first compile slow (~8 s); Triton's disk
   cache hides it afterwards.
3. **Module init**: every loaded ``CUmodule`` that references ``nvshmemi_device_state_d``
   needs ``nvshmemx_cumodule_init(module)`` before its first launch; the host side of that
   (``install_module_init_hook``, ``requires_nvshmem``) lives in ``runtime.nvshmem_modules``
   and is re-exported here.

Scope of each call
------------------
A Triton program is a CUDA block and every thread executes a scalar extern call:

* ``*_block`` functions are block collectives: right, every thread must take part.
* ``quiet``, ``fence``, ``signal_wait_until``, ``my_pe``, ``n_pes``, ``ptr`` are per thread and
  harmless when repeated.
* ``signal_op`` is per thread: ``SIGNAL_SET`` is fine, ``SIGNAL_ADD`` adds once **per thread**.
  Prefer SET with monotonically increasing epochs (DESIGN.md §4) or ``putmem_signal_nbi_block``.
* ``barrier_all`` is the block variant: call it from exactly one program per PE.

Constants are the values of the NVSHMEM headers (PyTorch's docstrings list wrong ones):
``SIGNAL_SET=9, SIGNAL_ADD=10``; ``CMP_EQ=0, NE=1, GT=2, LE=3, LT=4, GE=5``.

Nothing here runs at import time: no environment read, no hook, no nvshmem import. The Triton
interpreter cannot run extern calls; CPU processes use ``ditron_ops.language.signals``.
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
from typing import Optional

import triton.language as tl
from triton.language import core

from .. import _env
from ..errors import DitronError
from ..runtime.nvshmem_modules import (install_module_init_hook, nvshmem_live,  # noqa: F401
                                       on_nvshmem_finalize, on_nvshmem_init, requires_nvshmem)

__all__ = [
    "SIGNAL_SET", "SIGNAL_ADD", "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_LE", "CMP_LT", "CMP_GE",
    "my_pe", "n_pes", "ptr", "putmem_nbi_block", "putmem_signal_nbi_block", "signal_op",
    "signal_wait_until", "quiet", "fence", "barrier_all",
    "bitcode_path", "extern_libs", "install_module_init_hook", "requires_nvshmem",
    "nvshmem_live", "on_nvshmem_init", "on_nvshmem_finalize",
]

# NVSHMEM header values (nvshmem_common_transport.h, nvshmem_constants.h).
SIGNAL_SET, SIGNAL_ADD = tl.constexpr(9), tl.constexpr(10)
CMP_EQ, CMP_NE, CMP_GT, CMP_LE, CMP_LT, CMP_GE = map(tl.constexpr, (0, 1, 2, 3, 4, 5))

_BITCODE = "libnvshmem_device.bc"

# ---- Device wrappers ---------------------------------------------------------


def _arg(x, dtype, fn: str, name: str, _semantic, scalar: bool):
    """``x`` (int, constexpr, integer or pointer tensor) cast to ``dtype``."""
    t = _semantic.to_tensor(x)
    if scalar and t.type.is_block():
        raise ValueError(f"ditron nvshmem.{fn}: {name} must be a scalar, got a block {t.type}; "
                         "the call is made once per program, by every thread")
    sca = t.type.scalar
    if not (sca.is_int() or sca.is_ptr()):
        raise TypeError(f"ditron nvshmem.{fn}: {name} must be an integer or a pointer, got {sca}")
    return _semantic.cast(t, dtype)


_I32, _I64 = core.dtype("int32"), core.dtype("int64")


def _extern(symbol: str, ret, params: str = "", args=(), *, fn: str = "", _semantic,
            scalar: bool = True):
    """Call ``symbol``; ``params`` is "name:i64 name:i32 ..." matching ``args``."""
    spec = [p.split(":") for p in params.split()]
    types = tuple(_I64 if t == "i64" else _I32 for _, t in spec)
    cast = [_arg(a, t, fn, n, _semantic, scalar) for a, (n, _), t in zip(args, spec, types)]
    return core.extern_elementwise("", "", cast, {types: (symbol, ret)}, is_pure=False,
                                   _semantic=_semantic)


@core.extern
def my_pe(_semantic=None):
    """This PE's number (``nvshmem_my_pe``), ``int32``."""
    return _extern("nvshmem_my_pe", _I32, _semantic=_semantic)


@core.extern
def n_pes(_semantic=None):
    """Number of PEs (``nvshmem_n_pes``), ``int32``."""
    return _extern("nvshmem_n_pes", _I32, _semantic=_semantic)


@core.extern
def ptr(addr, pe, _semantic=None):
    """``nvshmem_ptr(addr, pe)``: address of ``pe``'s copy of symmetric ``addr``, ``int64``.

    Parameters
    ----------
    addr : pointer or int64 (scalar or block)
        Symmetric address on this PE.
    pe : int32

    Returns
    -------
    int64
        Load/store-able address (NVLink/P2P peers and this PE), 0 when ``pe`` is not reachable
        by loads and stores. Cast with ``.to(tl.pointer_type(...))``.
    """
    return _extern("nvshmem_ptr", _I64, "addr:i64 pe:i32", (addr, pe), fn="ptr",
                   _semantic=_semantic, scalar=False)


@core.extern
def putmem_nbi_block(dst, src, nbytes, pe, _semantic=None):
    """Non-blocking block put of ``nbytes`` from local ``src`` to symmetric ``dst`` on ``pe``.

    ``nvshmemx_putmem_nbi_block``. Complete it with ``quiet`` (order it with ``fence``). Block
    collective: every thread of the program calls it. Returns an unused ``int32``.
    """
    return _extern("nvshmemx_putmem_nbi_block", _I32, "dst:i64 src:i64 nbytes:i64 pe:i32",
                   (dst, src, nbytes, pe), fn="putmem_nbi_block", _semantic=_semantic)


@core.extern
def putmem_signal_nbi_block(dst, src, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    """Non-blocking block put followed by a signal update on ``pe``.

    ``nvshmemx_putmem_signal_nbi_block``: copies ``nbytes`` from local ``src`` to symmetric
    ``dst`` on ``pe``, then applies ``sig_op`` (``SIGNAL_SET`` / ``SIGNAL_ADD``) with ``signal``
    to the symmetric ``uint64`` at ``sig_addr`` on ``pe``; the signal lands after the data.
    Block collective (the signal is applied once per program). Returns an unused ``int32``.

    Parameters
    ----------
    dst, sig_addr : pointer or int64
        Symmetric addresses (this PE's copies; NVSHMEM translates them for ``pe``).
    src : pointer or int64
        Local source address.
    nbytes, signal : int64 (``signal`` may be uint64)
    sig_op, pe : int32
    """
    return _extern("nvshmemx_putmem_signal_nbi_block", _I32,
                   "dst:i64 src:i64 nbytes:i64 sig_addr:i64 signal:i64 sig_op:i32 pe:i32",
                   (dst, src, nbytes, sig_addr, signal, sig_op, pe),
                   fn="putmem_signal_nbi_block", _semantic=_semantic)


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    """``nvshmemx_signal_op``: atomically apply ``sig_op`` with ``signal`` to ``pe``'s signal.

    Per-thread call: every thread of the program performs it, so ``SIGNAL_ADD`` adds
    ``signal`` once per thread. Returns an unused ``int32``.
    """
    return _extern("nvshmemx_signal_op", _I32, "sig_addr:i64 signal:i64 sig_op:i32 pe:i32",
                   (sig_addr, signal, sig_op, pe), fn="signal_op", _semantic=_semantic)


@core.extern
def signal_wait_until(sig_addr, cmp, value, _semantic=None):
    """``nvshmem_signal_wait_until``: spin until the local signal satisfies ``cmp value``.

    Unbounded: use it only where the signal is sure to arrive (ditron's bounded waits are in
    ``ditron_ops.language.signals``). Returns the satisfying signal value as ``int64``.
    """
    return _extern("nvshmem_signal_wait_until", _I64, "sig_addr:i64 cmp:i32 value:i64",
                   (sig_addr, cmp, value), fn="signal_wait_until", _semantic=_semantic)


@core.extern
def quiet(_semantic=None):
    """``nvshmem_quiet``: complete all NVSHMEM operations issued so far. Unused ``int32``."""
    return _extern("nvshmem_quiet", _I32, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence``: order earlier puts before later ones, per PE. Unused ``int32``."""
    return _extern("nvshmem_fence", _I32, _semantic=_semantic)


@core.extern
def barrier_all(_semantic=None):
    """``nvshmemx_barrier_all_block``: barrier over all PEs with completion of earlier ops.

    Call it from exactly one program on every PE (``if tl.program_id(0) == 0:``), and only when
    all PEs' programs are co-resident. Returns an unused ``int32``.
    """
    return _extern("nvshmemx_barrier_all_block", _I32, _semantic=_semantic)


# ---- Bitcode -----------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _find_bitcode(lib_dir: Optional[str]) -> str:
    if lib_dir is not None:
        candidate = lib_dir if lib_dir.endswith(".bc") else os.path.join(lib_dir, _BITCODE)
        if os.path.isfile(candidate):
            return candidate
        raise DitronError(f"ditron: NVSHMEM device bitcode not found at {candidate} (from "
                          "NVSHMEM_LIB_DIR or lib_dir=); point it at the 'lib' directory of the "
                          "NVSHMEM install that provides libnvshmem_host.so")
    tried: list[str] = []
    try:
        import nvshmem.core as nvs  # noqa: PLC0415 - optional dependency, imported lazily

        found = nvs.find_device_bitcode_library()  # nvshmem4py >= 0.4
        if found and os.path.isfile(found):
            return str(found)
        tried.append(f"find_device_bitcode_library() -> {found!r}")
    except Exception as exc:  # noqa: BLE001 - missing or older nvshmem4py: fall through
        tried.append(f"nvshmem.core.find_device_bitcode_library: {type(exc).__name__}: {exc}")
    roots = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *sys.path]
    for root in dict.fromkeys(r for r in roots if r and os.path.isdir(r)):
        candidate = os.path.join(root, "nvidia", "nvshmem", "lib", _BITCODE)
        if os.path.isfile(candidate):
            return candidate
        tried.append(candidate)
    raise DitronError("ditron: NVSHMEM device bitcode (libnvshmem_device.bc) not found. Install "
                      "nvidia-nvshmem-cu12/cu13 (a dependency of nvshmem4py) or set "
                      "NVSHMEM_LIB_DIR to its lib directory. Tried: " + "; ".join(tried))


def bitcode_path(lib_dir: Optional[str] = None) -> str:
    """Path of ``libnvshmem_device.bc`` (cached per ``lib_dir``).

    Parameters
    ----------
    lib_dir : str, optional
        Directory holding the bitcode (or the ``.bc`` file itself). Default: ``NVSHMEM_LIB_DIR``
        (read by ``ditron_ops._env``), else nvshmem4py >= 0.4's
        ``find_device_bitcode_library()``, else ``nvidia/nvshmem/lib`` inside site-packages
        (``sysconfig`` purelib/platlib and every ``sys.path`` entry).

    Returns
    -------
    str

    Raises
    ------
    DitronError
        Nothing found; the message lists the places tried. An explicit ``lib_dir`` or
        ``NVSHMEM_LIB_DIR`` without the file is an error, not a fallback.
    """
    if lib_dir is None:
        lib_dir = _env.nvshmem_lib_dir()
    return _find_bitcode(None if lib_dir is None else os.fspath(lib_dir))


def extern_libs(lib_dir: Optional[str] = None) -> dict[str, str]:
    """``{"libnvshmem_device": bitcode_path(lib_dir)}``, the ``extern_libs=`` launch kwarg."""
    return {"libnvshmem_device": bitcode_path(lib_dir)}
