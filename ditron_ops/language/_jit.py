"""``jit``: compile with Triton on a GPU process, interpret on a CPU process.

The choice is made once per process (``_env.use_interpreter``) without touching Triton's global
knobs, so importing ditron_ops changes nothing for other Triton users. In interpreter mode the
virtual world runs ranks as threads, each interpreting its own kernel; Triton's interpreter keeps
the program id in a process-global builder, patches ``triton.language`` per launch and parses
kernel sources on first use, so ``_make_interpreter_thread_safe`` (applied on the first
interpreted launch, only in a process that interprets) makes the grid index thread-local, the
language patch reference-counted and the source rewrite serialized. It also types the
interpreter's comparison results ``int1`` (``_type_comparisons_as_int1``), so a mask built
from a scalar comparison stays boolean when broadcast, as Triton 3.9's interpreter requires.
"""
from __future__ import annotations

import sys
import threading

import triton

from .._env import use_interpreter

_shim_lock = threading.Lock()
_shim_installed = False


def _make_interpreter_thread_safe() -> None:
    global _shim_installed
    with _shim_lock:
        if _shim_installed:
            return
        from triton.runtime import interpreter as interp

        original_patch = interp._patch_lang
        state = {"depth": 0, "scope": None}
        lock = threading.Lock()

        class _SharedScope:
            def restore(self) -> None:
                with lock:
                    state["depth"] -= 1
                    if state["depth"] == 0:
                        state["scope"].restore()
                        state["scope"] = None

        class _NoScope:
            def restore(self) -> None:
                pass

        import types

        import triton.language as tl

        # Patch both triton.language and triton.language.core whatever the kernel imported, so
        # nested helpers (which may use either) see the interpreter's builtins.
        both = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})

        helper_call = interp.InterpretedFunction.__call__.__code__

        def shared_patch(fn):
            # A device-function call inside a launch patches again and never restores (Triton's
            # ``InterpretedFunction.__call__``): counted, it left the language patched for the
            # process, and every later compile in it failed ("Only `range` and `static_range`").
            # The launch's own patch covers its calls, on whatever thread a program runs: a
            # patch asked for by that method is skipped.
            if sys._getframe(1).f_code is helper_call:
                return _NoScope()
            with lock:
                if state["depth"] == 0:
                    state["scope"] = original_patch(both)
                state["depth"] += 1
            return _SharedScope()

        local = threading.local()

        def _prop(name):
            return property(lambda self: getattr(local, name), lambda self, v: setattr(local, name, v))

        interp._patch_lang = shared_patch
        interp.InterpreterBuilder.grid_idx = _prop("grid_idx")
        interp.InterpreterBuilder.grid_dim = _prop("grid_dim")

        # triton.language's own @jit helpers (tl.zeros, tl.cdiv, ...) were compiled-mode objects
        # when triton was imported without TRITON_INTERPRET; interpret them when called from an
        # interpreted kernel (this process never compiles, so nothing else is affected).
        from triton.runtime.jit import JITFunction

        interpreted: dict = {}

        def _call_interpreted(self, *args, **kw):
            fn = interpreted.get(self.fn)
            if fn is None:
                fn = interpreted.setdefault(self.fn, interp.InterpretedFunction(self.fn))
            return fn(*args, **kw)

        JITFunction.__call__ = _call_interpreted

        # The first call of each kernel parses its source (ast.parse). CPython 3.11's parser is
        # not thread-safe ("AST constructor recursion depth mismatch", seen in CI when two
        # virtual ranks started the same kernel together): parse one kernel at a time.
        original_rewrite = interp.InterpretedFunction.rewrite
        rewrite_lock = threading.RLock()

        def locked_rewrite(self):
            with rewrite_lock:
                return original_rewrite(self)

        interp.InterpretedFunction.rewrite = locked_rewrite
        _type_comparisons_as_int1(interp)
        _shim_installed = True


def _type_comparisons_as_int1(interp) -> None:
    """Tag the interpreter's comparison results ``int1``, as the language types them.

    Triton's interpreter computes ``a < b`` as a numpy bool array but labels its handle with the
    *operand's* type (``binary_op`` keeps ``lhs.dtype``), while the ``tl.tensor`` around it is
    ``int1``. A block comparison never notices, but broadcasting a *scalar* comparison
    (``(offs < n) & (flag != 0)``, ``mask=s < slices`` on a block of pointers,
    ``tl.where(flag != 0, ...)``) splats by the handle's label and turns the bools into int32
    0/1. Triton 3.4-3.6 loaded and stored through such a mask anyway; 3.9's interpreter rejects
    it (``mask has unsupported dtype``). The kernels' masks are ``int1`` in the language and on
    the GPU; this makes the interpreter's data agree. Values are unchanged (the same bools).
    """
    import triton.language as tl

    builder = interp.InterpreterBuilder
    TensorHandle = interp.TensorHandle
    for name in dir(builder):
        if not (name.startswith("create_icmp") or name.startswith("create_fcmp")):
            continue
        compare = getattr(builder, name)

        def typed(self, lhs, rhs, _compare=compare):
            out = _compare(self, lhs, rhs)
            return TensorHandle(out.data.astype(bool, copy=False), tl.int1)

        setattr(builder, name, typed)


def _interpreted(fn, **kwargs):
    from triton.runtime.interpreter import InterpretedFunction

    class _ThreadSafeInterpretedFunction(InterpretedFunction):
        def run(self, *args, **kw):
            _make_interpreter_thread_safe()
            return super().run(*args, **kw)

    return _ThreadSafeInterpretedFunction(fn, **kwargs)


def jit(fn=None, *, do_not_specialize=(), **kwargs):
    """``triton.jit`` on a GPU process, the Triton interpreter on a CPU process.

    Integer arguments that change from call to call (rank, epoch, sizes) must be listed in
    ``do_not_specialize``: a new specialization means a compile and a module load while peers
    spin, which deadlocks virtual ranks sharing one GPU.
    """

    def decorate(f):
        if use_interpreter():
            return _interpreted(f, do_not_specialize=tuple(do_not_specialize), **kwargs)
        return triton.jit(f, do_not_specialize=tuple(do_not_specialize), **kwargs)

    return decorate if fn is None else decorate(fn)
