"""``precompile``: fill the Triton cache with every kernel variant ahead of time (deployment
images, CI), in parallel, with progress.

Calls need none of it: a call's plan compiles what the call launches (``plan.PlanCache``,
``compiler.batch``). Each op family registers a function that makes a ``BoundKernel`` of each
of its variants for the given dtypes as a one-rank launch (nothing is launched); ``precompile``
runs them inside one ``compiler.batch``, so every variant compiles on the pool at once. The
families register when their launch modules are imported, which ``import ditron_ops`` does not
do (``runtime.lazy``): ``families`` and ``precompile`` import every module of ``FAMILY_MODULES``
first.
"""
from __future__ import annotations

import importlib
import time
from typing import Callable, Iterable, Optional

import torch

from .. import _env
from . import compiler

_registry: dict[str, tuple[Callable, tuple[str, ...]]] = {}
FAMILY_MODULES = ("ditron_ops.collectives._launch", "ditron_ops.collectives.all_to_all",
                  "ditron_ops.collectives._norm_launch",
                  "ditron_ops.gemm._core_precompile", "ditron_ops.gemm._ag_launch", "ditron_ops.gemm._rs_launch",
                  "ditron_ops.gemm.scaled",
                  "ditron_ops.attention.flash_decode", "ditron_ops.attention.ulysses",
                  "ditron_ops.moe._launch")
"""The modules that call ``register_precompile``, in the order their families run."""
DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
               "fp8": torch.float8_e4m3fn}


def pointer_table(*tensors: torch.Tensor) -> torch.Tensor:
    """``int64`` device table of the tensors' base addresses (a one-rank symmetric buffer)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


def one_rank_pad(device: torch.device, preset=()) -> tuple:
    """What a one-rank launch needs, where no wait can block: a signal pad (``int64 [16]``,
    first words ``preset``), its pointer table, the error claim word and the host-readable
    error record (pinned on CUDA)."""
    from .error_record import ERR_WORDS

    sig = torch.zeros(16, dtype=torch.int64, device=device)
    if preset:
        sig[:len(preset)] = torch.tensor(list(preset), dtype=torch.int64)
    claim = torch.zeros(1, dtype=torch.int64, device=device)
    record = torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=device.type == "cuda")
    return sig, pointer_table(sig), claim, record


def register_precompile(family: str, fn: Callable[[torch.device, tuple], None],
                        ops: Iterable[str]) -> None:
    """Register ``fn(device, dtypes)``, which makes a ``BoundKernel`` of every variant of the
    op family ``family`` (serving ``ops``) for ``dtypes``."""
    _registry[family] = (fn, tuple(ops))


def _families() -> dict[str, tuple[Callable, tuple[str, ...]]]:
    """``_registry`` once every family module is imported, in ``FAMILY_MODULES`` order."""
    for module in FAMILY_MODULES:
        importlib.import_module(module)
    rank = {module: i for i, module in enumerate(FAMILY_MODULES)}
    return dict(sorted(_registry.items(),
                       key=lambda item: rank.get(getattr(item[1][0], "__module__", None), len(rank))))


def families() -> dict[str, tuple[str, ...]]:
    """Registered family -> the ops it serves."""
    return {name: ops for name, (_, ops) in _families().items()}


def _select(ops: Optional[Iterable[str]]) -> list[str]:
    registry = _families()
    if ops is None:
        return list(registry)
    chosen = []
    for op in ops:
        found = [name for name, (_, serves) in registry.items() if op == name or op in serves]
        if not found:
            known = sorted(set(registry) | {o for _, serves in registry.values() for o in serves})
            raise ValueError(f"ditron.precompile: unknown op {op!r}; known: {', '.join(known)}")
        chosen += [name for name in found if name not in chosen]
    return chosen


def _dtypes(dtypes) -> tuple:
    if dtypes is None:
        return tuple(DTYPE_NAMES.values())
    out = []
    for d in dtypes:
        if isinstance(d, str):
            if d not in DTYPE_NAMES:
                raise ValueError(f"ditron.precompile: unknown dtype {d!r}; known: "
                                 f"{', '.join(DTYPE_NAMES)}")
            d = DTYPE_NAMES[d]
        out.append(d)
    return tuple(out)


def precompile(ops: Optional[Iterable[str]] = None, dtypes=None, device=None,
               progress_after_s: float = 0.0) -> dict:
    """Compile (or load from the Triton cache) every kernel variant of ``ops`` for ``dtypes``.

    Parameters
    ----------
    ops : iterable of str, optional
        Op names (``"all_reduce"``, ``"ag_gemm"``, ...) or family names; default all.
    dtypes : iterable of str or torch.dtype, optional
        ``"fp16"``, ``"bf16"``, ``"fp32"``, ``"fp8"`` (e4m3 operands: the fp8 ops, into the
        fp16 / bf16 also named, else bf16) (default all); a family skips dtypes it lacks.
    device : torch.device, optional
        Default the current CUDA device.
    progress_after_s : float
        Draw the progress line once compiling took this long (default at once).

    Returns
    -------
    dict
        ``kernels`` (variants compiled or loaded from the disk cache in this call),
        ``seconds``, ``families`` (those run), ``device`` (None in the interpreter, where
        there is nothing to compile).
    """
    names, wanted = _select(ops), _dtypes(dtypes)
    if _env.use_interpreter() or not torch.cuda.is_available():
        return {"kernels": 0, "seconds": 0.0, "families": names, "device": None}
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    before, start = compiler.compiled, time.perf_counter()
    saved, compiler.progress.after_s = compiler.progress.after_s, progress_after_s
    try:
        what = "precompile " + ", ".join(names)
        # one compiling period (one progress line) however the pool's jobs interleave
        with torch.cuda.device(device), compiler.activity(what), compiler.batch(what):
            for name in names:
                _registry[name][0](device, wanted)
        torch.cuda.synchronize(device)
    finally:
        compiler.progress.after_s = saved
    return {"kernels": compiler.compiled - before, "seconds": time.perf_counter() - start,
            "families": names, "device": str(device)}
