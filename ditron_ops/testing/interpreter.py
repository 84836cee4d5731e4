"""Interpreter-tier test helpers: a grid's programs on threads of their own."""
from __future__ import annotations

import contextlib
import inspect
import threading


@contextlib.contextmanager
def programs_as_threads():
    """The interpreter runs a grid's programs one after another; inside this block each runs in
    its own thread, like co-resident programs on a GPU (so waiting kernels may have several per
    rank)."""
    from triton.runtime import interpreter as interp

    original = interp.GridExecutor.__call__

    def threaded(self, *args_dev, **kwargs):
        names = inspect.getfullargspec(self.fn).args
        kwargs = {k: v for k, v in kwargs.items() if k in names}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
        scope = interp._patch_lang(self.fn)
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            args = {n: a if n in self.constexprs else interp._implicit_cvt(a)
                    for n, a in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            errors = []

            def program(x, y, z):
                try:
                    interp.interpreter_builder.set_grid_dim(*grid)
                    interp.interpreter_builder.set_grid_idx(x, y, z)
                    self.fn(**args)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            threads = [threading.Thread(target=program, args=(x, y, z)) for x in range(grid[0])
                       for y in range(grid[1]) for z in range(grid[2])]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
        finally:
            scope.restore()
        self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    interp.GridExecutor.__call__ = threaded
    try:
        yield
    finally:
        interp.GridExecutor.__call__ = original
