"""``python -m ditron_ops`` flags on a CPU: each works or refuses in one line; the self-check
draws only valid inputs (CPU tier)."""
import pytest
import torch

import ditron_ops
from ditron_ops.__main__ import main
from ditron_ops.selfcheck import _flash_decode_check

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier")


@pytest.mark.parametrize("argv,words", [(["--dtype", "bf16"], "bf16 needs a GPU"),
                                        (["--world-size", "0"], "at least 1"),
                                        (["--world-size", "-2"], "at least 1")])
def test_flags_refuse_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and "Traceback" not in "".join(err), err


def test_launch_on_cuda_without_cuda_is_a_typed_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        ditron_ops.launch(lambda g: None, 2, device="cuda")


def _decode_check(group, dtype):
    ours, ref, _, tol = _flash_decode_check(group, dtype)
    err = (ours.float() - ref.float()).abs().max().item()
    return err <= tol * max(ref.float().abs().max().item(), 1e-6), err, tol


@pytest.mark.parametrize("world_size,dtype", [(4, torch.float32), (2, torch.float16),
                                              (4, torch.float16)])
def test_flash_decode_self_check_matches(world_size, dtype):
    """The self-check's lengths stay in [0, S_max] at W = 4 (they went negative), and fp16 is
    compared with an fp16 tolerance (it used fp32's)."""
    rows = ditron_ops.launch(_decode_check, world_size, args=(dtype,))
    assert all(ok for ok, *_ in rows), rows
    assert rows[0][2] == (1e-5 if dtype == torch.float32 else 2e-3)
