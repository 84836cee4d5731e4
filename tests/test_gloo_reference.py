"""torch-reference backend: the same torch.ops.ditron ops over a gloo process group (2-3 processes)."""
import pytest
import torch

import ditron_ops
from ditron_ops.testing import run_gloo


def _ops_on_torch_group(group, rows, cols):
    torch.manual_seed(0)
    xs = [torch.randn(rows, cols) for _ in range(group.world_size)]  # every rank knows all inputs
    x = xs[group.rank]
    total = sum(t.double() for t in xs)
    sizes = ditron_ops.split_sizes(rows, group.world_size)
    start = sum(sizes[: group.rank])
    checks = {
        "all_gather": torch.equal(ditron_ops.all_gather(x, group), torch.cat(xs)),
        "uneven": torch.equal(ditron_ops.all_gather(x[: group.rank + 1], group,
                                                    shard_sizes=list(range(1, group.world_size + 1))),
                              torch.cat([t[: q + 1] for q, t in enumerate(xs)])),
        "reduce_scatter": torch.allclose(ditron_ops.reduce_scatter(x, group).double(),
                                         total[start: start + sizes[group.rank]], atol=1e-5),
        "all_reduce": torch.allclose(ditron_ops.all_reduce(x, group).double(), total, atol=1e-5),
        "backend": group.backend == "torch" and not group.has_symmetric_memory,
    }
    return checks


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_backend_over_gloo(world_size):
    results = run_gloo(_ops_on_torch_group, world_size, args=(7, 5))
    for rank, checks in enumerate(results):
        assert all(checks.values()), (rank, checks)


def _self_checks(group):
    from ditron_ops.selfcheck import run_checks

    return [(name, ok) for name, _, _, ok in run_checks(group, torch.float32, 1)]


def test_every_op_over_gloo():
    """Every registered self-check but those needing symmetric memory (moe) on the
    torch backend: the paths a torchrun job without symmetric memory takes."""
    results = run_gloo(_self_checks, 2)
    for rank, rows in enumerate(results):
        assert rows and all(ok for _, ok in rows), (rank, rows)


def _torchrun_cpu(args, timeout=240):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_tp_mlp_example_on_cpu():
    """``examples/tp_mlp_torchrun.py`` (ag_gemm -> gelu -> gemm_rs, trained with autograd) on 2
    CPU processes: it checks its own first step against one process and that the loss falls."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "tp_mlp_torchrun.py"
    out = _torchrun_cpu([str(example)])
    assert "2 ranks, torch backend" in out and "losses:" in out, out[-2000:]


def test_torchrun_checks_suite_on_cpu():
    """The multi-GPU suite's own code, under torchrun with 2 CPU processes (torch backend, gloo):
    a Python error in it shows here instead of on a lent multi-GPU machine."""
    out = _torchrun_cpu(["-m", "ditron_ops.testing.torchrun_checks"])
    assert "torch backend" in out and "ALL OK" in out, out[-2000:]


def _layout_agreement(group):
    from ditron_ops.runtime import nccl

    nccl._agree(group, "all_gather", ((4, 2), (4, 4), torch.float32))  # all ranks agree
    agreed = ("all_gather (NCCL)", (("layout", ((4, 2), (4, 4), torch.float32)),)) in group._agreed
    try:  # a new layout on which rank 1 disagrees (6 rows, 5 elsewhere): all raise, none hangs
        rows = 5 + (group.rank == 1)
        nccl._agree(group, "all_gather", ((rows, 2), (rows, rows), torch.float32))
    except ditron_ops.DitronMismatchError as exc:
        return agreed, exc.op
    return agreed, "no error"


def test_nccl_paths_agree_on_layouts_first():
    """The NCCL fast paths (which cannot detect size disagreements) check each new layout with
    the peers once: a disagreement raises DitronMismatchError on every rank."""
    assert run_gloo(_layout_agreement, 2) == [(True, "all_gather (NCCL)")] * 2
