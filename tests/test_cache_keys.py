"""Triton cache keys of ditron_ops' kernels do not depend on the order a process keys them in
(``runtime.compiler.settle_cache_keys``): ``precompile`` keys the core kernels first, a user's
first fused call may key ``ag_gemm_push_kernel`` first, and both must find one on-disk entry.
Each order runs in a fresh process (keys are computed once per process), in compiled mode (no
GPU needed: only the keys, nothing is compiled)."""
import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, sys
from ditron_ops import _env
_env.use_interpreter = lambda: False  # dl.jit makes JITFunctions (nothing is compiled)
order, settle = sys.argv[1], sys.argv[2] == "1"
from ditron_ops.gemm import _ag_kernels, _core_kernels, _rs_kernels
from ditron_ops.attention import _flash_decode_kernels
from ditron_ops.runtime.compiler import settle_cache_keys
from triton.runtime.jit import JITFunction
fns = {f"{m.__name__}.{n}": v for m in (_ag_kernels, _core_kernels, _rs_kernels,
                                        _flash_decode_kernels)
       for n, v in vars(m).items() if isinstance(v, JITFunction) and v.__module__ == m.__name__}
first = {"push": [_ag_kernels.ag_gemm_push_kernel],
         "core": [_core_kernels.persistent_gemm_kernel],
         "reverse": [fns[n] for n in sorted(fns, reverse=True)]}[order]
if settle:
    settle_cache_keys()  # (before any key: as a BoundKernel request does)
for fn in first:
    fn.cache_key
settle_cache_keys()
print(json.dumps({n: fn.cache_key for n, fn in fns.items()}))
"""


def _keys(order: str, settle: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _SCRIPT, order, "1" if settle else "0"],
                          capture_output=True, text=True, env=env, cwd=_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cache_keys_do_not_depend_on_the_order_they_are_asked_in():
    """The push kernel keyed first (a fresh process's first fused fp8 call), the core kernel
    first (``precompile``'s order) and every kernel in reverse give every function one key;
    settling before any key is asked gives the same keys again."""
    push, core = _keys("push"), _keys("core")
    assert len(push) > 20 and "ditron_ops.gemm._ag_kernels.ag_gemm_push_kernel" in push
    assert push == core
    assert _keys("reverse") == core
    assert _keys("core", settle=True) == core

