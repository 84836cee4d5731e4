"""``import ditron_ops`` is cheap (issue 42): it defines the ops but imports no Triton, no kernel
and nothing else heavy until an op runs (``runtime.lazy``).

Measured in fresh processes: ``import torch``, then ``import ditron_ops``; the second's time is
what the package adds. The target is 0.5 s on the CPU dev machine and the H200 machine; the
bound here is generous because CI machines are shared and noisy.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

EXTRA_BOUND_S = 1.5
"""``import ditron_ops`` after ``import torch`` (min of ``RUNS``); measured 0.14 s on the CPU dev
machine (Triton and every family's kernels imported at import: 0.69 s)."""
RUNS = 3
HEAVY = ("triton", "torch._dynamo", "torch._inductor", "matplotlib", "nvshmem", "cuda.core")
"""Packages ``import ditron_ops`` must not import (unless ``import torch`` already did)."""

_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
after_torch = set(sys.modules)
import ditron_ops
t2 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "ditron_s": t2 - t1,
                  "added": sorted(set(sys.modules) - after_torch)}))
"""


def _probe() -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    return [_probe() for _ in range(RUNS)]


def _heavy(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY)


def test_import_imports_nothing_heavy(probes):
    added = probes[0]["added"]
    assert not [m for m in added if _heavy(m)], [m for m in added if _heavy(m)]
    # the kernels and their launch code wait for first use too
    ours = [m for m in added if m.startswith("ditron_ops.")]
    assert not [m for m in ours if m.endswith(("_kernels", "_launch", ".launcher", "._core"))
                or m.startswith("ditron_ops.language")], ours


def test_import_costs_little_more_than_torch(probes):
    torch_s = min(p["torch_s"] for p in probes)
    extra_s = min(p["ditron_s"] for p in probes)
    assert extra_s < EXTRA_BOUND_S, (f"import ditron_ops took {extra_s:.2f} s after import torch "
                                     f"({torch_s:.2f} s); bound {EXTRA_BOUND_S} s")


def test_lazy_import_binds_the_module_on_first_use():
    from ditron_ops.runtime.lazy import LazyModule, lazy_import

    importer = {"__name__": "probe", "__package__": "ditron_ops.runtime"}
    importer["split"] = importer["alias"] = lazy_import(".split", importer)
    assert isinstance(importer["split"], LazyModule)
    assert importer["split"].split_sizes(5, 2) == [3, 2]
    module = sys.modules["ditron_ops.runtime.split"]
    assert importer["split"] is module and importer["alias"] is module  # no placeholder left


def test_lazily_imported_names_stay_reachable():
    """The public names and the module attributes code reaches for load on first access."""
    import ditron_ops

    assert callable(ditron_ops.gemm.matmul)
    from ditron_ops.gemm import matmul

    assert matmul is sys.modules["ditron_ops.gemm._core"].matmul
    from ditron_ops.runtime.precompile import families

    served = {op for ops in families().values() for op in ops}
    assert {"all_gather", "all_to_all", "ag_gemm", "gemm_rs", "flash_decode", "ulysses_attention",
            "moe_dispatch", "matmul"} <= served
