"""Collectives on a CPU virtual world (Triton interpreter) vs the order-exact references."""
import pytest
import torch

import ditron_ops
from ditron_ops.testing import check_collectives

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(5, 3), (8, 16)])
def test_collectives_match_reference(world_size, dtype, rows, cols):
    errors = ditron_ops.launch(check_collectives, world_size, args=(rows, cols, dtype))
    assert len(errors) == world_size
    assert all(v == 0.0 for per_rank in errors for v in per_rank.values())


def _bf16_gather(group):
    x = torch.randn(3, 5).to(torch.bfloat16) + group.rank
    return torch.equal(ditron_ops.all_gather(x, group), ditron_ops.reference.all_gather(x, group))


def test_bfloat16_all_gather_in_interpreter():
    # bf16 is only copied here. (The interpreter rounds fp32 -> bf16 differently from the GPU,
    # so bf16 *reductions* are checked on the GPU tier only.)
    assert all(ditron_ops.launch(_bf16_gather, 2))


def test_rows_fewer_than_ranks():
    ditron_ops.launch(check_collectives, 4, args=(2, 3, torch.float32, False))
