"""Bad input raises TypeError/ValueError naming the op before any kernel is launched."""
import pytest
import torch

import ditron_ops
from ditron_ops.collectives._launch import PURPOSE


def _expect(group, fn, exc, words):
    with pytest.raises(exc) as info:
        fn()
    for w in words:
        assert w in str(info.value), str(info.value)
    assert PURPOSE not in group._workspaces  # nothing was allocated or launched
    return True


def _cases(group):
    dev = group.device
    x = torch.ones(4, 3, device=dev)
    checks = [
        (lambda: ditron_ops.all_gather(x.to(torch.int32)), TypeError, ["all_gather", "int32"]),
        (lambda: ditron_ops.all_reduce(x.double()), TypeError, ["all_reduce", "float64"]),
        (lambda: ditron_ops.reduce_scatter([1, 2]), TypeError, ["reduce_scatter", "torch.Tensor"]),
        (lambda: ditron_ops.all_gather(torch.ones((), device=dev)), ValueError, ["all_gather", "dimension"]),
        (lambda: ditron_ops.all_gather(x, shard_sizes=[4]), ValueError, ["shard_sizes", "2 ranks"]),
        (lambda: ditron_ops.all_gather(x, shard_sizes=[3, 3]), ValueError, ["shard_sizes[", "4 rows"]),
        (lambda: ditron_ops.all_gather(x, shard_sizes=[4, -1]), ValueError, ["non-negative"]),
        (lambda: ditron_ops.all_reduce(x, algorithm="ring"), ValueError, ["algorithm"]),
        (lambda: ditron_ops.all_reduce(x, deterministic=1), TypeError, ["deterministic"]),
        (lambda: ditron_ops.all_gather(x, group="g"), TypeError, ["group"]),
    ]
    if dev.type == "cuda":
        checks.append((lambda: ditron_ops.all_gather(x.cpu()), ValueError, ["all_gather", "cpu"]))
    return all(_expect(group, fn, exc, words) for fn, exc, words in checks)


def test_bad_inputs_raise_before_launch_on_every_rank():
    assert ditron_ops.launch(_cases, 2) == [True, True]


def test_launch_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        ditron_ops.launch(lambda g: None, 0)


def test_no_group_outside_launch():
    with pytest.raises(ValueError, match="no group"):
        ditron_ops.all_gather(torch.ones(2, 2))


def test_rank_exception_is_reraised_on_caller():
    def fn(group):
        if group.rank == 1:
            raise KeyError("boom on rank 1")
        ditron_ops.all_gather(torch.ones(2, 2, device=group.device))

    with pytest.raises(KeyError, match="boom"):
        ditron_ops.launch(fn, 2, timeout_s=1.0)
