"""The interpreter shim (``language._jit``) with a grid's programs on threads of their own."""
import pytest
import torch
import triton.language as tl

from ditron_ops.language._jit import jit
from ditron_ops.testing.interpreter import programs_as_threads

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


@jit
def _plus_one(x):
    return x + 1


@jit
def _plus_one_kernel(ptr):
    i = tl.program_id(0)
    tl.store(ptr + i, _plus_one(tl.load(ptr + i)))


def test_helpers_on_program_threads_leave_the_language_unpatched():
    """A ``@jit`` helper called on a program's own thread (``programs_as_threads``) is covered
    by the launch's patch of ``triton.language``, which the launch restores: the helper's own
    patch (Triton never restores it) once left the language patched for the process, and a
    later compile failed ("Only `range` and `static_range` iterators")."""
    out = torch.zeros(3, dtype=torch.int32)
    _plus_one_kernel[(3, )](out)  # (on this thread: the interpreter shim installed)
    with programs_as_threads():
        _plus_one_kernel[(3, )](out)
    assert out.tolist() == [2, 2, 2]
    assert isinstance(tl.static_range, type) and isinstance(tl.core.static_range, type)
