"""NVSHMEM module init for Triton kernels (host side): every loaded ``CUmodule`` that references
``nvshmemi_device_state_d`` needs ``nvshmemx_cumodule_init(module)`` before its first launch.

``install_module_init_hook`` registers a hook that does it for each module whose PTX names that
symbol (or, when no PTX is readable, whose kernel was marked with ``requires_nvshmem``). It uses
``triton.knobs.runtime.kernel_load_end_hook`` (Triton >= 3.5, multi-subscriber) or else
*chains* the single-slot ``jit_post_compile_hook``. The nvshmem backend calls
``on_nvshmem_init`` / ``on_nvshmem_finalize`` around NVSHMEM's lifetime. The device wrappers
live in ``ditron_ops.language.nvshmem``, which re-exports the public names here.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable, Optional

from ..errors import DitronError

_STATE_SYMBOL = "nvshmemi_device_state_d"   # present in the PTX of every module that needs init

_lock = threading.RLock()
_hook_kind: Optional[str] = None
_marked_kernels: set[str] = set()
_initialized: dict[int, str] = {}   # CUmodule handle -> kernel name, inited for the live NVSHMEM
_pending: dict[int, str] = {}       # loaded while NVSHMEM was down; inited by on_nvshmem_init
_runtime_live = False
_module_init_fn: Optional[Callable[[int], object]] = None


def _resolve_module_init() -> Callable[[int], object]:
    """``nvshmem.bindings.cumodule_init`` (nvshmem4py), else torch's ``_nvshmemx_cumodule_init``."""
    global _module_init_fn
    if _module_init_fn is None:
        try:
            from nvshmem.bindings import cumodule_init as init  # noqa: PLC0415
        except ImportError:
            try:
                from torch._C._distributed_c10d import _nvshmemx_cumodule_init as init  # noqa
            except ImportError:
                raise DitronError("ditron: no nvshmemx_cumodule_init available: install "
                                  "nvshmem4py (or a torch built with NVSHMEM)") from None
        _module_init_fn = init
    return _module_init_fn


def nvshmem_live() -> bool:
    """True while NVSHMEM is initialised (by ditron's runtime, or by nvshmem4py directly)."""
    if _runtime_live:
        return True
    tracking = sys.modules.get("nvshmem.core._internal_tracking")
    status = getattr(tracking, "_is_initialized", {}).get("status") if tracking else None
    enum = getattr(tracking, "InternalInitStatus", None)
    return enum is not None and status == getattr(enum, "INITIALIZED", object())


def _init_module(module: int, name: str) -> None:
    module = int(module)
    with _lock:
        if module in _initialized:
            return
        if not nvshmem_live():
            _pending[module] = name
            raise DitronError(f"ditron: Triton kernel {name!r} uses NVSHMEM but NVSHMEM is not "
                              "initialised in this process; call ditron_ops.init_nvshmem() "
                              "(every rank) before launching it")
        status = _resolve_module_init()(module)
        if status not in (None, 0):
            raise DitronError(f"ditron: nvshmemx_cumodule_init failed for Triton kernel {name!r} "
                              f"(status {status})")
        _initialized[module] = name
        _pending.pop(module, None)


def _uses_nvshmem(name: str, ptx: Optional[str]) -> bool:
    """The PTX names the NVSHMEM device state; without PTX, the kernel was marked."""
    return _STATE_SYMBOL in ptx if ptx is not None else name in _marked_kernels


def _on_kernel_load(module, function, name, metadata_group, hash=None) -> None:  # noqa: A002
    """``kernel_load_end_hook`` subscriber (Triton >= 3.5)."""
    ptx_files = [p for k, p in (metadata_group or {}).items() if str(k).endswith(".ptx")]
    try:
        ptx = Path(ptx_files[0]).read_text(encoding="utf-8", errors="replace") if ptx_files else None
    except OSError:
        ptx = None
    if module is not None and _uses_nvshmem(str(name), ptx):
        _init_module(module, str(name))


def _on_post_compile(*, key, fn, compile, **_ignored) -> None:  # noqa: A002
    """Body of the chained ``jit_post_compile_hook`` (Triton 3.4)."""
    kernel = fn.jit_function.device_caches[compile["device"]][0].get(key)
    if kernel is None:
        return
    kernel._init_handles()  # loads the module now, before the first launch
    asm = getattr(kernel, "asm", None)
    if _uses_nvshmem(kernel.name, asm.get("ptx") if hasattr(asm, "get") else None):
        _init_module(kernel.module, kernel.name)


def install_module_init_hook() -> str:
    """Make Triton call ``nvshmemx_cumodule_init`` on every module that uses NVSHMEM (idempotent).

    Returns
    -------
    str
        ``"kernel_load_end_hook"`` (Triton >= 3.5) or ``"jit_post_compile_hook"`` (chained to the
        hook that was there before, which keeps being called first).

    Notes
    -----
    The module init function is ``nvshmem.bindings.cumodule_init`` when nvshmem4py imports,
    else ``torch._C._distributed_c10d._nvshmemx_cumodule_init``. A module loaded before NVSHMEM
    is initialised makes the launch raise ``DitronError`` and is initialised by
    ``init_nvshmem``. After a finalize and a new init in the same process every module inited
    before is inited again (Triton never reloads nor unloads modules). On Triton < 3.5 a later
    tool that *overwrites* ``jit_post_compile_hook`` (e.g. torch's ``requires_nvshmem``)
    disconnects this hook.
    """
    global _hook_kind
    with _lock:
        if _hook_kind is not None:
            return _hook_kind
        import triton  # noqa: PLC0415

        runtime = triton.knobs.runtime
        chain = getattr(runtime, "kernel_load_end_hook", None)
        if chain is not None and hasattr(chain, "add"):
            chain.add(_on_kernel_load)
            _hook_kind = "kernel_load_end_hook"
        else:
            previous = runtime.jit_post_compile_hook

            def chained(*args, **kwargs):
                result = previous(*args, **kwargs) if previous is not None else None
                _on_post_compile(**kwargs)
                return result

            runtime.jit_post_compile_hook = chained
            _hook_kind = "jit_post_compile_hook"
        return _hook_kind


def requires_nvshmem(kernel):
    """Mark a ``@triton.jit`` kernel as using NVSHMEM and install the module init hook.

    Only needed where the PTX is not readable by the hook (it normally finds the NVSHMEM state
    symbol in the PTX). Returns ``kernel`` unchanged; still pass ``extern_libs=extern_libs()``
    at launch.
    """
    fn = getattr(kernel, "fn", kernel)
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"ditron requires_nvshmem: expected a @triton.jit function, got {kernel!r}")
    with _lock:
        _marked_kernels.add(name)
    install_module_init_hook()
    return kernel


def on_nvshmem_init() -> None:
    """Called by the nvshmem runtime after ``nvshmem.core.init``: init modules loaded before."""
    global _runtime_live
    with _lock:
        _runtime_live = True
        for module, name in list(_pending.items()):
            _init_module(module, name)


def on_nvshmem_finalize() -> None:
    """Called by the nvshmem runtime before ``finalize``: inited modules need it again later."""
    global _runtime_live
    with _lock:
        _runtime_live = False
        _pending.update(_initialized)
        _initialized.clear()
