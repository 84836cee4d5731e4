"""CPU tier: every Python block of the README and of the reference pages under ``docs/`` runs as
written (the interpreter; torchrun blocks on 2 gloo processes)."""
from pathlib import Path

import pytest

from ditron_ops.testing.docs import (check_plain_output, doc_pages, readme_blocks, run_plain_blocks,
                                     run_torchrun_blocks)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = doc_pages(ROOT)


def test_readme_has_blocks_of_both_kinds():
    plain, torchrun = readme_blocks(README)
    assert len(plain) >= 6 and len(torchrun) >= 1


def test_readme_python_blocks_run(tmp_path):
    check_plain_output(run_plain_blocks(README, tmp_path), gpu=False)


def test_readme_torchrun_blocks_run(tmp_path):
    for out in run_torchrun_blocks(README, tmp_path, procs=2):
        assert sorted(line.split()[0] for line in out.strip().splitlines()) == ["0", "1"], out


def test_every_op_family_has_a_page_with_a_checked_example():
    names = {p.stem for p in PAGES}
    assert {"ag_gemm", "gemm_rs", "gemm_core", "flash_decode", "ulysses_attention", "moe",
            "collectives", "runtime"} <= names, names
    for page in PAGES:
        plain, _ = readme_blocks(page)
        assert plain and any("assert" in block for block in plain), page.name


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_docs_python_blocks_run(page, tmp_path):
    """A page's blocks assert what they show; a failing assert fails the run."""
    run_plain_blocks(page, tmp_path)
    for out in run_torchrun_blocks(page, tmp_path, procs=2):
        assert out.strip(), page.name
