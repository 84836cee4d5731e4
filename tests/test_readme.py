"""CPU tier: every Python block of the README runs as written (the interpreter; torchrun blocks
on 2 gloo processes)."""
from pathlib import Path

from ditron_ops.testing.docs import check_plain_output, readme_blocks, run_plain_blocks, run_torchrun_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_has_blocks_of_both_kinds():
    plain, torchrun = readme_blocks(README)
    assert len(plain) >= 5 and len(torchrun) >= 1


def test_readme_python_blocks_run(tmp_path):
    check_plain_output(run_plain_blocks(README, tmp_path), gpu=False)


def test_readme_torchrun_blocks_run(tmp_path):
    for out in run_torchrun_blocks(README, tmp_path, procs=2):
        assert sorted(line.split()[0] for line in out.strip().splitlines()) == ["0", "1"], out
