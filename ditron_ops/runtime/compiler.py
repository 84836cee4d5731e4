"""Compiling kernels when a plan needs them: in parallel, once per process, with progress.

Nothing is compiled ahead of time (``precompile`` aside): a call's plan (``plan.PlanCache``)
is built inside ``batch``, and every ``BoundKernel`` it makes goes through ``prepare``. On a
GPU that asks Triton for the kernel's variant with Triton's asynchronous compile mode active,
so a variant missing from Triton's in-memory cache is compiled on a process-wide thread pool
(``os.cpu_count()`` workers; Triton's passes, LLVM and ptxas run outside the GIL) while the
plan goes on building; the batch binds every kernel (module load included) when the build
ends, before the plan is returned, hence before the call reaches any launch. Threads asking
for the same variant (the ranks of a virtual world) share one compile. In the Triton
interpreter there is nothing to compile and ``prepare`` returns at once.

Two consumers of the bookkeeping:

* ``paused_since`` / ``busy``: a virtual world's host barriers do not count time while any
  compile or module load of the process is running (a rank compiling its plan for 20 s must
  not time out peers waiting for it at the launch gate; ``virtual.VirtualWorld.meet``).
* progress: when compiles have run for more than ``PROGRESS_AFTER_S``, one line on stderr
  names what is being built and how many of the kernels are done (redrawn in place on a
  terminal); silent when everything is cached.

Relies on Triton's ``runtime._async_compile`` (``AsyncCompileMode``'s hook; imported by the
first ``batch``); a Triton without it compiles on the calling thread, one kernel after another.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from typing import Callable, Optional

from .. import _env

_async_compile = None
"""Triton's asynchronous-compile hook (``JITFunction._do_compile`` asks ``active_mode``), imported
by the first ``batch`` (``import ditron_ops`` imports no Triton); None on a Triton without it."""
_hooked = False

PROGRESS_AFTER_S = 2.0
"""Compiles that run longer than this get a progress line (shorter ones stay silent)."""

_lock = threading.RLock()
_local = threading.local()  # .batch: the kernels of this thread's open batch (a list)
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_futures: dict = {}  # (device index, Triton cache key) -> Future of the compiled kernel
_running = 0  # compiles and module loads in flight in this process
_paused_since = time.monotonic()  # when the process last stopped compiling (or started)
compiled = 0
"""Compiles submitted in this process (a variant Triton's in-memory cache did not hold;
its disk cache may still have had it)."""


def workers() -> int:
    """Threads of the compile pool: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# -- bookkeeping (barrier clocks, progress) ---------------------------------------------------
def busy() -> bool:
    """True while a compile or module load runs in this process."""
    return _running > 0


def paused_since() -> float:
    """``time.monotonic()`` when the process last went idle from compiling: barrier clocks
    start from here (or from the wait's own start, whichever is later)."""
    return _paused_since


def _begin(what: str, jobs: int) -> None:
    global _running
    with _lock:
        _running += 1
        if jobs:
            progress.add(what, jobs)


def _end(jobs: int) -> None:
    global _running, _paused_since
    with _lock:
        _running -= 1
        if jobs:
            progress.finish(jobs)
        if _running == 0:
            _paused_since = time.monotonic()
            progress.close()


@contextlib.contextmanager
def activity(what: str, jobs: int = 0):
    """Mark work on this thread (a synchronous compile, module loads) as compiling: barrier
    clocks pause meanwhile; ``jobs`` kernels count toward the progress line's total."""
    _begin(what, jobs)
    try:
        yield
    finally:
        _end(jobs)


def submit(key, compile_fn: Callable, what: str) -> concurrent.futures.Future:
    """``compile_fn()`` on the pool, once per ``key`` in this process (later callers get the
    first caller's future)."""
    global _pool, compiled
    with _lock:
        future = _futures.get(key)
        if future is None:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(
                    workers(), thread_name_prefix="ditron-compile")
            compiled += 1
            _begin(what, 1)
            future = _futures[key] = _pool.submit(compile_fn)
            future.add_done_callback(lambda _: _end(1))
    return future


def wait(futures) -> None:
    """Wait for ``futures``, drawing the progress line meanwhile."""
    pending = {f for f in futures if not f.done()}
    while pending:
        _, pending = concurrent.futures.wait(pending, timeout=0.25)
        with _lock:
            progress.tick()


# -- cache keys -------------------------------------------------------------------------------
_settle_lock = threading.Lock()
_settled: set = set()  # ids of the JIT functions whose cache keys are settled (never reset)
_scanned_modules = -1  # len(sys.modules) at the last scan


def settle_cache_keys(fn=None) -> None:
    """Give every JIT function of ditron_ops (``dl.jit`` and Gluon kernels; ``fn`` too, where
    given) the cache key it has when each function it calls was keyed first, whatever order
    this process asks in.

    Why: Triton 3.6's ``JITFunction.cache_key`` merges a callee's global constexprs before it
    keys that callee, so a kernel keyed before its helpers gets another on-disk key, and a
    variant ``precompile`` cached compiled again at a fresh process's first call
    (benchmarks/NOTES.md, cold start).
    Here every unsettled function is re-keyed until no key changes (each pass carries the
    callees' globals one call level up), so the keys are those of a callee-first order.
    Functions settled once keep their keys (they and everything they call are complete).
    Called before any kernel of ours is compiled (``BoundKernel`` requests, direct launches);
    a module still being imported (another thread's) is scanned again at the next call."""
    global _scanned_modules
    if ((_scanned_modules == len(sys.modules) and (fn is None or id(fn) in _settled))
            or _env.use_interpreter()):
        return
    from triton.runtime.jit import JITFunction
    with _settle_lock:
        seen, complete = len(sys.modules), True
        fresh = [fn] if isinstance(fn, JITFunction) and id(fn) not in _settled else []
        for name, module in list(sys.modules.items()):
            if not name.startswith("ditron") or module is None:
                continue
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                complete = False  # (its body still runs: kernels below may be missing)
            fresh += [f for f in list(vars(module).values())
                      if isinstance(f, JITFunction) and id(f) not in _settled]
        fresh = list({id(f): f for f in fresh}.values())
        keys = None
        while True:
            for f in fresh:
                f.hash = None
            now = [_key_or_none(f) for f in fresh]
            if now == keys:
                break
            keys = now
        for f, key in zip(fresh, keys):
            if key is None:  # (a caller's failed key may have left its recursion placeholder)
                f.hash = None
        fresh = [f for f, key in zip(fresh, keys) if key is not None]
        _settled.update(id(f) for f in fresh)
        _scanned_modules = seen if complete else -1  # (last: others wait for the lock)


def _key_or_none(fn):
    """``fn.cache_key``, or None where this Triton cannot key it (a Gluon API it lacks): such a
    function is left unsettled, and a kernel using it fails at its own compile, as before."""
    try:
        return fn.cache_key
    except Exception:  # noqa: BLE001 - reported by the kernel's own compile, if it is compiled
        fn.hash = None
        return None


# -- batches ----------------------------------------------------------------------------------
def _hook():
    """``_async_compile``, imported on first use (None on an older Triton: serial compiles)."""
    global _async_compile, _hooked
    if not _hooked:
        try:
            from triton.runtime import _async_compile as hook
        except ImportError:  # pragma: no cover - an older Triton
            hook = None
        _async_compile, _hooked = hook, True
    return _async_compile


class _Mode:
    """What Triton's ``active_mode`` holds while a batch is open on a thread: its ``submit``
    sends a compile to the pool (``_do_compile`` calls it on an in-memory cache miss)."""

    def __init__(self, what: str):
        self.what = what

    def submit(self, key, compile_fn, finalize_fn):
        from triton.runtime.driver import driver

        # per device: a compiled kernel's module is loaded on one device
        future = submit((driver.active.get_current_device(), key), compile_fn, self.what)
        return _async_compile.FutureKernel(finalize_fn, future)


@contextlib.contextmanager
def batch(what: str):
    """Build a plan (or several kernels) inside: every ``BoundKernel`` made here compiles on
    the pool and is bound when the block ends. ``what`` names it in the progress line.

    Nested batches bind their own kernels at their end (Triton's mode stays the outer one)."""
    outer = getattr(_local, "batch", None)
    kernels: list = []
    _local.batch = kernels
    token = None
    hook = _hook()
    if hook is not None and hook.active_mode.get() is None:
        token = hook.active_mode.set(_Mode(what))
    try:
        yield
        if kernels:
            wait([k._pending.future for k in kernels if hasattr(k._pending, "future")])
            with activity(what):  # module loads: barrier clocks stay paused
                for kernel in kernels:
                    kernel._bind()
    finally:
        _local.batch = outer
        if token is not None:
            hook.active_mode.reset(token)


def prepare(kernel) -> None:
    """Called by every ``BoundKernel`` when it is made: on a GPU, request its compiled variant
    and bind it at the end of the ``batch`` it is made in (after it and its siblings compiled
    in parallel; outside a batch, in a batch of its own, now); in the interpreter there is
    nothing to compile."""
    if not kernel.compiles:
        return
    kernels = getattr(_local, "batch", None)
    if kernels is None:  # a batch of one: the pool compiles it, the wait draws progress
        with batch(kernel.name):
            prepare(kernel)
        return
    if _async_compile is None:  # a Triton without the hook compiles here: pause barrier clocks
        with activity(kernel.name, 1):
            kernel._request()
    else:
        kernel._request()
    kernels.append(kernel)


# -- progress ---------------------------------------------------------------------------------
class Progress:
    """The progress line of one compiling period (first compile until the process is idle).

    Parameters
    ----------
    stream : file, optional
        Where the line goes (default ``sys.stderr`` at write time).
    clock : callable
        Seconds (``time.monotonic``; tests pass a fake).
    after_s : float
        Silent until the period is this old.
    """

    def __init__(self, stream=None, clock: Callable[[], float] = time.monotonic,
                 after_s: float = PROGRESS_AFTER_S):
        self.stream, self.clock, self.after_s = stream, clock, after_s
        self._reset()

    def _reset(self) -> None:
        self.total = self.done = 0
        self.names: list[str] = []
        self.start: Optional[float] = None
        self.shown = False

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def add(self, what: str, jobs: int) -> None:
        if self.start is None:
            self.start = self.clock()
        self.total += jobs
        if what not in self.names:
            self.names.append(what)

    def finish(self, jobs: int) -> None:
        self.done += jobs

    def line(self) -> str:
        names = ", ".join(self.names[:4]) + (", ..." if len(self.names) > 4 else "")
        return (f"ditron: compiling kernels for {names}: {self.done}/{self.total} done "
                f"({self.clock() - self.start:.0f} s; first use, cached afterwards)")

    def tick(self) -> None:
        """Draw the line if the period is older than ``after_s`` (in place on a terminal;
        elsewhere once)."""
        if self.start is None or self.clock() - self.start < self.after_s:
            return
        out = self._out()
        if getattr(out, "isatty", lambda: False)():
            out.write("\r" + self.line())
        elif not self.shown:
            out.write(self.line() + "\n")
        else:
            return
        out.flush()
        self.shown = True

    def close(self) -> None:
        """The period ended: finish the line if one was drawn; start afresh."""
        if self.shown:
            out = self._out()
            tty = getattr(out, "isatty", lambda: False)()
            done = (f"ditron: compiled {self.done} kernel(s) for {', '.join(self.names[:4])} in "
                    f"{self.clock() - self.start:.1f} s")
            out.write(("\r" + done + "\n") if tty else done + "\n")
            out.flush()
        self._reset()


progress = Progress()
