"""A rank that never arrives makes its peers raise DitronTimeoutError (no hang), on CPU and GPU."""
import time

import pytest
import torch

import ditron_ops

DEVICES = ["cpu"] if not torch.cuda.is_available() else ["cuda"]


def _rank1_skips(group, op):
    x = torch.ones(8, 4, device=group.device)
    getattr(ditron_ops, op)(x)  # every rank: the workspace exists after this call
    group.synchronize()
    if group.rank == 1:
        return "skipped"
    t0 = time.monotonic()
    try:
        getattr(ditron_ops, op)(x)
        group.synchronize()
    except ditron_ops.DitronTimeoutError as exc:
        return (exc.op, exc.rank, exc.peer, exc.epoch, time.monotonic() - t0)
    return "no error"


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("device", DEVICES)
def test_missing_rank_times_out(op, device):
    t0 = time.monotonic()
    results = ditron_ops.launch(_rank1_skips, 2, device=device, args=(op,), timeout_s=1.0)
    assert results[1] == "skipped"
    name, rank, peer, epoch, waited = results[0]
    assert (name, rank, peer, epoch) == (op, 0, 1, 2)
    assert 0.9 < waited < 10.0
    assert time.monotonic() - t0 < 30.0


def _bound_lowered_after_the_first_call(group, op):
    x = torch.ones(8, 4, device=group.device)
    getattr(ditron_ops, op)(x)  # builds the plan under the launch's 10 s bound
    group.synchronize()
    group.timeout_s = 0.5
    if group.rank == 1:
        return "skipped"
    t0 = time.monotonic()
    with pytest.raises(ditron_ops.DitronTimeoutError):
        getattr(ditron_ops, op)(x)
        group.synchronize()
    return time.monotonic() - t0


@pytest.mark.parametrize("op", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_timeout_applies_to_the_next_call(op, device):
    """Group.timeout_s set after a call binds the next one (plans bind the bound, so they
    are rebuilt), not the bound the plan was built with."""
    results = ditron_ops.launch(_bound_lowered_after_the_first_call, 2, device=device,
                                args=(op,), timeout_s=10.0)
    assert results[1] == "skipped"
    assert results[0] < 5.0, f"waited {results[0]:.1f} s: the plan kept the old bound"


def test_timeout_must_be_positive():
    group = ditron_ops.launch(lambda g: g, 1, device=DEVICES[0])[0]
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            group.timeout_s = bad


def _mismatched_rows(group):
    ditron_ops.all_gather(torch.ones(5, 2, device=group.device))  # creates the workspace
    x = torch.ones(3 + group.rank, 2, device=group.device)
    try:
        ditron_ops.all_gather(x)  # shard_sizes=None promises equal shards; rank 1 lies
        group.synchronize()
    except ditron_ops.DitronSizeMismatchError as exc:
        return exc.op
    return "no error"


@pytest.mark.parametrize("device", DEVICES)
def test_size_disagreement_is_reported(device):
    assert ditron_ops.launch(_mismatched_rows, 2, device=device, timeout_s=2.0) == ["all_gather"] * 2


def _failed_group_stays_failed(group):
    x = torch.ones(4, device=group.device)
    ditron_ops.all_gather(x)
    group.synchronize()
    if group.rank == 0:
        with pytest.raises(ditron_ops.DitronTimeoutError):  # from the call (GPU virtual gate)
            ditron_ops.all_gather(x)                         # or from the synchronize
            group.synchronize()
        with pytest.raises(ditron_ops.DitronTimeoutError):
            ditron_ops.all_gather(x)  # raised before any launch
    return True


@pytest.mark.parametrize("device", DEVICES)
def test_failed_group_raises_before_next_launch(device):
    assert ditron_ops.launch(_failed_group_stays_failed, 2, device=device, timeout_s=0.5) == [True, True]


def _two_waits(group, op):
    """One call of an op with two waiting kernels (start barrier, then merge or consumer)."""
    if op == "ag_gemm":
        return ditron_ops.ag_gemm(torch.ones(4, 8), torch.ones(8, 8), group, impl="fused")
    if op == "gemm_ar":
        return ditron_ops.gemm_ar(torch.ones(4, 8), torch.ones(8, 8), group, impl="fused",
                                  algorithm="one_shot")
    kv = torch.ones(2, 5, 2, 64)
    return ditron_ops.flash_decode(torch.ones(2, 4, 64), kv, kv, torch.full((2,), 5), group)


def _rank1_raises(group, op, first):
    if not first:
        _two_waits(group, op)
        group.synchronize()
    if group.rank == 1:
        raise RuntimeError("rank 1 fails before the call")
    t0 = time.monotonic()
    with pytest.raises(ditron_ops.DitronTimeoutError) as info:
        _two_waits(group, op)
        group.synchronize()
    err = info.value
    assert err.op == op and err.peer == 1 and "rank 1" in str(err), str(err)
    assert "-1" not in str(err), str(err)
    return time.monotonic() - t0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tier")
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_ar", "flash_decode"])
def test_survivors_error_within_the_bound_naming_the_rank(op, first):
    """The survivors' error arrives within the bound (a second waiting kernel spun a second
    bound), and on the group's first call names the op and rank 1 (not rank/epoch -1)."""
    timings = []
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        ditron_ops.launch(lambda g: timings.append(_rank1_raises(g, op, first)), 3, timeout_s=3.0)
    assert len(timings) == 2 and max(timings) < 3.0 * 1.6, timings  # twice the bound before
