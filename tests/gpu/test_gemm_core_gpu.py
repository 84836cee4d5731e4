"""GPU tier (H200): the GEMM core's tile rule in deterministic mode. Rows are bitwise equal
whatever M, hence whatever tiling the rule picks for it (``matmul`` into fp32, gemm_rs and
gemm_ar at W = 1 and W = 2, K_r different per rank), and every tiling deterministic mode may
pick gives the large tiles' rows."""
import pytest
import torch

import ditron_ops
from ditron_ops.gemm import _core_configs as rules
from ditron_ops.gemm._core import matmul, program_budget
from ditron_ops.runtime.split import split_sizes

pytestmark = pytest.mark.gpu
MS = (1, 3, 17, 64, 255, 1000, 8192)
N = 4096
"""LLaMA-7B's GEMM-RS output width: at W = 1 the rule picks 64x128 tiles up to M = 255 and the
128x256 ones from M = 1000; at W = 2 (66 SMs a rank) 64x128 up to M = 64, then 128x256 (at
M = 255 as split-tail halves)."""
KS = (1376, 1000)
"""Each rank's K_r (W = 2: the ranks differ; the rule must not see it)."""
DTYPE = torch.bfloat16


def _inputs(group, m: int, k: int, seed: int = 0):
    n = N
    gen = torch.Generator(device="cpu").manual_seed(seed * 100 + group.rank)
    a = (torch.randn(m, k, generator=gen) / k ** 0.25).to(dtype=DTYPE, device=group.device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.25).to(dtype=DTYPE, device=group.device)
    return a, w.t()


def _rows_across_m(group) -> list:
    """Deterministic mode: every M of ``MS`` against the rows of the M = 8192 calls, bitwise.
    Returns the tilings the rule picked (for gemm_rs / gemm_ar on this rank's budget)."""
    a_full, b = _inputs(group, MS[-1], KS[group.rank % len(KS)], seed=3)
    with ditron_ops.deterministic():
        mm = matmul(a_full, b, out=torch.empty(MS[-1], N, device=group.device))
        ar = ditron_ops.gemm_ar(a_full, b, group)
        for m in MS:
            a = a_full[:m].clone()  # its own call, its own plan
            got = matmul(a, b, out=torch.empty(m, N, device=group.device))
            assert torch.equal(got, mm[:m]), f"rank {group.rank}: matmul M={m}"
            for algorithm in ("one_shot", "two_shot"):
                got = ditron_ops.gemm_ar(a, b, group, algorithm=algorithm)
                assert torch.equal(got, ar[:m]), f"rank {group.rank}: gemm_ar {algorithm} M={m}"
            rows = split_sizes(m, group.world_size)
            start = sum(rows[:group.rank])
            got = ditron_ops.gemm_rs(a, b, group)
            assert torch.equal(got, ar[start:start + rows[group.rank]]), \
                f"rank {group.rank}: gemm_rs M={m}"
    group.synchronize()
    budget = program_budget(group.device, group)
    k = KS[group.rank % len(KS)]
    return ([rules.select(m, N, budget, group.device, deterministic=True).name for m in MS],
            [rules.select_split(m, N, k, program_budget(group.device, None), group.device,
                                deterministic=True, out_bytes=4)[0].name for m in MS])


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_bitwise_equal_across_m(world_size):
    """The same rows computed inside calls with M in {1, 3, 17, 64, 255, 1000, 8192} are
    bitwise equal, while the rule's tiling changes between those M (``matmul``: the skinny
    tiles up to M = 32, then 64 and 128 rows)."""
    picks = ditron_ops.launch(_rows_across_m, world_size)
    fused = [p[0] for p in picks]
    assert all(p == fused[0] for p in fused), fused  # every rank the same tiles
    assert len(set(fused[0])) >= 2, fused[0]
    plain = picks[0][1]
    assert [rules.skinny(m, torch.device("cuda")) is not None for m in MS] == [True, True, True,
                                                                               False, False,
                                                                               False, False]
    assert plain[0].startswith("sw16") and plain[2].startswith("sw32") and len(set(plain)) >= 4
    print(f"\nW={world_size}: fused " + ", ".join(f"M={m} {p}" for m, p in zip(MS, fused[0]))
          + "; matmul " + ", ".join(f"M={m} {p}" for m, p in zip(MS, plain)))


def _candidates_agree(group) -> bool:
    """Each configuration deterministic mode may pick (the skinny and narrow ones too), forced (``cfg=``),
    gives the rows of the 128x256 tiles at M = 8192 bitwise, at several M, for both B
    layouts."""
    for weight_layout in (True, False):
        a_full, b = _inputs(group, MS[-1], KS[0], seed=5)
        if not weight_layout:
            b = b.contiguous()  # [K, N] row-major
        ref = matmul(a_full, b, out=torch.empty(MS[-1], N, device=group.device),
                     cfg=rules.GPU_CONFIGS[rules.GPU_CONFIG])
        for cand in (rules.candidates(group.device, True) + rules.SKINNY_CANDIDATES
                     + rules.NARROW_CANDIDATES + (rules.SHORT_K_CANDIDATE,)):
            for m in (1, 17, 255, 1000, MS[-1]):
                got = matmul(a_full[:m].clone(), b, out=torch.empty(m, N, device=group.device),
                             cfg=cand.cfg)
                assert torch.equal(got, ref[:m]), (cand.name, m, weight_layout)
    return True


def test_every_deterministic_candidate_gives_the_same_rows():
    assert ditron_ops.launch(_candidates_agree, 1) == [True]
