"""GPU tier: the README's Python blocks on the GPU (torchrun blocks as one process: NVSHMEM at one
PE when nvshmem4py is installed), and the public ops' docstring examples on the GPU."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ditron_ops.testing.docs import check_plain_output, run_plain_blocks, run_torchrun_blocks

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_python_blocks_run_on_gpu(tmp_path):
    check_plain_output(run_plain_blocks(README, tmp_path, timeout=220), gpu=True)


def test_readme_torchrun_blocks_run_on_one_gpu(tmp_path):
    for out in run_torchrun_blocks(README, tmp_path, procs=1, timeout=220):
        assert out.strip().splitlines()[0].split()[0] == "0", out


def test_docstring_examples_on_gpu():
    """The doctests of the public modules (pyproject's testpaths) in a fresh process."""
    paths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    modules = [p for p in paths if p.endswith(".py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-4000:]
