"""GPU tier: ``ditron_ops.compile`` at W = 1 with the nvshmem backend at one PE (fresh process):
hand-written functional collectives (which stay in the graph at one rank) become
``ditron.ag_gemm`` / ``gemm_rs`` / ``gemm_ar`` with symmetric memory behind them, bf16, against
eager; deterministic mode bitwise repeatable. DTensor bodies are not run here: at one rank
DTensor emits no collective, so the pass has nothing to rewrite (they run on 2 and 3 gloo
processes in the CPU tier, ``tests/test_compile_pass.py``).

Virtual worlds are not covered: they have no torch process group for a compiled graph to name
(docs/compile.md)."""
import json
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def _child(tmpdir: str) -> dict:
    from ditron_ops.testing.checks import one_pe_nvshmem
    from ditron_ops.testing.compile_checks import funcol_body

    with one_pe_nvshmem(tmpdir) as group:
        res = funcol_body(group, torch.bfloat16, rows=256, k=512, n=768)
        res["backend"] = group.backend
    return res


@pytest.mark.nvshmem
def test_compile_pass_nvshmem_one_pe():
    from ditron_ops.runtime import nvshmem_backend

    if not nvshmem_backend.nvshmem_available():
        pytest.skip("needs nvshmem4py (pip install 'ditron_ops[cu13]')")
    import tempfile

    from ditron_ops.testing.checks import run_child

    with tempfile.TemporaryDirectory() as tmp:
        res = run_child(__file__, tmp)
    assert res["backend"] == "nvshmem", res
    for det in ("False", "True"):
        r = res[det]
        assert r["rewritten"] == ["ag_gemm", "gemm_ar", "gemm_rs"] and not r["left"], r
        assert r["shape_ok"] and r["max_err"] <= 3e-2 * max(1.0, r["scale"]), r
    assert res["True"]["repeat_equal"], res


if __name__ == "__main__":
    print("RESULT " + json.dumps(_child(sys.argv[1])), flush=True)
