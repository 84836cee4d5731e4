"""Multi-GPU tier: ``ditron_ops.testing.torchrun_checks`` under torchrun, one process per GPU.

Runs on a machine with at least two GPUs (the nvshmem backend when nvshmem4py imports, else the
torch backend); skips otherwise. The suite's own docstring lists what it checks; this test
asserts that every check reported ok, that the run ended with ``ALL OK``, and that the rank
which waited for a skipped call raised ``DitronTimeoutError`` instead of hanging.
"""
import os
import subprocess
import sys

import pytest
import torch

from ditron_ops.runtime.torchrun import NO_MULTICAST

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
LIMIT_S = 240
CHECKS = ("collectives", "ag_gemm", "gemm_rs / gemm_ar", "flash_decode", "ulysses_attention",
          "CUDA graphs", "back-to-back", "timeout")


@pytest.mark.skipif(GPUS < 2, reason="needs at least 2 GPUs (one process per GPU)")
@pytest.mark.parametrize("nproc", sorted({2, GPUS} - {0, 1}))
def test_torchrun_checks(nproc):
    # a stall dumps every rank's stack (--dump-after) before the hard limit kills it
    env = {**os.environ, **NO_MULTICAST}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "ditron_ops.testing.torchrun_checks",
           "--dump-after", str(LIMIT_S - 60)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() + (exc.stderr or b"").decode() \
            if isinstance(exc.stdout, bytes) else (exc.stdout or "") + (exc.stderr or "")
        pytest.fail(f"the torchrun checks did not finish in {LIMIT_S} s:\n{out[-8000:]}")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    for name in CHECKS:
        assert any(line.startswith("CHECK ") and name in line and line.endswith(" ok")
                   for line in proc.stdout.splitlines()), \
            f"no 'CHECK {name} ... ok' line:\n{log[-4000:]}"
    assert "ALL OK" in proc.stdout
    assert "DitronTimeoutError after" in proc.stdout
