"""Per-rank checks of ``all_reduce_rmsnorm`` shared by the CPU (interpreter) and GPU test tiers.

Every function is an SPMD body for ``ditron_ops.launch`` (its first argument is the rank's
group) and returns a list of failure strings (empty: passed), so one assert in the test shows
every rank's failures.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
from ..reference import norm as reference
from ..runtime.group import Group

QUANT_GROUP = {None: None, "fp8_e4m3": None, "fp8_e4m3_128": 128}


def norm_inputs(group: Group, rows: int, cols: int, dtype: torch.dtype, seed: int = 0,
                wdtype: Optional[torch.dtype] = None) -> tuple:
    """``(x, residual, weight)``: x differs per rank; residual and weight are the same on every
    rank (replicated, as the op requires)."""
    gen = torch.Generator().manual_seed(1000 * seed + group.rank)
    x = torch.randn(rows, cols, generator=gen)
    shared = torch.Generator().manual_seed(1000 * seed + 999)
    residual = torch.randn(rows, cols, generator=shared)
    weight = torch.randn(cols, generator=shared) * 0.25 + 1.0
    return (x.to(group.device, dtype), residual.to(group.device, dtype),
            weight.to(group.device, wdtype or dtype))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a few ulps of the dtype: the sum of squares over H runs in another order (fp32:
    its error reaches the output unrounded; 16-bit: at most one rounding step apart)."""
    eps = torch.finfo(got.dtype).eps
    rtol = 16 * eps if got.dtype == torch.float32 else 2 * eps
    return torch.allclose(got.float(), want.float(), rtol=rtol, atol=eps * 1e-2)


def check_against_reference(group: Group, rows: int, cols: int, dtype: torch.dtype,
                            algorithm: str = "auto", quant: Optional[str] = None, seed: int = 0,
                            wdtype: Optional[torch.dtype] = None,
                            eps: float = 1e-6) -> list[str]:
    """The op vs ``reference.norm`` and the plain torch composition: residual_out bitwise,
    normed within ulps (also of ``F.rms_norm``), codes and scales bitwise against the torch
    quantization of the op's own normed rows."""
    x, residual, weight = norm_inputs(group, rows, cols, dtype, seed, wdtype)
    got = all_reduce_rmsnorm(x, residual, weight, eps, algorithm=algorithm, quant=quant)
    want = reference.all_reduce_rmsnorm(x, residual, weight, eps, group, quant)
    fails = []
    if len(got) != (4 if quant else 2):
        return [f"returned {len(got)} tensors"]
    normed, res_out = got[0], got[1]
    if normed.shape != x.shape or normed.dtype != x.dtype or res_out.shape != x.shape:
        return [f"shapes {tuple(normed.shape)} {tuple(res_out.shape)} dtypes {normed.dtype}"]
    if not torch.equal(res_out, want[1]):
        fails.append(f"residual_out differs (max {(res_out.float() - want[1].float()).abs().max()})")
    if not _close(normed, want[0]):
        fails.append(f"normed differs from the reference (max "
                     f"{(normed.float() - want[0].float()).abs().max()})")
    composed = F.rms_norm(want[1], (cols,), weight, eps)  # torch's own RMSNorm
    if weight.dtype == dtype and not _close(normed, composed):
        fails.append(f"normed differs from F.rms_norm (max "
                     f"{(normed.float() - composed.float()).abs().max()})")
    if quant:
        codes, scales = got[2], got[3]
        want_codes, want_scales = reference.quantize_fp8(normed, QUANT_GROUP[quant])
        if codes.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
            fails.append(f"codes {codes.dtype}, scales {scales.dtype}")
        elif not torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)):
            bad = (codes.view(torch.uint8) != want_codes.view(torch.uint8)).sum().item()
            fails.append(f"{bad} codes differ from torch's e4m3 quantization")
        if scales.shape != want_scales.shape or not torch.equal(scales, want_scales):
            fails.append(f"scales differ {tuple(scales.shape)} vs {tuple(want_scales.shape)}")
        # dequantized codes are within e4m3's precision of normed (a sanity bound)
        groups = want_scales.shape[1]
        deq = (codes.float().reshape(rows, groups, -1) * scales[:, :, None]).reshape(rows, cols)
        if rows and not torch.allclose(deq, normed.float(), rtol=2**-3, atol=float(scales.max()) * 2**-9):
            fails.append("dequantized codes are far from normed")
    return [f"rank {group.rank}: {f}" for f in fails]


def check_forms_agree(group: Group, rows: int, cols: int, dtype: torch.dtype,
                      quant: Optional[str] = None) -> list[str]:
    """One-shot and two-shot give the same bits (every output)."""
    x, residual, weight = norm_inputs(group, rows, cols, dtype, seed=3)
    one = all_reduce_rmsnorm(x, residual, weight, algorithm="one_shot", quant=quant)
    two = all_reduce_rmsnorm(x, residual, weight, algorithm="two_shot", quant=quant)
    fails = [f"rank {group.rank}: output {i} differs between one-shot and two-shot"
             for i, (a, b) in enumerate(zip(one, two))
             if not torch.equal(a.view(torch.uint8), b.view(torch.uint8))]
    return fails


def check_batch_invariance(group: Group, rows: int, cols: int, dtype: torch.dtype,
                           algorithm: str = "auto", quant: Optional[str] = None,
                           single_algorithm: str = "auto") -> list[str]:
    """Deterministic mode: row t of a ``rows``-token call equals row t computed alone (and
    in a call of the first ``t + 1`` rows), bitwise, for every output."""
    x, residual, weight = norm_inputs(group, rows, cols, dtype, seed=5)
    full = all_reduce_rmsnorm(x, residual, weight, deterministic=True, algorithm=algorithm,
                              quant=quant)
    fails = []
    for t in range(rows):
        alone = all_reduce_rmsnorm(x[t:t + 1], residual[t:t + 1], weight, deterministic=True,
                                   algorithm=single_algorithm, quant=quant)
        prefix = all_reduce_rmsnorm(x[:t + 1], residual[:t + 1], weight, deterministic=True,
                                    algorithm=algorithm, quant=quant)
        for i, (a, b, c) in enumerate(zip(full, alone, prefix)):
            row = a[t:t + 1].view(torch.uint8)
            if not torch.equal(row, b.view(torch.uint8)):
                fails.append(f"rank {group.rank}: output {i} row {t} differs computed alone")
            if not torch.equal(row, c[t:t + 1].view(torch.uint8)):
                fails.append(f"rank {group.rank}: output {i} row {t} differs in a prefix call")
    return fails


def back_to_back_schedule(calls: int, max_rows: int, cols: tuple, world_size: int,
                          seed: int = 0, distinct_rows: int = 16,
                          late: float = 0.25) -> list[tuple]:
    """``(rows, cols, algorithm, quant, late_rank)`` per call, the same on every rank (seeded):
    T drawn from ``distinct_rows`` values in 1..``max_rows`` (few signatures to warm up: see
    ``check_back_to_back``), one-shot and two-shot alternating,
    the quant modes in turn (every pair of form and mode, ``cols`` multiples of 128),
    ``late_rank`` a rank that starts the call late (or -1) for a fraction ``late`` of them."""
    import random

    rng = random.Random(seed)
    pool = [rng.randint(1, max_rows) for _ in range(distinct_rows)]
    quants = (None, "fp8_e4m3", "fp8_e4m3_128")
    out = []
    for i in range(calls):
        late_rank = rng.randrange(world_size) if rng.random() < late else -1
        out.append((rng.choice(pool), cols[rng.randrange(len(cols))],
                    ("one_shot", "two_shot")[i % 2], quants[(i // 2) % 3], late_rank))
    return out


def check_back_to_back(group: Group, schedule: list, dtype: torch.dtype, seed: int = 0,
                       delay=None) -> list[str]:
    """Every call of ``schedule`` (``back_to_back_schedule``) launched back to back, nothing
    synchronized between them (inputs made first, outputs kept), then every result checked
    as ``check_against_reference`` does: residual_out bitwise against the rank-ordered
    reference, normed within ulps, codes and scales bitwise against torch's quantization of
    the op's normed rows. ``delay(group)`` runs before each call whose ``late_rank`` is this
    rank (a host sleep). This is what catches a rank that finished call e and overwrites data
    a slower peer still reads for call e (on a GPU virtual world: ``launch(..., gate=False)``,
    else the launch gate synchronizes every call)."""
    inputs = [norm_inputs(group, rows, cols, dtype, seed=1000 * seed + i)
              for i, (rows, cols, _, _, _) in enumerate(schedule)]
    # every signature once first: its kernel compiled, its plan built and agreed on, the
    # workspace at its final size. The calls under test then meet on the host nowhere (no
    # new signature, no growth), so a rank runs on into its next call while a peer is late.
    for rows, cols, algorithm, quant in dict.fromkeys(call[:4] for call in schedule):
        x, res, w = norm_inputs(group, rows, cols, dtype, seed=7)
        all_reduce_rmsnorm(x, res, w, algorithm=algorithm, quant=quant)
    got = []
    for (rows, cols, algorithm, quant, late), (x, res, w) in zip(schedule, inputs):
        if late == group.rank and delay is not None:
            delay(group)
        got.append(all_reduce_rmsnorm(x, res, w, algorithm=algorithm, quant=quant))
    fails = []
    for i, ((rows, cols, algorithm, quant, _), (x, res, w), outs) in enumerate(
            zip(schedule, inputs, got)):
        want = reference.all_reduce_rmsnorm(x, res, w, 1e-6, group, quant)
        what = f"rank {group.rank}: call {i} (T={rows}, H={cols}, {algorithm}, {quant})"
        if not torch.equal(outs[1], want[1]):
            bad = (outs[1] != want[1]).any(-1).nonzero().flatten().tolist()
            fails.append(f"{what}: residual_out differs in rows {bad[:8]}")
        if not _close(outs[0], want[0]):
            fails.append(f"{what}: normed differs (max "
                         f"{(outs[0].float() - want[0].float()).abs().max()})")
        if quant:
            codes, scales = reference.quantize_fp8(outs[0], QUANT_GROUP[quant])
            if not torch.equal(outs[2].view(torch.uint8), codes.view(torch.uint8)):
                fails.append(f"{what}: codes differ")
            if not torch.equal(outs[3], scales):
                fails.append(f"{what}: scales differ")
    return fails
