"""``BoundKernel``: a Triton kernel launch whose arguments are bound once, for a call's plan.

``kernel[grid](*args, **kwargs)`` costs tens of µs of host time per call in Triton 3.x: it binds
and specializes every argument, hashes the specialization, looks up the compiled kernel, and
turns every host ``TensorDescriptor`` into a ``CUtensorMap`` again. A plan launches the same
kernel with the same shapes call after call, so ``BoundKernel`` does all of that once: it
compiles (or finds) the kernel for the arguments it is built with, expands them into the
launcher's flat argument list, and per call replaces only the arguments named in ``vary``
before it calls the compiled launcher directly. Descriptors among ``vary`` are converted once
per base address (``_DESC_CACHE`` of them per argument): a descriptor is a function of the base
address, shape, strides and block, and a plan fixes everything but the address, so a cached one
is correct whatever tensor now lives at that address (a converted descriptor holds addresses,
never the tensor). Once bound, a ``BoundKernel`` keeps no ``vary`` tensor alive: a plan does not
hold its first call's inputs and output.

What ``vary`` may change: tensors (the plan key must hold their 16-byte alignment, which Triton
specializes on), descriptor arguments (per call the *tensor* it is over, of the shape and
strides of the build-time descriptor; likewise aligned), and integers that the kernel lists in
``do_not_specialize``. Anything else is bound for good.

Compilation goes through ``compiler.prepare``: inside a plan's build (``compiler.batch``) the
kernel is compiled on a thread pool beside the plan's other kernels and bound when the build
ends; elsewhere it is compiled and bound when made. In the Triton interpreter (CPU processes) a
launch is the plain ``kernel[grid](...)``: its cost is the interpreter's, and nothing is
compiled.
"""
from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _env
from . import compiler, cuda_driver

_LOAD_LOCK = threading.Lock()
_DESC_CACHE = 256
"""Converted descriptors kept per varying descriptor argument (e.g. one per weight tensor a
plan sees: a model's layers share a plan when their shapes agree)."""


def _raw_launcher(launcher):
    """The compiled C launcher under Triton's Python wrapper that converts descriptors on every
    call (``wrap_handle_tensordesc``), or None where this Triton has another layout."""
    fn = getattr(launcher, "launch", None)
    if fn is None:
        return None
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return fn  # the C function itself: the kernel has no descriptor argument
    if "launcher" not in code.co_freevars:
        return None
    return cells[code.co_freevars.index("launcher")].cell_contents


class BoundKernel:
    """One kernel launch, bound at build time.

    Parameters
    ----------
    fn : JITFunction or InterpretedFunction
        A ``ditron_ops.language.jit`` kernel.
    grid : tuple of int
    args, kwargs
        What ``fn[grid](*args, **kwargs)`` would take (constexprs and launch options in
        ``kwargs``); the values of ``vary`` arguments are examples of the per-call ones.
    vary : sequence of str
        Names of the arguments ``launch`` takes per call, in that order.
    device : torch.device
    """

    def __init__(self, fn, grid: Sequence[int], args: Sequence[Any], kwargs: dict, *,
                 vary: Sequence[str] = (), device: torch.device):
        names = list(fn.arg_names)
        self.fn, self.grid = fn, tuple(grid) + (1,) * (3 - len(grid))
        self.args, self.kwargs = list(args), dict(kwargs)
        self.vary = tuple(vary)
        self._vary_pos = [names.index(v) for v in self.vary]
        for name, pos in zip(self.vary, self._vary_pos):
            if pos >= len(self.args) and name not in self.kwargs:
                raise ValueError(f"BoundKernel: vary argument {name!r} was not given")
        # descriptor arguments among vary: the build-time descriptor's layout is the template per
        # call, and each base address's descriptor is made once (``_DESC_CACHE`` per argument)
        self._templates = {pos: _layout(self._value(pos, names)) for pos in self._vary_pos
                           if _is_descriptor(self._value(pos, names))}
        self._fast = None
        self.device = device
        self.compiles = device.type == "cuda" and not _env.use_interpreter()
        compiler.prepare(self)
        if not self.compiles:
            self._forget_examples()

    @property
    def name(self) -> str:
        """The kernel's function name (progress lines)."""
        return getattr(self.fn, "__name__", "kernel")

    def _value(self, pos: int, names: list):
        return self.args[pos] if pos < len(self.args) else self.kwargs[names[pos]]

    # -- build (``compiler.prepare``: GPU only) -------------------------------------------------
    def _request(self) -> None:
        """Ask Triton for the compiled variant (a future inside a ``compiler.batch``)."""
        compiler.settle_cache_keys(self.fn)
        self._pending = self.fn.warmup(*self.args, grid=self.grid, **self.kwargs)

    def _forget_examples(self) -> None:
        """Drop the build-time values of the ``vary`` arguments once bound: each call passes
        its own, and a plan kept alive the first call's inputs and output (up to
        ``PLAN_CAPACITY`` plans per group; a serving bench of many shapes ran out of memory
        on an H100)."""
        names = list(self.fn.arg_names)
        for name, pos in zip(self.vary, self._vary_pos):
            if pos < len(self.args):
                self.args[pos] = None
            else:
                self.kwargs[names[pos]] = None

    def _bind(self) -> None:
        """Load the compiled variant, bind the launch arguments, drop the ``vary`` examples."""
        try:
            self._bind_launcher()
        finally:
            self._forget_examples()

    def _bind_launcher(self) -> None:
        fn, names, device = self.fn, list(self.fn.arg_names), self.device
        kernel, self._pending = self._pending, None
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        with _LOAD_LOCK:  # ranks of a virtual world share the kernel object: load it once
            kernel._init_handles()
            if device.type == "cuda":  # (its launch must never grow the local memory)
                with torch.cuda.device(device):
                    cuda_driver.reserve_local_memory(kernel.function)
        launcher = kernel.run
        raw = _raw_launcher(launcher)
        if (raw is None or getattr(launcher, "global_scratch_size", 0)
                or getattr(launcher, "profile_scratch_size", 0)):
            return  # scratch memory or an unknown launcher layout: the slow path allocates/converts
        signature = list(kernel.src.signature.values())
        metas = list(getattr(kernel.metadata, "tensordesc_meta", None) or [])
        params = inspect.signature(fn.fn).parameters
        values = []
        for i, name in enumerate(names):
            if i < len(self.args):
                values.append(self.args[i])
            elif name in self.kwargs:
                values.append(self.kwargs[name])
            else:
                values.append(params[name].default)
        flat, slot_of, desc_meta = [], {}, {}
        meta_i = 0
        for i, (value, ty) in enumerate(zip(values, signature)):
            slot_of[i] = len(flat)
            if isinstance(ty, str) and ty.startswith("tensordesc"):
                meta = metas[meta_i] if metas else None
                meta_i += 1
                desc_meta[i] = meta
                flat.extend(_expand_descriptor(value, meta))  # (addresses: see the helper)
            else:  # a tensor as its address: the launcher then skips data_ptr() and the
                flat.append(_address(value))  # driver's pointer check (self.args keeps the
                # bound ones alive; every call replaces the ``vary`` ones)
        self._flat = flat
        # per varying argument: (first flat slot, width, None or what converts a base tensor
        # into the launcher's arguments of the descriptor over it, its per-address cache)
        self._slots = []
        for pos in self._vary_pos:
            if pos in desc_meta:
                width = len(_expand_descriptor(values[pos], desc_meta[pos]))

                def make(base, template=_layout(values[pos]), meta=desc_meta[pos]):
                    return _expand_descriptor(_over(template, base), meta)

                self._slots.append((slot_of[pos], width, make, OrderedDict()))
            else:
                self._slots.append((slot_of[pos], 1, None, None))
        self._head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                      kernel.packed_metadata, None, None, None)
        self._function = kernel.function
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._fast = raw
        self.kernel = kernel

    # -- call ----------------------------------------------------------------------------------
    def launch(self, *values) -> None:
        """Launch on the current stream with ``values`` for the ``vary`` arguments (for a
        descriptor argument, the tensor it is over)."""
        if self._fast is None:
            return self._slow(values)
        self.launch_on(torch._C._cuda_getCurrentRawStream(self._device_index), *values)

    def launch_on(self, stream: int, *values) -> None:
        """``launch`` on the raw CUDA stream ``stream``."""
        raw = self._fast
        if raw is None:
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                return self._slow(values)
        flat = self._flat
        if len(values) != len(self._slots):  # a slot left out would keep a dropped address
            raise TypeError(f"{self.name}: launch takes {len(self._slots)} values ({self.vary}), "
                            f"got {len(values)}")
        if values:
            flat = list(flat)
            for (slot, width, make, cache), value in zip(self._slots, values):
                if make is None:
                    flat[slot] = _address(value)
                else:
                    flat[slot:slot + width] = _cached(cache, value, make)
        gx, gy, gz = self.grid
        raw(gx, gy, gz, stream, self._function, *self._head, *flat)

    def _slow(self, values) -> None:
        if len(values) != len(self.vary):
            raise TypeError(f"{self.name}: launch takes {len(self.vary)} values ({self.vary}), "
                            f"got {len(values)}")
        args, kwargs = list(self.args), dict(self.kwargs)
        for name, pos, value in zip(self.vary, self._vary_pos, values):
            if pos in self._templates:  # made per call, not cached: a cached descriptor
                value = _over(self._templates[pos], value)  # would keep its base alive
            if pos < len(args):
                args[pos] = value
            else:
                kwargs[name] = value
        self.fn[self.grid](*args, **kwargs)


_UNUSED: dict = {}


def unused_pointer(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A pointer argument the kernel never reads (its branch is off by a constexpr), bound in
    a plan: the process's own small aligned tensor of ``dtype`` (so the compiled variant is the
    one a caller's tensor of that dtype would give), never a caller's tensor, which the plan
    would keep alive."""
    key = (torch.device(device), dtype)
    got = _UNUSED.get(key)
    if got is None:
        got = _UNUSED.setdefault(key, torch.zeros(16, dtype=dtype, device=device))
    return got


def _address(value):
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _is_descriptor(value) -> bool:
    """A host tensor descriptor: Triton's, or Gluon's (which also carries a shared layout)."""
    return isinstance(value, TensorDescriptor) or (
        hasattr(value, "block_shape") and hasattr(value, "base") and hasattr(value, "layout"))


def _layout(desc) -> tuple:
    """A descriptor's ``(type, shape, strides, block, layout)``, without its base tensor (not
    kept alive); ``layout`` is Gluon's shared layout (None for Triton's descriptors)."""
    return (type(desc), tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape),
            getattr(desc, "layout", None))


def _over(layout: tuple, base: torch.Tensor):
    """A descriptor of ``layout`` (``_layout``) over ``base``."""
    kind, shape, strides, block, shared = layout
    if shared is None:
        return kind(base, list(shape), list(strides), list(block))
    return kind(base, list(shape), list(strides), list(block), shared)


def _expand_descriptor(desc: TensorDescriptor, meta) -> list:
    """The launcher's arguments for ``desc``, a tensor among them (no TMA metadata: the base)
    as its address, so that nothing bound keeps the tensor alive."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return [_address(x) for x in make_tensordesc_arg(desc, meta)]


def _cached(cache: OrderedDict, base: torch.Tensor, make):
    """``make(base)``, made once per base address (LRU of ``_DESC_CACHE``)."""
    key = base.data_ptr()
    got = cache.get(key)
    if got is None:
        got = cache[key] = make(base)
        if len(cache) > _DESC_CACHE:
            cache.popitem(last=False)
    return got
