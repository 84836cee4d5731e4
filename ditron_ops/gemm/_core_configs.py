"""Tile configurations of the persistent GEMM core and the rule that picks one per problem.

The rule (``select_config``) is a wave-quantization model over a few compiled candidates: a
persistent grid of ``programs`` runs ``tiles`` tiles in ``ceil(tiles / programs)`` waves (the
split tail runs a partial last wave of at most half the grid as half tiles), and a wave of
``BLOCK_M x BLOCK_N`` tiles costs the tile's area over the candidate's efficiency (its
throughput per unit of area, relative to 128x256 tiles)::

    time(c) ~ (full waves + HALF_TILE_COST * [a last wave of half tiles]) * area(c) / efficiency(c)

per K step. Every candidate has ``BLOCK_K = 64``, so the K loop has the same length under each:
K drops out of the comparison, and the rule reads only M, N and the program budget. That makes
it safe where ranks must agree (gemm_rs / gemm_ar exchange partial tiles, so all ranks need the
same tiles, while each rank's K_r may differ): every input of the rule is agreed.

Problems no taller than the tallest candidate (M <= 128 on the GPU) are memory-bound: a tile
costs what streaming its B columns costs, not its area, and tiles taller than M waste their MMA
rows and shared-memory stages. There only the shortest candidates (64 rows) compete (the same
model then compares their waves). Measured (fp32 out, H200, the six GEMM-RS model shapes):
the rule's 64-row choices 0.68-0.83x cuBLAS (geo-mean per M, M 1-128) against 0.45-0.58x for
the 128x256 tiles (benchmarks/NOTES.md, GEMM core).

Deterministic mode picks only candidates whose rows were measured bitwise equal to the 128x256
tiles' rows (``Candidate.deterministic``): BLOCK_K = 64 and the MMA's K order fixed, a row's
result does not depend on the M-side tiling (all 240 rows of ``benchmarks/probes/invariant_configs.py``).

Split-K (``select_split``; the default mode's plain ``matmul`` only, never deterministic mode,
whose K order per element is fixed, and never the fused ops' waiting kernels): where a
candidate's tiles are fewer than the program budget (under one wave) and K is long, the K loop
is cut into S slices of whole ``BLOCK_K`` steps, one program per (tile, slice) writing fp32
partials, then one reduce kernel sums them in slice order; taken only where the model puts it
under ``SPLIT_MARGIN`` of the unsplit time. Its time, in microseconds::

    time(c, S) = SPLIT_STEP_US x [waves of tiles x S] x area(c) / efficiency(c) x ceil(steps / S)
                 + S x M x N x 8 bytes / PARTIAL_BYTES_PER_S + SPLIT_LAUNCH_US

(``time(c, 1)`` is the tile rule's time x steps x ``STEP_US``: an S = 1 choice is always
``select``'s). The partial traffic and the fixed cost are fitted to forced split runs
(``benchmarks/probes/splitk_probe.py``; data and history: benchmarks/NOTES.md, GEMM core).

Two programs per SM (``short_k``; the plain ``matmul`` with a 2-byte C only, either mode):
where ``select`` picked the 128x256 tiles for a short K over two waves or more, 128x128 tiles
with two resident programs per SM hide each one's pipeline fill and C store under the other's
MMAs.

Wide tiles (``wide``; the plain ``matmul`` in the default mode with a 2-byte C): 272, 288 or
320 columns, weighed by the same wave model beside ``select``'s candidates, at an efficiency
low enough that they win only where they fill the SMs far better.

A sliced tail (``sliced_tail``; the default mode's plain ``matmul`` with a 2-byte C, tiles over
one wave or more): the whole waves unsplit, the partial last wave's tiles in K slices (split-K's
kernels over those tiles only), where the split-K model puts it clearly under the unsplit time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

LINE_BYTES = 128
"""The cache line (L1 and L2): a TMA box row of ``BLOCK_K = 64`` 2-byte elements, or of one
128-value fp8 K step, is one line when it starts on one (``_pad``, ``scaled.packed_row``)."""


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiles and schedule of the persistent GEMM (``persistent_gemm_kernel``; gemm_rs uses the
    tiles).

    ``split_tail``: a partial last wave of at most half the grid runs as half-width tiles
    (``SPLIT_TAIL``, ``tail_tiles``).
    ``swap_ab``: the plain ``matmul`` only, ``skinny_gemm_kernel`` (``C^T = B^T A^T``, tiles of
    ``block_n`` columns by ``block_m`` rows of C, the MMA's narrow side on M; no persistence).
    ``ctas_per_sm``: programs the persistent grid puts on each SM of the budget (2: two resident
    programs hide each other's per-tile prologue and epilogue; each then gets half the SM's
    shared memory, ``fit_stages``). The plain GEMM only: a waiting grid must be resident whole.
    ``strip``: the plain ``matmul`` only, ``strip_gemm_kernel``: tiles ``block_n + strip``
    columns wide (a second accumulator ``strip`` wide beside the first; ``tile_width``).
    ``tail_slices``: the default mode's plain ``matmul`` only (``sliced_tail``): the whole
    waves run unsplit, the tiles of a partial last wave in ``tail_slices`` K slices each
    (``_core.SlicedTailGemm``; 0: none).
    """
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split_tail: bool = False
    swap_ab: bool = False
    ctas_per_sm: int = 1
    strip: int = 0
    tail_slices: int = 0


def tile_width(cfg: TileConfig) -> int:
    """Columns of C one tile of ``cfg`` covers (``block_n``, plus its ``strip``)."""
    return cfg.block_n + cfg.strip


GPU_CONFIGS = {
    "128x256x64/s3": TileConfig(128, 256, 64, 8, 8, 3),
    "128x256x64/s4": TileConfig(128, 256, 64, 8, 8, 4),
    "128x256x64/s3/tail": TileConfig(128, 256, 64, 8, 8, 3, split_tail=True),
    "128x256x64/s4/tail": TileConfig(128, 256, 64, 8, 8, 4, split_tail=True),
}
"""Variants of the large tiles that the ``ag_gemm`` bench compares (``matmul(..., cfg=)``);
``GPU_CONFIG`` names the rule's large-M candidate. ``/tail`` (``split_tail``): the shapes that
trailed most filled their last wave worst (8192x1792: 448 tiles = 3.4 waves of 132 SMs).
History: benchmarks/NOTES.md, GEMM core."""
GPU_CONFIG = "128x256x64/s4/tail"
"""s4/tail: the best P1 in every run that measured it (0.978-0.997x cuBLAS geo-mean, H200, bf16,
model shapes at M=8192) and the lowest per-shape P2 in the last paired runs (at most 1.2%). It
needs 229 KB of shared memory (s3: 180 KB), so fp32 products drop to 3 stages (``fit_stages``).
Its weakest shape, 8192x1376x4096 (0.93x), is one cuBLAS runs with non-power-of-two tiles
(160x192), out of Triton's reach. History: benchmarks/NOTES.md, GEMM core."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A configuration the rule may pick.

    ``efficiency``: throughput per unit of tile area relative to the 128x256 tiles (fitted by
    ``tools/gemm_rule_fit.py``). ``deterministic``: its rows were measured bitwise equal to the
    128x256 tiles' rows (fp32 out, H200), so deterministic mode may pick it.
    ``tail_efficiency``: the same in whole waves beside a sliced tail (``sliced_tail``), where
    it was measured apart (None: ``efficiency``).
    """
    name: str
    cfg: TileConfig
    efficiency: float
    deterministic: bool
    tail_efficiency: Optional[float] = None


GPU_CANDIDATES = (
    Candidate(GPU_CONFIG, GPU_CONFIGS[GPU_CONFIG], 1.0, True),
    Candidate("128x128x64/s5/w4", TileConfig(128, 128, 64, 8, 4, 5), 0.81, False,
              tail_efficiency=0.9),
    Candidate("64x256x64/s4", TileConfig(64, 256, 64, 8, 4, 4), 0.69, True),
    Candidate("64x128x64/s6", TileConfig(64, 128, 64, 8, 4, 6), 0.55, True),
)
"""The rule's candidates on the GPU, in order of preference on a tie. Efficiencies fitted to the
H200 data by ``tools/gemm_rule_fit.py`` (each the middle of the interval in which no choice on
the data changes; table in benchmarks/NOTES.md, GEMM core): 128x128 0.81 (0.76-0.87: small or
ragged N, e.g. 14040x384x3264 0.57x -> 0.81x cuBLAS), 64x256 0.69 (0.55-0.81: small M where it
needs fewer waves, 168x8960x3152 0.71x -> 0.92x), 64x128 0.55 (0.41-0.67: at M <= 128 it wins
whenever it fits in one wave, 0.68-0.83x against 0.45-0.58x for 128x256; it also takes the
sweep's few-tile, long-K shapes from 128x128, where it runs twice the tiles, unmeasured).
128x128/s5/w4 is not measured bitwise against the others, so deterministic mode leaves it out.
Not among them: 64x64 tiles (0.58-0.87x at M <= 128, ahead of 64x128 on a few N = 4096 shapes
only), BLOCK_K = 32 (would change deterministic mode's K order) and 256x128 (0.60x geo).
128x128's ``tail_efficiency`` 0.9: its whole waves beside a sliced tail, fitted to the forced
slices of ``bench gemm_sweep --only tail`` (0.90-0.95 unbiased), as the split-K probe's forced
splits implied 0.91 (the other candidates were not measured there)."""
SKINNY_CANDIDATES = (
    Candidate("sw16x64x64/s8", TileConfig(16, 64, 64, 1, 4, 8, swap_ab=True), 1.0, True),
    Candidate("sw32x64x64/s10", TileConfig(32, 64, 64, 1, 4, 10, swap_ab=True), 1.0, True),
)
"""The plain ``matmul``'s tiles at M <= 32 on the GPU (``skinny``), whichever mode: C^T = B^T A^T
in tiles of 64 columns of C by 16 or 32 rows (``skinny_gemm_kernel``), one M block each. Why: a
decode-size product then streams B once through as many programs as N allows, without a 64-row
MMA that is almost all padding, and its rows were measured bitwise equal to the 128x256 tiles'
(the same 64-wide K steps); above 32 rows the 64-row tiles win again. The fused ops keep
``select_config``'s tiles (their kernels are not swapped). Figures: benchmarks/NOTES.md, GEMM
core, "Skinny tiles"."""


def skinny(m: int, device: torch.device) -> Optional[Candidate]:
    """The plain ``matmul``'s skinny candidate for ``m`` rows on ``device`` (the first of
    ``SKINNY_CANDIDATES`` whose rows hold ``m``), or None: taller than all of them, or off the
    GPU (the interpreter's ``tl.dot`` is numpy's, whose rounding depends on the block shape:
    deterministic mode keeps its 16x16 blocks there)."""
    if device.type != "cuda":
        return None
    return next((c for c in SKINNY_CANDIDATES if m <= c.cfg.block_m), None)


NARROW_CANDIDATES = (
    Candidate("64x64x64/s6", TileConfig(64, 64, 64, 8, 4, 6), 0.41, True),
)
"""Deterministic mode's extra tiles for the plain ``matmul`` up to ``NARROW_MAX_M`` rows on the
GPU (``narrow``), weighed by the wave model beside ``select``'s. Why: where 64x128 tiles leave
half the SMs idle, 64x64 tiles fill one wave, while two waves of them lose to one of 64x128.
Efficiency 0.41: the middle of the interval in which the model picks the faster tiles on every
forced-run shape. Rows measured bitwise equal to the 128x256 tiles'. Not in default mode (not
measured there) nor in the fused ops (no new variant in their precompile lists). Figures:
benchmarks/NOTES.md, GEMM core."""
NARROW_MAX_M = 128
"""The largest M at which the 64x64 tiles were measured (``NARROW_CANDIDATES``)."""


def narrow(m: int, device: torch.device, deterministic: bool) -> tuple[Candidate, ...]:
    """The plain ``matmul``'s extra candidates for ``m`` rows: ``NARROW_CANDIDATES`` in
    deterministic mode on the GPU up to ``NARROW_MAX_M`` rows, else none."""
    if device.type != "cuda" or not deterministic or m > NARROW_MAX_M:
        return ()
    return NARROW_CANDIDATES


WIDE_CANDIDATES = tuple(
    Candidate(f"128x{256 + r}x64/s4", TileConfig(128, 256, 64, 8, 8, 4, strip=r), 0.75, False)
    for r in (16, 32, 64))
"""The default mode's extra tiles for the plain ``matmul`` with a 2-byte C on the GPU
(``wide``): 128 rows by 272, 288 or 320 columns (``strip_gemm_kernel``), weighed by the wave
model beside ``select``'s. Why: where N is just past a multiple of 256 (8248x544: three
columns of 256-wide tiles, the last 32 wide) or the 128x256 tiles leave a near-empty last
wave, a width between the powers of two fits N or the SMs (cuBLAS runs 160x192 and 208x192
tiles there). Their K steps run slower per unit of area (the strip's narrow second MMA), so
the efficiency is 0.75: the low end of the interval in which the model picks them on exactly
the measured shapes where they ran faster (``bench gemm_sweep --only wide``; figures:
benchmarks/NOTES.md, GEMM core). Stages fitted to the shared memory (``fit_stages``: 3). Not in deterministic mode (rows not measured bitwise) nor
in the fused ops (their kernels have no strip)."""


def wide(m: int, device: torch.device, deterministic: bool,
         out_bytes: int) -> tuple[Candidate, ...]:
    """The plain ``matmul``'s ``WIDE_CANDIDATES`` in the default mode on the GPU with a 2-byte
    C, else none (``select``'s shortlist drops them at M <= 128, as every 128-row tile)."""
    if device.type != "cuda" or deterministic or out_bytes != 2:
        return ()
    return WIDE_CANDIDATES


SHORT_K_CANDIDATE = Candidate("128x128x64/s3/w4/o2",
                              TileConfig(128, 128, 64, 8, 4, 3, ctas_per_sm=2), 1.0, True)
"""The plain ``matmul`` with a short K over many waves and a 2-byte C (``short_k``): 128x128
tiles, two programs per SM (3 stages each fit half the SM's shared memory), so one program's
pipeline fill and C store run under the other's MMAs. Why: with a dozen or two K steps a
tile's fill and epilogue are a large share of it, and 128x256 tiles run one program per SM.
Measured +2-11% over the rule's 128x256 tiles on the sweep shapes it takes, -9-12% on short-K
shapes under two waves (H200; benchmarks/NOTES.md, GEMM core, "Two programs per SM"). Its
rows were measured bitwise those of the 128x256 tiles (``benchmarks/probes/invariant_pairs.py``; a 2-byte C
rounds the same fp32 sums), so deterministic mode takes it too."""
SHORT_K_MAX_STEPS = 24
"""Most ``BLOCK_K`` steps at which ``short_k`` applies (every measured gain at 9-25 steps; from
30 steps on the 128x128 pairs lost up to 25% on many-wave shapes)."""
SHORT_K_MIN_WAVES = 2
"""Fewest waves of 128x256 tiles at which ``short_k`` applies (under two waves the pairs lost)."""


def short_k(first: Candidate, m: int, n: int, k: int, programs: int, device: torch.device,
            out_bytes: int, lined: bool = True) -> bool:
    """Whether the plain ``matmul`` takes ``SHORT_K_CANDIDATE`` over ``first`` (``select``'s
    choice), in either mode: on the GPU, ``first`` the 128x256 tiles, at most
    ``SHORT_K_MAX_STEPS`` K steps, at least ``SHORT_K_MIN_WAVES`` waves of them, a 2-byte C
    (an fp32 C block leaves each program two stages, and the pairs then ran slower than the
    128x256 tiles: benchmarks/NOTES.md, GEMM core) and both operands' rows on 128-byte lines
    (``lined``: off them the pairs ran 0.6-0.7x as fast as on them, far more than the 128x256
    tiles lose; benchmarks/NOTES.md, GEMM core, "Operand rows off 128-byte lines")."""
    if (device.type != "cuda" or first.cfg != GPU_CONFIGS[GPU_CONFIG] or out_bytes != 2
            or not lined):
        return False
    tiles = -(-m // first.cfg.block_m) * -(-n // first.cfg.block_n)
    return -(-k // first.cfg.block_k) <= SHORT_K_MAX_STEPS and tiles >= SHORT_K_MIN_WAVES * programs


HALF_TILE_COST = 0.72
"""Time of a split-tail half tile in full tiles (0.5 ideal; the data allow 0.62-0.85)."""

INTERPRETER_CANDIDATES = (
    Candidate("32x16x16", TileConfig(32, 16, 16, 4, 4, 1), 1.0, False),
    Candidate("16x16x16", TileConfig(16, 16, 16, 4, 4, 1), 1.0, True),
)
"""Small tiles in the interpreter (its cost is per element of every block, masked or not, so the
model there minimizes padded rows); the M side varies (16 rows up to M = 32, then whichever
pads less) so CPU tests see the tiling change with M. Deterministic mode keeps 16x16 blocks:
the interpreter's ``tl.dot`` is numpy's matmul, whose rounding depends on the block's height and
width with some OpenBLAS kernels (Zen: every height from 1 to 128 gave other bits than 16-row
blocks), which the GPU's MMA does not. Tests swap in other tuples (``split_tail`` with
``block_n=32``)."""


def candidates(device: torch.device, deterministic: bool) -> tuple[Candidate, ...]:
    """The candidates of ``device``'s kind (GPU: Hopper TMA + wgmma; else the interpreter),
    only those verified batch invariant in deterministic mode."""
    cands = GPU_CANDIDATES if device.type == "cuda" else INTERPRETER_CANDIDATES
    return tuple(c for c in cands if c.deterministic or not deterministic)


def rule_configs(device: torch.device) -> tuple[TileConfig, ...]:
    """Every configuration the rule can pick on ``device`` (either mode): what ``precompile``
    and ``tools/sm90_compile.py`` compile."""
    return tuple(dict.fromkeys(c.cfg for c in candidates(device, False)))


def tail_tiles(tiles: int, programs: int, cfg: TileConfig) -> int:
    """Tiles the consumer runs as half tiles (``split_tail``): a partial last wave of at most
    half the grid (its halves then fit in one wave), else 0 (e.g. 448 tiles on 132 programs:
    the last 52 as 104 halves, 3.5 waves instead of 4)."""
    left = tiles % programs
    return left if cfg.split_tail and 0 < 2 * left <= programs else 0


def waves(tiles: int, programs: int, cfg: TileConfig) -> tuple[int, bool]:
    """``(full waves, whether a last wave of half tiles follows)`` of ``tiles`` on a persistent
    grid of ``programs``: with ``split_tail`` every tile runs as two halves when they fit the
    budget (``consumer_grid``), else a partial last wave of at most half the grid
    (``tail_tiles``)."""
    if cfg.split_tail and 2 * tiles <= programs:
        return 0, True
    full, left = divmod(tiles, programs)
    if left and tail_tiles(tiles, programs, cfg):
        return full, True
    return full + (left > 0), False


def predicted_time(c: Candidate, m: int, n: int, programs: int) -> float:
    """The model's time of ``c`` per K step, in steps of a 128x256 tile at full efficiency."""
    cfg = c.cfg
    tiles = -(-m // cfg.block_m) * -(-n // tile_width(cfg))
    full, half = waves(tiles, max(1, programs), cfg)
    area = cfg.block_m * tile_width(cfg) / (128 * 256)
    return (full + HALF_TILE_COST * half) * area / c.efficiency


def select(m: int, n: int, programs: int, device: torch.device, *,
           deterministic: bool, extra: tuple[Candidate, ...] = ()) -> Candidate:
    """``select_config``'s candidate (with its name, for benches and the fitting tool);
    ``extra``: candidates weighed beside the device's (the plain ``matmul``'s ``narrow``)."""
    return min(_shortlist(m, device, deterministic, extra),
               key=lambda c: predicted_time(c, m, n, programs))  # (first on a tie)


SCALED_BLOCK_K = 128
"""fp8 operands' K step: one scale block (``scaled.SCALE_BLOCK``; block-wise scales need a K step
per block, ``_core_kernels.tile_product``'s ``SCALE``)."""
SCALED_TILES = dict(block_k=SCALED_BLOCK_K, split_tail=False)
"""What every fp8 form changes in the bf16 rule's tiles: one K step per scale block, and no
split tail: with it ptxas serializes the wgmma of every 128-row fp8 form on tensor / row scales
(C7514; benchmarks/NOTES.md, fp8)."""


SCALED_NARROW = dict(block_n=128, num_warps=8, num_stages=5)
"""The fp8 narrow tile (128 x 128, 8 warps): the promoted product doubles the accumulator, and
the bf16 rule's 128x256 tile spills on sm_90a where this one barely does (figures and command:
benchmarks/NOTES.md, "The fp8 tile rule")."""
SCALE_ROWWISE, SCALE_BLOCKWISE = 1, 2
"""``Scales.mode`` of tensor- or row-wise scales and of 1x128 / 128x128 block scales."""


def scaled_config(cfg: TileConfig, mode: int, m: int, n: int, programs: int,
                  deterministic: bool = False) -> TileConfig:
    """The tiles of an fp8 (scaled) ``[m, K] @ [K, n]`` product of scale ``mode`` whose bf16
    rule picked ``cfg`` on ``programs``: one K step per scale block and no split tail
    (``SCALED_TILES``), and
    the narrow tile (``SCALED_NARROW``) in place of a 128-row tile for block scales always,
    for tensor and row scales where ``cfg`` is 128 wide (the same tile with twice the warps)
    or its tiles fill at most 3/4 of the programs (twice the programs then work; a full wave
    gains nothing), outside the deterministic mode (it adds no dependence on M there). The one
    place the fp8 paths (plain, ag_gemm consumer, gemm_rs producer) derive their tiles;
    ``precompile`` compiles what it can give (``scaled_forms``)."""
    wide, narrow = scaled_configs(cfg)
    if narrow is None:
        return wide
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if (mode == SCALE_BLOCKWISE or cfg.block_n <= 128
            or (not deterministic and 4 * tiles <= 3 * programs)):
        return narrow
    return wide


def scaled_configs(cfg: TileConfig) -> tuple[TileConfig, Optional[TileConfig]]:
    """``(wide, narrow)``: the fp8 forms ``scaled_config`` may give ``cfg`` (narrow None where
    it keeps the wide one: tiles of other than 128 rows)."""
    wide = dataclasses.replace(cfg, **SCALED_TILES)
    return wide, (dataclasses.replace(wide, **SCALED_NARROW) if cfg.block_m == 128 else None)


def scaled_forms(cfg: TileConfig) -> tuple[tuple[TileConfig, int], ...]:
    """Every ``(tiles, scale mode)`` ``scaled_config`` can give ``cfg`` over all problems
    (``precompile``'s list): the narrow form for both modes where there is one, the wide form
    for tensor/row scales unless ``cfg`` is 128 wide (then always narrow)."""
    wide, narrow = scaled_configs(cfg)
    if narrow is None:
        return (wide, SCALE_ROWWISE), (wide, SCALE_BLOCKWISE)
    return ((narrow, SCALE_ROWWISE), (narrow, SCALE_BLOCKWISE)) + (
        ((wide, SCALE_ROWWISE), ) if cfg.block_n > 128 else ())


def select_config(m: int, n: int, programs: int, device: torch.device, *,
                  deterministic: bool) -> TileConfig:
    """The tile configuration for an ``[m, K] @ [K, n]`` product on a persistent grid of at most
    ``programs`` programs (the rank's ``program_budget``): the candidate of least predicted
    time (module docstring). A pure function of its arguments.

    Parameters
    ----------
    m, n : int
        Rows and columns of the product (gemm_rs / gemm_ar: M and N, agreed by all ranks).
    programs : int
        The persistent grid's budget (a virtual rank's SM share; the interpreter's one program).
    device : torch.device
        GPU candidates on CUDA, the interpreter's elsewhere.
    deterministic : bool
        Only candidates verified batch invariant (deterministic mode); every candidate has
        ``BLOCK_K = 64`` and none splits K, so the K order per output element never changes.

    Returns
    -------
    TileConfig
        One of ``rule_configs(device)``; its stages may still be cut by ``fit_stages``.

    Notes
    -----
    K and the dtype do not enter: the K loop is equally long under every candidate, and fp16
    and bf16 run the same MMA. Selection runs while a call's plan is built (the plan keys hold
    M, N, the device and the mode), so a repeated call does not select again.
    """
    return select(m, n, programs, device, deterministic=deterministic).cfg


# -- split-K ---------------------------------------------------------------------------------

STEP_US = 0.66
"""One ``BLOCK_K = 64`` step of a 128x256 tile at efficiency 1, microseconds, unsplit under one
wave: the median of measured time / (``predicted_time`` x K steps) over the candidates' 39 rows
with fewer tiles than SMs in the H200 sweep data (0.45-0.85; ``tools/gemm_rule_fit.py``
prints it). Only its ratio to the costs below matters."""
SPLIT_STEP_US = 0.73
"""The same step with K split: the median over the candidates' 105 rows of one wave or more
(a split fills the SMs, which then share the memory and the power). The sweep's split runs
agree: fitted free with the two constants below it comes to 0.76."""
PARTIAL_BYTES_PER_S = 3e12
"""Rate of the fp32 partials' traffic (each written once by the split GEMM and read once by the
reduce: ``S x M x N x 8`` bytes), bytes/s: fitted with ``SPLIT_LAUNCH_US`` to 109 forced split
runs of ``benchmarks/probes/splitk_probe.py`` (the middle of the values that pick alike; history:
benchmarks/NOTES.md, GEMM core)."""
SPLIT_LAUNCH_US = 3.0
"""Fixed cost of a split call over the unsplit one (the reduce kernel's launch and latency, the
split GEMM's exposed pipeline fill), microseconds (fit: ``PARTIAL_BYTES_PER_S``)."""
SPLIT_MARGIN = 0.85
"""A split is taken only where the model puts it under this fraction of the unsplit time. Why:
the model errs more on shapes it was not fitted to than its fit says, so a split that wins by
a few % of model time is a coin toss that costs partial traffic and a launch (the sweep's case:
benchmarks/NOTES.md, GEMM core). Few tiles over a very long K still split (256x512x65536)."""
MAX_SPLIT = 8
"""Most K slices the rule picks (what ``bench gemm_sweep --only splitk`` measures: 1, 2, 4, 8)."""
MIN_SLICE_STEPS = 4
"""Fewest ``BLOCK_K`` steps per slice: a shorter K loop does not fill the 4-6 stage pipeline."""


def slices(k: int, block_k: int, split: int) -> tuple[int, int]:
    """``(slices, steps)`` of cutting ``ceil(k / block_k)`` K steps into ``split`` slices of
    ``steps = ceil(total / split)`` steps each (every slice but the last a whole number of
    ``block_k``), without empty slices: ``slices <= split`` (e.g. 9 steps in 4: 3 x 3)."""
    total = max(1, -(-k // block_k))
    steps = -(-total // max(1, split))
    return -(-total // steps), steps


def split_time_us(c: Candidate, m: int, n: int, k: int, programs: int, split: int) -> float:
    """The model's time of ``c`` with K in ``split`` slices (module docstring), microseconds;
    ``split = 1`` is ``predicted_time`` x K steps x ``STEP_US`` (no partials, no reduce)."""
    cfg = c.cfg
    used, steps = slices(k, cfg.block_k, split)
    if used == 1:
        return predicted_time(c, m, n, programs) * steps * STEP_US
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    full, _ = waves(tiles * used, max(1, programs), dataclasses.replace(cfg, split_tail=False))
    area = cfg.block_m * cfg.block_n / (128 * 256)
    return (full * area / c.efficiency * steps * SPLIT_STEP_US
            + used * m * n * 8 / PARTIAL_BYTES_PER_S * 1e6 + SPLIT_LAUNCH_US)


def _shortlist(m: int, device: torch.device, deterministic: bool,
               extra: tuple[Candidate, ...] = ()) -> tuple[Candidate, ...]:
    """``select``'s candidates for ``m`` (only the shortest tiles when memory-bound)."""
    cands = candidates(device, deterministic) + extra
    if m <= max(c.cfg.block_m for c in cands):
        shortest = min(c.cfg.block_m for c in cands)
        cands = tuple(c for c in cands if c.cfg.block_m == shortest)
    return cands


def split_options(m: int, n: int, k: int, programs: int, device: torch.device, *,
                  deterministic: bool) -> list[tuple[Candidate, int]]:
    """The split ``(candidate, slices)`` the rule weighs against ``select``'s unsplit choice:
    none in deterministic mode; else, for each of ``select``'s candidates with fewer tiles than
    ``programs`` (under one wave), every count of 2 to ``MAX_SPLIT`` slices (as ``slices``
    leaves it, each once) of at least ``MIN_SLICE_STEPS`` steps a slice."""
    if deterministic:  # batch invariance: one K order per element, never split (DESIGN.md §7)
        return []
    out = []
    for c in _shortlist(m, device, False):
        if -(-m // c.cfg.block_m) * -(-n // c.cfg.block_n) >= programs:
            continue
        seen = {1}
        for s in range(2, MAX_SPLIT + 1):
            used, steps = slices(k, c.cfg.block_k, s)
            if used not in seen and steps >= MIN_SLICE_STEPS:
                seen.add(used)
                out.append((c, used))
    return out


SLICED_TAIL_MAIN = Candidate("128x256x64/s4", GPU_CONFIGS["128x256x64/s4"], 1.0, False)
"""The tiles of a sliced tail's unsplit launch (``sliced_tail``): ``GPU_CONFIG``'s without its
half-tile tail (the K slices take the last wave instead)."""
TAIL_LAUNCH_US = 12.0
"""Fixed cost of a sliced tail over the unsplit tiles, microseconds: its split launch waits for
the whole waves to drain, then the reduce follows (three launches against one). Fitted with
``PARTIAL_BYTES_PER_S`` kept to ``bench gemm_sweep --only tail``'s forced slices (10-15 us
score alike; data: benchmarks/NOTES.md, GEMM core)."""
TAIL_MARGIN = 0.95
"""A sliced tail is taken only where the model puts it under this fraction of the unsplit
time. Why: the model's error on the forced runs is about 4% rms, and a tail cut by less changes
a few % of the call."""


def sliced_tail(first: Candidate, m: int, n: int, k: int, programs: int, device: torch.device,
                *, deterministic: bool, out_bytes: int, lined: bool = True
                ) -> Optional[Candidate]:
    """``select``'s tiles with their partial last wave in K slices, where the model puts them
    under ``TAIL_MARGIN`` of the unsplit choice ``first``'s time (``predicted_time x steps``,
    in 128x256 K steps; ``first``'s own tiles sliced are weighed against it at their
    ``tail_efficiency``, like against like); else None.

    Where a candidate's tiles fill one wave or more and leave a partial last one (e.g. 664
    128x256 tiles on 132 programs: five waves and 4 tiles), the whole waves run unsplit and the
    last wave's tiles run as ``S`` K slices each in a second launch (``splitk_gemm_kernel``;
    fp32 partials, then ``splitk_reduce_kernel``), so the last wave takes about ``1 / S`` of a
    wave instead of a whole one (or ``HALF_TILE_COST`` of one as half tiles). The model, in
    128x256 K steps::

        (full x steps + ceil(left x S / programs) x ceil(steps / S)) x area / efficiency
          + (left x S x tile x 8 B / PARTIAL_BYTES_PER_S + TAIL_LAUNCH_US) / SPLIT_STEP_US

    the least over ``select``'s candidates and ``S`` in 2..``MAX_SPLIT`` (at least
    ``MIN_SLICE_STEPS`` steps a slice), each candidate at its ``tail_efficiency``; tiles other
    than 128x256 only where both operands' rows start on 128-byte lines (``lined``: with K 8
    past a multiple of 64, 128x128 tiles ran 0.6-0.7x as fast as with K on it, the 128x256
    ones far less slowed; benchmarks/NOTES.md, GEMM core).

    Only the default mode (the last wave's rows get another K order: not batch invariant), the
    GPU (the unsplit launch runs a candidate's tiles, ``GPU_CONFIG``'s without the half-tile
    tail: ``SLICED_TAIL_MAIN``) and a 2-byte C (those launches' precompiled variants;
    ``precompile_plain_only``).
    """
    if deterministic or device.type != "cuda" or out_bytes != 2:
        return None
    versus = predicted_time(first, m, n, programs) * -(-k // first.cfg.block_k)
    best, best_t = None, None
    for c in _shortlist(m, device, False):
        cfg = c.cfg
        if cfg != GPU_CONFIGS[GPU_CONFIG] and not lined:
            continue  # (narrower tiles with rows off 128-byte lines: far slower, measured)
        bar = TAIL_MARGIN * versus * (c.efficiency / (c.tail_efficiency or c.efficiency)
                                      if cfg == first.cfg else 1.0)
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        full, left = divmod(tiles, max(1, programs))
        if full == 0 or left == 0:
            continue
        steps = -(-k // cfg.block_k)
        cost = cfg.block_m * cfg.block_n / (128 * 256) / (c.tail_efficiency or c.efficiency)
        for s in range(2, MAX_SPLIT + 1):
            used, per = slices(k, cfg.block_k, s)
            if per < MIN_SLICE_STEPS or used != s:
                continue
            partials_us = left * used * cfg.block_m * cfg.block_n * 8 / PARTIAL_BYTES_PER_S * 1e6
            t = ((full * steps + -(-left * used // programs) * per) * cost
                 + (partials_us + TAIL_LAUNCH_US) / SPLIT_STEP_US)
            if t < bar and (best_t is None or t < best_t):
                best, best_t = (c, used), t
    if best is None:
        return None
    c, used = best
    if c.cfg == GPU_CONFIGS[GPU_CONFIG]:
        c = SLICED_TAIL_MAIN
    return Candidate(f"{c.name}/kt{used}",
                     dataclasses.replace(c.cfg, split_tail=False, tail_slices=used), c.efficiency,
                     False)


def select_split(m: int, n: int, k: int, programs: int, device: torch.device, *,
                 deterministic: bool, split: int | None = None,
                 out_bytes: int = 2, lined: Optional[bool] = None) -> tuple[Candidate, int]:
    """Tiles and K slices for the plain ``matmul`` (``[m, k] @ [k, n]`` on ``programs``):
    ``skinny``'s candidate at small M (unsplit, either mode; a forced ``split`` in the default
    mode takes the 64-row tiles instead), else ``select``'s candidate (``narrow``'s tiles
    weighed too) unsplit, or ``SHORT_K_CANDIDATE`` where ``short_k`` says (either mode: it
    does not split), else ``select``'s with ``wide``'s tiles weighed too, unless a split
    option (``split_options``; default mode) has a
    ``split_time_us`` under ``SPLIT_MARGIN`` times the unsplit one (the least such); an
    unsplit choice of the default mode then takes ``sliced_tail``'s last wave in K slices
    where it says. A pure function of its arguments.

    Parameters
    ----------
    m, n, k : int
        The product's shape (K enters here, unlike ``select_config``: only the plain GEMM
        splits, where no other rank must agree on the tiles).
    programs : int
        The program budget (``_core.program_budget``); the interpreter's 1 never splits.
    device : torch.device
    deterministic : bool
        True: never split (one K order per element); only tiles whose rows are the 128x256
        tiles' (``skinny``'s, ``select``'s, ``narrow``'s or ``SHORT_K_CANDIDATE``).
    split : int, optional
        Slices forced (benches, tests: ``matmul(..., split_k=)``; default mode only): the
        candidate of least time at that count, returned with the slices ``slices`` leaves;
        1 is the unsplit choice (``skinny``'s or ``select``'s).
    out_bytes : int
        Bytes per element of C (``short_k`` and ``wide``: 2-byte C only).
    lined : bool, optional
        Whether both operands' rows start on 128-byte lines as the GEMM reads them (after
        ``pad_operands``' copies; ``short_k`` and ``sliced_tail``); default: K a multiple of 64
        (A's rows and a weight's ``w.t()``'s of whole 2-byte lines, the bases on lines as
        fresh tensors are; a row-major ``[K, N]`` B's rows are N long: ``matmul`` passes what
        its operands say).

    Returns
    -------
    tuple of (Candidate, int)
        The candidate and the slices to run (1: the unsplit persistent GEMM, or with
        ``cfg.tail_slices`` its whole waves unsplit and the last in K slices).
    """
    thin = skinny(m, device)
    if thin is not None and (deterministic or split is None or split == 1):
        return thin, 1
    lined = k % 64 == 0 if lined is None else lined
    first = select(m, n, programs, device, deterministic=deterministic,
                   extra=narrow(m, device, deterministic))
    if split is None and short_k(first, m, n, k, programs, device, out_bytes, lined):
        return SHORT_K_CANDIDATE, 1  # (at two waves or more nothing splits)
    if split is None:  # (after short_k: its shapes were measured against 128x256 tiles only)
        first = select(m, n, programs, device, deterministic=deterministic,
                       extra=narrow(m, device, deterministic) + wide(m, device, deterministic,
                                                                     out_bytes))
    if deterministic or split == 1:
        return first, 1
    if split is not None:
        best = min(_shortlist(m, device, False),
                   key=lambda c: split_time_us(c, m, n, k, programs, split))
        return best, slices(k, best.cfg.block_k, split)[0]
    best, best_t = (first, 1), SPLIT_MARGIN * split_time_us(first, m, n, k, programs, 1)
    for c, s in split_options(m, n, k, programs, device, deterministic=False):
        t = split_time_us(c, m, n, k, programs, s)
        if t < best_t:  # (the unsplit choice exactly at the margin)
            best, best_t = (c, s), t
    if best[1] == 1:  # (split options need under one wave of tiles, a sliced tail one or more)
        tail = sliced_tail(first, m, n, k, programs, device, deterministic=False,
                           out_bytes=out_bytes, lined=lined)
        return (tail, 1) if tail is not None else best
    return best


# -- operand rows off 128-byte lines -----------------------------------------------------------

MISALIGNED_SLOWDOWN = {"wide": (1.026, 1.056, 1.234), "narrow": (1.12, 1.25, 1.42)}
"""Time of the rule's GEMM with A's rows, B's rows or both starting off 32-byte sectors (bf16,
K 8 past a multiple of 16; the others on 128-byte lines), over its time with both on lines, by
the tiles the rule picks with both on lines: "wide", 128 rows by 256 columns or more, else
"narrow" (128x128, 64-row tiles; their A and B boxes each carry half as many bytes a step).
The medians over the 24 shapes of ``benchmarks/probes/align_probe.py`` (H200; per shape 1.0-1.4 wide and
1.04-1.8 narrow; cuBLAS itself ran up to 1.5x faster on lined copies). Rows on sectors but
off lines (K a multiple of 16, not of 64) cost the 128x256 tiles about 1% and are never
copied for it (``_pad.off_sectors``). Tiles with a strip (``wide``) are not in it: the two
shapes where the rule picks them measured 1.08-1.09 with both off and 1.0-1.08 with one, and
copying one operand lost 7% on 4024x1280x1576."""
COPY_BYTES_PER_S = 3.6e12
"""Rate of ``pad_rows_kernel``, bytes read plus bytes written per second (H200: 3.5-3.7e12
from 70 MB up, up to 5.8e12 at 20-45 MB, whose reads hit L2)."""
COPY_LAUNCH_US = 1.0
"""Fixed cost of one operand copy, microseconds (copies of 3.5-8 MB took 1.8-2.5 us)."""
PAD_MARGIN = 0.95
"""Copies are made only where the model puts the call under this fraction of its time without
them (the slowdowns above are medians of a wide spread)."""


def misaligned_slowdown(c: Candidate, a_off: bool, b_off: bool) -> float:
    """``MISALIGNED_SLOWDOWN`` of ``c``'s tiles with A's / B's rows off sectors (1 with none,
    and for tiles with a strip)."""
    if not (a_off or b_off) or c.cfg.strip:
        return 1.0
    family = "wide" if c.cfg.block_m == 128 and tile_width(c.cfg) >= 256 else "narrow"
    return MISALIGNED_SLOWDOWN[family][2 if a_off and b_off else 0 if a_off else 1]


def estimated_us(c: Candidate, split: int, m: int, n: int, k: int, programs: int) -> float:
    """The model's time of ``select_split``'s ``(c, split)`` in microseconds: ``split_time_us``
    (``STEP_US`` a step under one wave, ``SPLIT_STEP_US`` from one wave on, where every SM
    loads)."""
    if split > 1:
        return split_time_us(c, m, n, k, programs, split)
    tiles = -(-m // c.cfg.block_m) * -(-n // tile_width(c.cfg))
    step = SPLIT_STEP_US if tiles >= programs * c.cfg.ctas_per_sm else STEP_US
    return predicted_time(c, m, n, programs) * -(-k // c.cfg.block_k) * step


def pad_operands(m: int, n: int, k: int, programs: int, device: torch.device, *,
                 deterministic: bool, out_bytes: int, a_sectored: bool, b_sectored: bool,
                 elem_bytes: int = 2) -> tuple[bool, bool]:
    """Whether the plain ``matmul`` copies A's and B's rows onto 128-byte lines before the GEMM
    (``_pad.RowPad``): the set of copies of least modelled time, where under ``PAD_MARGIN`` of
    none. An operand is a candidate only where its K-long rows (A's; B's given as a weight's
    ``w.t()``, the layout measured) start off 32-byte sectors (``a_sectored`` / ``b_sectored``
    False; ``matmul`` passes a row-major ``[K, N]`` B as on sectors)::

        time = T x misaligned_slowdown(tiles, operands left off sectors)
               + sum over copies (rows x K x elem_bytes x 2 / COPY_BYTES_PER_S + COPY_LAUNCH_US)

    with ``T`` the rule's choice on lined rows (``select_split``, ``estimated_us``). Either mode
    (a copy changes no value, so no bit of the product); never at the skinny tiles' M (there
    the product is as fast as reading B once, which a copy doubles). On the GPU only.

    Example: 16360x2560x7528 (bf16): both operands off sectors; copying B (2560 rows, 38.5 MB)
    took 22 us and cut the GEMM from 1090 us to 860 us (H200, ``benchmarks/probes/align_probe.py``).
    """
    if device.type != "cuda" or skinny(m, device) is not None or (a_sectored and b_sectored):
        return False, False
    c, split = select_split(m, n, k, programs, device, deterministic=deterministic,
                            out_bytes=out_bytes, lined=True)
    t = estimated_us(c, split, m, n, k, programs)

    def copy_us(rows: int) -> float:
        return rows * k * elem_bytes * 2 / COPY_BYTES_PER_S * 1e6 + COPY_LAUNCH_US

    best, best_t = (False, False), t * misaligned_slowdown(c, not a_sectored, not b_sectored)
    bar = PAD_MARGIN * best_t
    for pad_a in (False,) if a_sectored else (False, True):
        for pad_b in (False,) if b_sectored else (False, True):
            cost = (t * misaligned_slowdown(c, not (a_sectored or pad_a), not (b_sectored or pad_b))
                    + (copy_us(m) if pad_a else 0.0) + (copy_us(n) if pad_b else 0.0))
            if (pad_a or pad_b) and cost < bar and cost < best_t:
                best, best_t = (pad_a, pad_b), cost
    return best
