"""The multi-GPU correctness suite, one process per GPU (``tests/gpu/test_torchrun.py`` runs it)::

    torchrun --nproc-per-node N -m ditron_ops.testing.torchrun_checks

Every op against its reference on the nvshmem backend (or the torch backend without
nvshmem4py), at odd and model sizes: collectives bitwise, ag_gemm (copy and pull producers,
uneven shards, bias, strided out) within its dtype's tolerance, gemm_rs / gemm_ar (one- and
two-shot) deterministic and bitwise equal to the rank-ordered fp32 sum, the unfused paths
(``impl="baseline"``: NCCL), flash_decode; then CUDA-graph capture and replay, 300 back-to-back
calls of varying sizes, and last a rank that skips a call: its peer must raise
``DitronTimeoutError`` within the group's timeout, not hang. Rank 0 prints ``CHECK <name> ok``
per check and ``ALL OK`` at the end; any failure raises (non-zero exit). ``--skip`` leaves parts
out (``PARTS``); ``--dump-after S`` prints progress and, after S seconds, every rank's stack.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
import traceback

import torch

from .. import reference
from ..gemm import _ag_launch as ag_launch
from ..gemm.ag_gemm import ag_gemm
from ..errors import DitronTimeoutError
from ..attention.flash_decode import flash_decode
from ..gemm.gemm_rs import gemm_ar, gemm_rs
from ..runtime.split import split_sizes, split_start
from ..runtime.torchrun import torchrun_group
from .ag_gemm_checks import REL_TOL, check_ag_gemm
from .checks import check_collectives, make_input
from .gemm_rs_checks import check_gemm_reduce, gemm_rs_inputs, order_exact
from .ulysses_checks import check_ulysses

TIMEOUT_S = 3.0  # the group's wait bound here: the skipped-call check waits this long


def _say(group, name: str) -> None:
    group.barrier()
    if group.rank == 0:
        print(f"CHECK {name} ok", flush=True)


_VERBOSE = False  # --dump-after given: every rank prints its steps


def _progress(group, step: str) -> None:
    if _VERBOSE:
        print(f"[rank {group.rank}] {step}", flush=True)


def _check_collectives(group, dtype: torch.dtype) -> None:
    gpu = group.device.type == "cuda"
    for rows, cols in ((1, 1), (4099, 1001), (8192, 4096)) if gpu else ((1, 1), (67, 33)):
        check_collectives(group, rows, cols, dtype)


def _check_ag_gemm(group, dtype: torch.dtype) -> None:
    w, gpu = group.world_size, group.device.type == "cuda"
    default = ag_launch.PRODUCER
    for producer in ag_launch.PRODUCERS:
        ag_launch.PRODUCER = producer
        if gpu:
            check_ag_gemm(group, [1024 + 37 * q for q in range(w)], 1792, 4096, dtype)
            check_ag_gemm(group, [4096] * w, 7168 // w, 4096, dtype, use_out=True)
        check_ag_gemm(group, [3 + q for q in range(w)], 136, 264, dtype, weight_layout=False)
    ag_launch.PRODUCER = default
    check_ag_gemm(group, [2048 if gpu else 8] * w, 7168 // w, 4096 if gpu else 64, dtype,
                  impl="baseline")


def _check_gemm_reduce(group, dtype: torch.dtype) -> None:
    w, gpu = group.world_size, group.device.type == "cuda"
    for m, n, k in ((4096, 4096, 14336 // w),) * gpu + ((8 * w + 3, 136, 264), (1, 264, 136)):
        for algorithm in ("one_shot", "two_shot"):
            _progress(group, f"gemm_reduce {m}x{n}x{k} {algorithm}")
            check_gemm_reduce(group, m, n, k, dtype, algorithm=algorithm)
    _progress(group, "gemm baselines")
    _check_baselines(group, dtype, (2048, 4096, 3584) if gpu else (16, 32, 24))


def _check_baselines(group, dtype: torch.dtype, mnk: tuple[int, int, int]) -> None:
    """``impl="baseline"`` (NCCL on multi-GPU) and the non-deterministic fused path, within
    twice the dtype's tolerance of the order-exact sum."""
    a, b = gemm_rs_inputs(group, *mnk, dtype)
    want = order_exact(a, b, group).float()
    scale = want.abs().max()
    m, w = want.shape[0], group.world_size
    start = split_start(m, w, group.rank)
    mine = want[start:start + split_sizes(m, w)[group.rank]]
    for impl in ("baseline", "fused"):
        got_rs = gemm_rs(a, b, group, impl=impl, deterministic=False).float()
        got_ar = gemm_ar(a, b, group, impl=impl, deterministic=False).float()
        assert (got_rs - mine).abs().max() <= 2 * REL_TOL[dtype] * scale, f"gemm_rs {impl}"
        assert (got_ar - want).abs().max() <= 2 * REL_TOL[dtype] * scale, f"gemm_ar {impl}"


def _check_flash_decode(group, dtype: torch.dtype) -> None:
    from ..reference import flash_decode as reference_decode

    gpu = group.device.type == "cuda"
    cases = ((4, 4096, True), (1, 65536, False), (3, 100, False)) if gpu else ((2, 40, True),)
    for b, s_max, deterministic in cases:
        hq, hkv, d = (32, 8, 128) if gpu else (4, 2, 64)
        q = make_input((b, hq, d), dtype, group.device, 0)
        k = make_input((b, s_max, hkv, d), dtype, group.device, 10 + group.rank)
        v = make_input((b, s_max, hkv, d), dtype, group.device, 20 + group.rank)
        lens = torch.tensor([(s_max - 13 * (i + group.rank)) * ((i + group.rank) % 3 != 2)
                             for i in range(b)], dtype=torch.int32, device=group.device)
        lens = lens.clamp_min(0)
        got = flash_decode(q, k, v, lens, group, deterministic=deterministic)
        want = reference_decode(q, k, v, lens, group)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 2e-2, f"rank {group.rank}: flash_decode B={b} S={s_max} error {err}"


def _check_graphs(group, dtype: torch.dtype) -> None:
    """Each fused op captured once in a CUDA graph, replayed on new inputs: equal to eager."""
    a_ag = make_input((1024, 4096), dtype, group.device, group.rank)
    b_ag = make_input((4096, 1792), dtype, group.device, 99)
    a_rs, b_rs = gemm_rs_inputs(group, 2048, 2048, 2048, dtype)
    ops = {"ag_gemm": lambda: ag_gemm(a_ag, b_ag, group, impl="fused"),
           "gemm_rs": lambda: gemm_rs(a_rs, b_rs, group, impl="fused", deterministic=True),
           "gemm_ar": lambda: gemm_ar(a_rs, b_rs, group, impl="fused", deterministic=True)}
    for name, op in ops.items():
        op()
        group.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op()
        group.barrier()
        for step in range(3):
            for x in (a_ag, a_rs):
                x.copy_(make_input(tuple(x.shape), dtype, group.device, 1000 * step + group.rank))
            graph.replay()
            want = op()
            group.synchronize()
            assert torch.equal(out, want), f"rank {group.rank}: {name} graph replay {step} differs"
        del graph


def _check_back_to_back(group, dtype: torch.dtype, calls: int = 300) -> None:
    """Back-to-back calls of every op with sizes changing each call; every 10th result is
    compared (the rest must simply not corrupt the next ones: stale data would show there)."""
    w = group.world_size
    for i in range(calls):
        m = 64 + 61 * (i % 7)
        a = make_input((m, 512), dtype, group.device, i * w + group.rank)
        b = make_input((512, 256 + 8 * (i % 3)), dtype, group.device, i)
        got = ag_gemm(a, b, group, impl="fused")
        got_rs = gemm_rs(a.t().contiguous(), a[:m, :m].contiguous(), group,
                         impl="fused", deterministic=True) if i % 2 else None
        if i % 10 == 0:
            want = reference.all_gather(a, group).float() @ b.float()
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            assert err <= REL_TOL[dtype], f"rank {group.rank}: call {i}: ag_gemm error {err}"
        if got_rs is not None and i % 10 == 1:
            exact = order_exact(a.t().contiguous(), a[:m, :m].contiguous(), group)
            start, rows = split_start(512, w, group.rank), split_sizes(512, w)[group.rank]
            assert torch.equal(got_rs, exact[start:start + rows]), f"call {i}: gemm_rs differs"
    group.synchronize()


def _check_timeout(group, dtype: torch.dtype) -> None:
    """Rank W-1 skips one ag_gemm call: every other rank must raise ``DitronTimeoutError``
    naming a peer within about the group's timeout. Leaves the group failed: run it last."""
    a = make_input((256, 512), dtype, group.device, group.rank)
    b = make_input((512, 256), dtype, group.device, 7)
    ag_gemm(a, b, group, impl="fused")
    group.synchronize()
    group.barrier()
    if group.rank == group.world_size - 1:
        return
    start = time.monotonic()
    try:
        ag_gemm(a, b, group, impl="fused")
        group.synchronize()
    except DitronTimeoutError as exc:
        took = time.monotonic() - start
        assert took < TIMEOUT_S + 10, f"rank {group.rank}: raised after {took:.1f} s"
        print(f"rank {group.rank}: DitronTimeoutError after {took:.1f} s: {exc}", flush=True)
        return
    raise AssertionError(f"rank {group.rank}: a call whose peer never came returned normally")


def main(argv=None) -> int:
    global _VERBOSE
    parser = argparse.ArgumentParser(prog="python -m ditron_ops.testing.torchrun_checks",
                                     description="The multi-GPU checks (run under torchrun).")
    parser.add_argument("--skip", default="", help="comma list of parts to leave out: "
                        + ", ".join(list(PARTS) + ["timeout"]))
    parser.add_argument("--dump-after", type=float, default=None, metavar="S",
                        help="print every rank's steps, and every rank's stack after S seconds "
                             "(to locate a stall)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DITRON_TIMEOUT_S", str(TIMEOUT_S))
    if args.dump_after is not None:  # where every rank is, if the run stalls
        _VERBOSE = True
        faulthandler.dump_traceback_later(args.dump_after, exit=False)
    try:
        _run_all({name for name in args.skip.split(",") if name})
    except BaseException:  # noqa: BLE001 - fail fast: peers would wait in collective frees
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


PARTS = {  # name: (check, its CHECK line, needs symmetric memory on a GPU)
    "collectives": (_check_collectives, "collectives", False),
    "ag_gemm": (_check_ag_gemm, "ag_gemm (copy and pull producers, uneven, baseline)", False),
    "flash_decode": (_check_flash_decode, "flash_decode", False),
    "gemm_reduce": (_check_gemm_reduce,
                    "gemm_rs / gemm_ar (deterministic bitwise; NCCL baselines)", False),
    "ulysses": (lambda group, dtype: check_ulysses(group, dtype), "ulysses_attention", False),
    "graphs": (_check_graphs, "CUDA graphs", True),
    "back_to_back": (_check_back_to_back, "300 back-to-back calls", True),
}
"""The checks in run order, the timeout check after them (``--skip``: a comma list of names to
leave out, e.g. a part that stalls, so the others still report)."""


def _run_all(skip: set) -> None:
    with torchrun_group() as group:
        dtype = torch.bfloat16 if group.device.type == "cuda" else torch.float32
        heap = group.has_symmetric_memory and group.device.type == "cuda"
        if group.rank == 0:
            print(f"torchrun checks: {group.world_size} ranks, {group.backend} backend, "
                  f"{dtype}" + (f"; skipping {sorted(skip)}" if skip else ""), flush=True)
        for name, (check, line, needs_heap) in PARTS.items():
            if name in skip or (needs_heap and not heap):
                continue
            _progress(group, name)
            check(group, dtype)
            _say(group, line)
        if heap and "timeout" not in skip:
            _check_timeout(group, dtype)
            torch.distributed.barrier()  # the skipping rank stays until its peers have raised
            if group.rank == 0:
                print("CHECK timeout ok", flush=True)
        if group.rank == 0:
            print("ALL OK", flush=True)
        sys.stdout.flush()
        if heap:
            # the timed-out group is failed: finalize's collective frees would wait on the rank
            # that skipped a call, so the process ends here
            os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
