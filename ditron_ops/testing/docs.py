"""The Python blocks of the README and of the reference pages under ``docs/``, run as written
(CPU tier: ``tests/test_readme.py``; GPU tier: ``tests/gpu/test_readme_gpu.py``).

A page's blocks run in order in one fresh process started in the repository root, as a reader
runs them top to bottom (a block may use names an earlier block of the same page defined). A
block whose first line is ``# needs: torchrun`` runs alone under ``torchrun`` (one process per
GPU on a GPU machine, gloo processes on a CPU). Blocks check what they claim with ``assert``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

TORCHRUN = "# needs: torchrun"
ROOT = Path(__file__).resolve().parents[2]


def doc_pages(root: Path = ROOT) -> list[Path]:
    """The reference pages: ``docs/*.md``, sorted."""
    return sorted((root / "docs").glob("*.md"))


def readme_blocks(page: Path) -> tuple[list[str], list[str]]:
    """``(plain, torchrun)``: a page's ```python blocks, split by their first line."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    return ([b for b in blocks if not b.startswith(TORCHRUN)],
            [b for b in blocks if b.startswith(TORCHRUN)])


doc_blocks = readme_blocks


def _run(cmd: list[str], root: Path, timeout: float) -> str:
    paths = [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc.stdout


def _root_of(page: Path) -> Path:
    """The repository root above ``page`` (the folder holding ``pyproject.toml``)."""
    for folder in page.resolve().parents:
        if (folder / "pyproject.toml").exists():
            return folder
    return page.resolve().parent


def run_plain_blocks(page: Path, workdir: Path, timeout: float = 600) -> str:
    """Run a page's plain blocks in one process (AssertionError with the output on failure);
    its stdout."""
    plain, _ = readme_blocks(page)
    script = workdir / f"{page.stem}_blocks.py"
    script.write_text("\n\n".join(plain))
    return _run([sys.executable, str(script)], _root_of(page), timeout)


def check_plain_output(out: str, gpu: bool) -> None:
    """What the README's plain blocks print, one line each (AssertionError naming the line): the
    quick start's shapes, ag_gemm's, the row-parallel determinism check, Ulysses', the serving
    step's (paged flash_decode, all_reduce_rmsnorm) and the MoE round trip's, with the sizes the
    blocks pick for the device."""
    lines = out.strip().splitlines()
    assert len(lines) == 6, out
    m, n = (1000, 1792) if gpu else (10, 32)
    rs_m, rs_n = (1024, 4096) if gpu else (16, 24)
    s_r = 1024 if gpu else 16
    assert lines[0].startswith("[((1024, 512), (256, 512), "), lines[0]
    expected = [str([(4 * m + 6, n)] * 4), str([((rs_m // 2, rs_n), True, True)] * 2),
                str([(1, s_r, 8, 64)] * 2),
                str([((4, 32, 128) if gpu else (2, 4, 64), torch.float8_e4m3fn)] * 2),
                "[True, True]"]
    for got, want in zip(lines[1:], expected):
        assert got == want, (got, want)


def run_torchrun_blocks(page: Path, workdir: Path, procs: int, timeout: float = 600) -> list[str]:
    """Run each ``# needs: torchrun`` block under ``torchrun --nproc-per-node procs``; per
    block, the ranks' stdouts one after the other in rank order (torchrun writes each rank's
    to its own file: on one shared pipe, unbuffered ranks' lines interleave mid-line)."""
    outs = []
    for i, block in enumerate(readme_blocks(page)[1]):
        script = workdir / f"{page.stem}_torchrun_{i}.py"
        script.write_text(block)
        logs = workdir / f"{page.stem}_torchrun_{i}_logs"
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(procs), "--log-dir", str(logs), "--redirects", "1", str(script)],
             _root_of(page), timeout)
        files = sorted(logs.glob("**/stdout.log"), key=lambda f: int(f.parent.name))
        assert len(files) == procs, f"torchrun wrote {len(files)} stdout logs for {procs} ranks"
        outs.append("".join(f.read_text() for f in files))
    return outs
