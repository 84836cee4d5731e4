"""Back-to-back calls reuse the workspace safely: calls of varying sizes, no stale data.

The default run makes 400 calls (every kind 100 times, sizes drawn from 1-64 rows); the long
run (marker ``slow``: ``python -m pytest -q -m slow``) makes the 10,000 of DESIGN.md section 4.
"""

import pytest
import torch

import ditron_ops

CALLS = 10_000
SHORT_CALLS = 400
"""The default run's calls: the same sequence's first 400 (every kind and every size class)."""


def _stress(group, calls, max_rows):
    """Each call's input encodes (call, rank, row); any stale or misplaced element is caught.

    Inputs are built on the device and mismatches are counted on the device: a host<->device copy
    from pageable memory while peers' kernels spin on this rank can stall the virtual world.
    """
    gen = torch.Generator().manual_seed(1234)  # same sequence of sizes on every rank
    w, r, dev = group.world_size, group.rank, group.device
    cols = 3
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    first_wrong = torch.full((), -1, dtype=torch.int64, device=dev)
    for i in range(calls):
        rows = int(torch.randint(1, max_rows + 1, (1,), generator=gen))
        kind = i % 4
        base = torch.arange(rows * cols, dtype=torch.float32, device=dev).reshape(rows, cols)
        if kind == 0:  # uneven all_gather, sizes change every call (exercises both halves)
            sizes = [max(1, rows - q) for q in range(w)]
            got = ditron_ops.all_gather(base[: sizes[r]] + 1000.0 * r + 7.0 * (i % 97), shard_sizes=sizes)
            want = torch.cat([base[: sizes[q]] + 1000.0 * q + 7.0 * (i % 97) for q in range(w)])
        elif kind == 1:
            got = ditron_ops.reduce_scatter(base + r + i % 89)
            full = sum(base + q + i % 89 for q in range(w))
            start = ditron_ops.runtime.split_start(rows, w, r)
            want = full[start: start + ditron_ops.split_sizes(rows, w)[r]]
        else:
            got = ditron_ops.all_reduce(base + r - i % 83, algorithm="one_shot" if kind == 2 else "two_shot")
            want = sum(base + q - i % 83 for q in range(w))
        bad = (got.shape != want.shape) or (got != want).any()
        wrong += bad
        first_wrong = torch.where((first_wrong < 0) & bad, i, first_wrong) if not isinstance(bad, bool) \
            else first_wrong
    group.synchronize()
    assert int(wrong) == 0, f"{int(wrong)} wrong calls on rank {r}, first at call {int(first_wrong)}"
    return "ok"


def _run(calls):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = 4 if device == "cuda" else 2
    assert ditron_ops.launch(_stress, world, device=device, args=(calls, 64)) == ["ok"] * world


@pytest.mark.timeout(300)  # about 15-30 s in the CPU interpreter on a 2-core machine
def test_hundreds_of_calls_varying_sizes():
    """The default run's short stress: 400 back-to-back calls of the long run's sequence."""
    _run(SHORT_CALLS)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 6-20 minutes in the CPU interpreter on a (shared) 2-core machine
def test_ten_thousand_calls_varying_sizes():
    _run(CALLS)
