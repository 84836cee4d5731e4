"""Reusable checks: every collective on a group against the order-exact references.

Used by the CPU tests (interpreter), the GPU tests (virtual world on the H200), the gloo
multi-process tests (torch backend) and ``python -m ditron_ops``.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch
import torch.multiprocessing as mp

from .. import reference
from ..collectives import all_gather, all_reduce, reduce_scatter
from ..runtime.group import Group


def make_input(shape: Sequence[int], dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """Deterministic random input (never zeros: zeros hide unwritten outputs)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page: int, generator=None):
    """``(k_pages, v_pages, block_table)``: contiguous ``[B, S, Hkv, D]`` caches cut into pages of
    ``page`` keys (the last one zero-padded) stored in a random order over the cache."""
    b, s, hkv, d = k.shape
    per = -(-s // page)
    perm = torch.randperm(b * per, generator=generator).to(k.device)
    out = []
    for t in (k, v):
        padded = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, per * page - s))
        pages = torch.empty(b * per, page, hkv, d, dtype=t.dtype, device=t.device)
        pages[perm] = padded.reshape(b * per, page, hkv, d)
        out.append(pages)
    return out[0], out[1], perm.view(b, per).to(torch.int32)


def check_collectives(group: Group, rows: int, cols: int, dtype: torch.dtype,
                      uneven: bool = True, seed: int = 0) -> dict[str, float]:
    """Run all_gather (even and uneven), reduce_scatter and both all_reduce algorithms once and
    compare with the references. Returns ``{op: max abs error}``; gathers must be exact and
    reductions bitwise equal to the rank-ordered fp32 reference (raises AssertionError if not)."""
    w, r = group.world_size, group.rank
    x = make_input((rows, cols), dtype, group.device, seed * 1000 + r)
    # Differences stay on the device until every rank is done: a device->host copy (to pageable
    # memory) while a peer's kernel spins on this rank can stall a virtual world.
    pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
        if got.numel() == 0:
            return
        pending[name] = ((got.float() - want.float()).abs().max(), (got != want).sum())

    compare("all_gather", all_gather(x, group), reference.all_gather(x, group))
    if uneven:
        sizes = [max(0, rows - 2 * q + (q % 2)) for q in range(w)]
        xs = x[: sizes[r]]
        compare("all_gather_uneven", all_gather(xs, group, shard_sizes=sizes),
                reference.all_gather(xs, group))
    compare("reduce_scatter", reduce_scatter(x, group), reference.reduce_scatter(x, group))
    want = reference.all_reduce(x, group)
    compare("all_reduce_one_shot", all_reduce(x, group, algorithm="one_shot"), want)
    compare("all_reduce_two_shot", all_reduce(x, group, algorithm="two_shot"), want)
    group.synchronize()  # raises a kernel-recorded error (timeout, size mismatch) first
    group.barrier()
    errors = {name: float(err) for name, (err, _) in pending.items()}
    wrong = {name: int(count) for name, (_, count) in pending.items() if int(count)}
    assert not wrong, f"rank {r}: elements differing from the reference: {wrong}; max errors {errors}"
    return errors


def _gloo_worker(rank: int, world_size: int, store: str, fn: Callable, args: tuple, queue) -> None:
    import torch.distributed as dist

    from ..runtime.torch_backend import TorchGroup

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(TorchGroup(), *args), None))
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        queue.put((rank, None, repr(exc)))
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable[..., Any], world_size: int, args: tuple = (),
             timeout_s: float = 120.0) -> list:
    """Run ``fn(TorchGroup, *args)`` in ``world_size`` processes over gloo (file:// rendezvous).

    ``fn`` must be picklable (module level). Returns per-rank results; raises RuntimeError with
    the failing rank's error.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_gloo_worker, args=(r, world_size, store, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: list[Optional[Any]] = [None] * world_size
        failures = []
        for _ in range(world_size):
            rank, value, err = queue.get(timeout=timeout_s)
            results[rank] = value
            if err is not None:
                failures.append(f"rank {rank}: {err}")
        for p in procs:
            p.join(timeout=30)
    if failures:
        raise RuntimeError("; ".join(failures))
    return results


@contextlib.contextmanager
def one_pe_nvshmem(tmpdir: str):
    """In a child process of ``run_child``: this process as the one PE of an NVSHMEM job (a gloo
    process group of one over a file store in ``tmpdir``); yields its group, and finalizes
    NVSHMEM and destroys the process group on the way out, error or not."""
    import torch.distributed as dist

    from ..runtime import nvshmem_backend

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}", rank=0, world_size=1)
    try:
        yield nvshmem_backend.init_nvshmem()
    finally:
        nvshmem_backend.finalize_nvshmem()
        dist.destroy_process_group()


def run_child(script: str, *args: str, timeout_s: float = 600) -> dict:
    """Tests: run ``python script *args`` in a fresh process (the package's root on its path, no
    ``TRITON_INTERPRET``) and return the JSON object of its last ``RESULT {...}`` line; raise
    AssertionError with the end of its stderr when it fails or prints none. One-PE NVSHMEM
    checks run this way: NVSHMEM is initialised once per process."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    # (-X faulthandler: a child that crashes prints its Python stack to the stderr shown below)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", os.path.abspath(script), *args],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (f"exit code {proc.returncode}; stdout ends:\n"
                                            f"{proc.stdout[-2000:]}\nstderr ends:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])
