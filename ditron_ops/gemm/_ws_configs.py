"""Tiles, schedules and the planning rule of the warp-specialized sm_90 GEMM (``_ws_kernels``).

Pure Python (no torch, no triton): the rule is unit-tested on CPU (``tests/test_ws_rule.py``).

Schedules (``WsPlan.mode``) of the persistent grid of ``grid`` programs:

* ``MODE_DP`` (0): data parallel. Program ``p`` takes whole tiles ``p, p + grid, ...``.
* ``MODE_SK`` (1): stream-K after ``dp_tiles`` data-parallel tiles (a multiple of ``grid``).
  The remaining tiles' K steps form one iteration space, cut into ``grid`` contiguous ranges
  of equal length (+-1); a tile whose K steps fall into several ranges gets one fp32 partial per
  range, and the last-arriving range (a per-tile arrival counter) sums the partials in K order
  (range 0, 1, ...: one fixed order, one rounding): deterministic run to run on a given GPU,
  not batch invariant (the ranges move with M).
* ``MODE_SPLIT`` (2): split-K into ``split`` equal K slices per tile (each a work unit), fixed
  order reduction as above. With ``split`` a function of K alone and a fixed tile config the
  K order of every output element is independent of M (the deterministic mode's option).
* ``MODE_SPLITR`` (3): split-K as ``MODE_SPLIT``, but every slice ``j`` stores its fp32 partial
  to plane ``j`` of an ``[split, M, N]`` workspace (no counters, no last-arriver), and a second,
  elementwise kernel sums the planes in slice order ``0..split-1`` (+ bias, one rounding) over
  all SMs. Deterministic; for few-tile shapes (the reduction is spread, not serialized on the
  tile's last unit).

The rule (``plan``) is a cost model in units of one K step of the chosen tile: it never looks
at a list of shapes (DESIGN.md section 12).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

SMEM_BYTES = 232448
"""Dynamic shared memory an sm_90 program may use (227 KiB)."""
SMEM_RESERVE = 1024
"""Bytes kept back from ``SMEM_BYTES`` for the mbarriers and the allocator's alignment."""

MODE_DP, MODE_SK, MODE_SPLIT, MODE_SPLITR = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Tiles and consumer schedule of ``ws_gemm_kernel``.

    ``pingpong``: two 4-warp consumers owning alternate work units (``num_warps`` must be 4),
    else one consumer of ``num_warps`` warps (8: two warpgroups on one tile). ``stages``: ring
    depth (0: the most that fit beside the epilogue's staging tiles, ``fit_stages``).
    ``epi_n``: columns per TMA store of C (a power-of-two divisor of ``block_n``).
    ``block_n2``: columns of a second accumulator right of the first (its own B box and wgmma;
    0: none), for tile widths no power of two gives (Gluon tensors are powers of two);
    data-parallel schedules only.
    """
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    pingpong: bool
    stages: int = 0
    group_m: int = 8
    epi_n: int = 64
    block_n2: int = 0

    @property
    def consumers(self) -> int:
        return 2 if self.pingpong else 1

    @property
    def tile_n(self) -> int:
        """Columns of one output tile (both accumulators)."""
        return self.block_n + self.block_n2


WS_CONFIGS = {
    # CUTLASS "cooperative": 2 warpgroups x (64 x 256) of one 128x256 tile.
    "coop128x256": WsConfig(128, 256, 64, 8, False),
    # CUTLASS "ping-pong": 2 warpgroups, each a whole 128x128 tile (2 x m64n128 per K16).
    "pp128x128": WsConfig(128, 128, 64, 4, True),
    # Ping-pong with 64x256 tiles per warpgroup (one m64n256 per K16, as the coop's halves).
    "pp64x256": WsConfig(64, 256, 64, 4, True),
    # Smaller tiles for few-tile shapes (more programs; operands of such shapes sit in L2).
    "pp64x128": WsConfig(64, 128, 64, 4, True),
    "coop128x128": WsConfig(128, 128, 64, 8, False),
    # pp64x128 with an 8-deep ring (probe only so far). H200 probe, one wave of tiles:
    # 512x1536x4096 0.96 vs 0.84 (6 stages), 512x1792x12288 1.07 vs 0.95; many tiles worse.
    "pp64x128st8": WsConfig(64, 128, 64, 4, True, stages=8),
    # BLOCK_K 32 (64-byte box rows, 64-byte swizzle), 8 stages: probe only (rows off lines).
    "coop128x256k32": WsConfig(128, 256, 32, 8, False, stages=8),
    # 192 columns as 128 + 64 (two accumulators, two B boxes; wgmma n128 + n64 per K16):
    # 3/4 of the 128x256 tile where 256-wide tiles leave a wave part-empty.
    "coop128x192": WsConfig(128, 128, 64, 8, False, block_n2=64),
}
"""The tile configs; ``plan`` picks among ``RULE_CONFIGS``."""
DETERMINISTIC_CONFIG = "coop128x256"
"""The deterministic mode's one fixed tile config (batch invariance: never a function of M)."""
RULE_CONFIGS = ("coop128x256", "pp128x128", "pp64x128", "coop128x192")
"""Configs the rule chooses between. ``coop128x192`` (two accumulators) costs its area
(``STEP_COST`` 0.75): it runs about the 128x256 tile's speed per FLOP and wins where 192-wide
tiles fill the waves better (benchmarks/NOTES.md, two-accumulator tiles)."""

# Cost model constants, in units of one K step (block_m x block_n x block_k) of the 128x256
# tile (about 0.78 us on an H200), fitted on H200 probes (tools/ws_probe.py, model shards +
# seeded random shapes).
FIXUP_STEPS = 12.0
"""Cost of one fp32 partial tile through the workspace (write, arrive, ordered read by the
reducer); measured high (the reducer's loads are serialized), so stream-K only wins on long
K with a partial last wave."""
EPILOGUE_STEPS = {"coop128x256": 0.8, "pp128x128": 0.15, "pp64x256": 0.15, "pp64x128": 0.1,
                  "coop128x128": 0.4, "pp64x128st8": 0.1, "coop128x256k32": 0.8,
                  "coop128x192": 0.6}
"""Epilogue per tile not hidden under a mainloop (the cooperative schedule stores in line)."""
STEP_COST = {"coop128x256": 1.0, "pp128x128": 0.5, "pp64x256": 0.55, "pp64x128": 0.33,
             "coop128x128": 0.55, "pp64x128st8": 0.30, "coop128x256k32": 0.5,
             "coop128x192": 0.75}
"""Relative time of one K step of each config (128x256x64 = 1)."""
UNALIGNED_PENALTY = {"pp128x128": 1.25, "pp64x256": 1.25, "pp64x128": 2.0,
                     "coop128x128": 1.25, "pp64x128st8": 2.0}
"""Factor on a config's K step when A and B rows both start off 32-byte sectors (bf16 K 8 past
a multiple of 16: every 128-byte box row straddles two lines and five sectors); the 128x256
tile's is ``WIDE_OFF_SECTORS``. Rows on sectors but off lines: ``OFF_LINES_SHARE`` of it."""
WIDE_OFF_SECTORS = 1.05
"""The 128x256 tile with both operands off sectors (H200 probe: 16 seeded off-sector shapes,
the ``tl`` core's 1.234 did not hold for the TMA ring)."""
OFF_ONE_SHARE = (0.11, 0.24)
"""Share of a config's both-off excess left with only A / only B off sectors (``tl`` core:
wide 1.026 / 1.056 of 1.234)."""
OFF_LINES_SHARE = {"coop128x256": 0.04}
"""Share of the excess with both operands on sectors but off lines (default 0.6: the 64-row
tiles measured about 1.3x slower at 32-byte rows, the 128x256 tile about 1%)."""
COPY_BYTES_PER_S = 3.4e12
"""A row copy onto 128-byte lines (``_pad.padded_copy``): bytes read plus written per second."""
COPY_LAUNCH_STEPS = 4.0
"""A copy's launch and tail, in K steps."""
STEP_US = 0.78
"""One 128x256x64 K step in microseconds (H200, bf16)."""
AUTO_PAD = False
"""Whether the rule itself plans row copies. Off: on the 16 off-sector shapes of seeds 39, 7,
2024 (H200) the 128x256 tile read 0.838 of cuBLAS plain, 0.766 copying A, 0.753 copying B, 0.655
both (only 6256x392x2024 gained, copying its 392 B rows: 0.614 -> 0.689); ``pad=`` forces one.
BLOCK_K 32 (``coop128x256k32``) read 0.607 there: not a fix either."""
PAD_MARGIN = 0.95
"""A row copy is planned only under this fraction of the cost without it."""
DEEP_STAGES = 8
"""Ring depth of the 64x128 tiles with both operands on lines (the 6-stage ring measured 5-12%
slower on K >= 1024; with rows off lines the deeper ring lost 5%)."""
PREFER_MARGIN = 0.97
"""Another config replaces the first of ``RULE_CONFIGS`` only below this fraction of its cost."""
SK_CONFIGS = ("coop128x256", )
"""Configs the rule may give a stream-K schedule (forcing ``mode`` reaches any)."""
SK_TAIL = 0.25
"""Stream-K after full waves only when the last wave is at most this full."""
SPLITR_CONFIGS = ("pp128x128", "pp64x128")
"""Configs the rule may give a ``MODE_SPLITR`` schedule."""
SPLITR_MAX = 8
"""Most K slices of ``MODE_SPLITR``."""
SPLITR_MIN_STEPS = 6
"""Fewest K steps per slice."""
SPLITR_MAX_FLOATS = 16 << 20
"""Largest ``[split, M, N]`` fp32 workspace the rule plans (64 MiB)."""
SPLITR_UNIT_STEPS = 1.0
"""Per-wave cost of a split unit beyond its K steps (pipeline fill, fp32 partial store)."""
REDUCE_FIXED_STEPS = 6.0
"""The reduce kernel's launch and drain (a second kernel in the stream)."""
REDUCE_STEPS_PER_MB = 1.8
"""Per MiB of fp32 partials (stored by the GEMM, read by the reduce kernel) and of C: measured
about 1.1-1.5 us/MiB on an H200 (512x4096x1024: +9 us per extra plane), far from L2 speed,
so ``MODE_SPLITR`` only ties data parallel on small ``M * N`` with long K (512x576x4608)."""
MIN_SK_STEPS = 4
"""Fewest K steps a stream-K range is given (below, the fix-up dominates)."""
PARTIALS = ("reg", "tma")
"""How fp32 partials move (``WsPlan.partials``). ``reg``: the consumer stores its accumulator
straight from the wgmma register layout (8-byte ``st.global.v2`` for the in-kernel fix-up;
scalar, masked ``st.global.b32`` into the split planes) and the reducers load them back the same
way (the fix-up one ``[BLOCK_M, EPI_N]`` block per round trip; the reduce kernel scalar 4-byte
loads). ``tma``: the accumulator is staged column block by column block through the epilogue's
staging tile (reinterpreted as fp32) and written by TMA stores; the fix-up reads the partials
with 16-byte coalesced loads in a blocked layout, two blocks ahead; the split planes get
line-padded rows (``splitr_pitch``) so ``ws_reduce_tma_kernel`` loads them 16 bytes at a time
without masks and stores C by TMA. Same slice order, so both are bitwise equal. The rule always
plans ``reg`` (``tma`` is forced, ``plan(partials="tma")``, until measured)."""
SPLITR_LD_ALIGN = 128
"""Row pitch (floats) of a ``partials="tma"`` split plane: N rounded up to this (whole lines
and the reduce kernel's column block)."""


@dataclasses.dataclass(frozen=True)
class WsPlan:
    """One launch of ``ws_gemm_kernel``: config, schedule, grid and scratch sizes."""
    variant: str
    mode: int
    grid: int
    dp_tiles: int = 0
    split: int = 1
    stages: int = 0
    ws_tiles: int = 0
    """fp32 partial tiles of workspace the launch needs (``block_m * block_n`` floats each)."""
    counters: int = 0
    """int32 arrival counters (zero between launches; the reducer resets its own)."""
    est: float = 0.0
    """The rule's cost estimate (K steps of ``variant``), for reports."""
    pad_a: bool = False
    """Copy A's rows onto 128-byte lines before the launch (``_pad.padded_copy``)."""
    pad_b: bool = False
    """Copy B's rows (a weight's ``w.t()``: the ``[N, K]`` rows) onto 128-byte lines."""
    partials: str = "reg"
    """How fp32 partials move (``PARTIALS``); only read by modes with partials."""

    @property
    def cfg(self) -> WsConfig:
        return WS_CONFIGS[self.variant]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def splitr_pitch(M: int, N: int, cfg: WsConfig):
    """``(rows, ld)`` of one ``partials="tma"`` split plane: M rounded up to whole tiles (a TMA
    box never crosses into the next plane) and the row pitch ``ld`` (N rounded up to
    ``SPLITR_LD_ALIGN``)."""
    return cdiv(M, cfg.block_m) * cfg.block_m, cdiv(N, SPLITR_LD_ALIGN) * SPLITR_LD_ALIGN


def splitr_floats(M: int, N: int, split: int, cfg: WsConfig, partials: str = "reg") -> int:
    """fp32 workspace of ``MODE_SPLITR``'s ``split`` planes."""
    if partials == "tma":
        rows, ld = splitr_pitch(M, N, cfg)
        return split * rows * ld
    return split * M * N


def fit_stages(cfg: WsConfig, in_bytes: int, out_bytes: int, max_stages: int = 6) -> int:
    """Ring depth: ``cfg.stages`` if set, else the most stages (<= ``max_stages``) whose A and B
    tiles fit in shared memory beside one ``[block_m, epi_n]`` staging tile per consumer."""
    if cfg.stages:
        return cfg.stages
    stage = (cfg.block_m + cfg.tile_n) * cfg.block_k * in_bytes
    staging = cfg.consumers * cfg.block_m * cfg.epi_n * out_bytes
    return max(2, min(max_stages, (SMEM_BYTES - SMEM_RESERVE - 64 - staging) // stage))


def smem_bytes(cfg: WsConfig, stages: int, in_bytes: int, out_bytes: int) -> int:
    """Shared memory of one program of ``cfg`` with ``stages`` (ring, staging, barriers)."""
    return (stages * (cfg.block_m + cfg.tile_n) * cfg.block_k * in_bytes
            + cfg.consumers * cfg.block_m * cfg.epi_n * out_bytes + 16 * stages + 32)


def _sk_segments(sk_tiles: int, k_steps: int, grid: int) -> float:
    """Mean number of ranges per stream-K tile (partials the reducer sums)."""
    total = sk_tiles * k_steps
    q, r = divmod(total, grid)

    def owner(g):
        big = r * (q + 1)
        return g // (q + 1) if g < big else r + (g - big) // max(q, 1)
    n = sum(owner(t * k_steps + k_steps - 1) - owner(t * k_steps) + 1 for t in range(sk_tiles))
    return n / sk_tiles


def row_class(K: int, in_bytes: int) -> int:
    """Alignment class of K-long rows of ``K * in_bytes`` bytes: 0 on 128-byte lines, 1 on
    32-byte sectors but off lines, 2 off sectors (a pure function of ``(K * in_bytes) % 128``)."""
    r = (K * in_bytes) % 128
    return 0 if r == 0 else 1 if r % 32 == 0 else 2


def penalty(variant: str, a_cls: int, b_cls: int) -> float:
    """Factor on ``variant``'s K step with A's / B's rows of classes ``a_cls`` / ``b_cls``."""
    if a_cls == 0 and b_cls == 0:
        return 1.0
    both = WIDE_OFF_SECTORS if variant.startswith("coop128x256") else UNALIGNED_PENALTY.get(
        variant, 1.25)
    ex = both - 1.0
    if a_cls == 2 and b_cls == 2:
        return both
    if a_cls == 2 or b_cls == 2:  # one off sectors
        share = OFF_ONE_SHARE[0] if a_cls == 2 else OFF_ONE_SHARE[1]
        lines = OFF_LINES_SHARE.get(variant, 0.6) if (a_cls or b_cls) == 1 else 0.0
        return 1.0 + ex * max(share, lines)
    return 1.0 + ex * OFF_LINES_SHARE.get(variant, 0.6)


def copy_steps(rows: int, K: int, in_bytes: int) -> float:
    """Cost (128x256 K steps) of copying ``rows`` K-long rows onto lines."""
    return COPY_LAUNCH_STEPS + rows * K * in_bytes * 2 / COPY_BYTES_PER_S / (STEP_US * 1e-6)


def plan_stages(cfg: WsConfig, in_bytes: int, out_bytes: int, lined: bool, tiles: int,
                sms: int) -> int:
    """Ring depth the rule gives ``cfg``: ``DEEP_STAGES`` for the 64-row tiles with both
    operands on lines and at most two waves of tiles (their boxes are small: more K steps in
    flight; measured 3-14% faster there, 9% slower on 2.4 waves of 512x576 tiles), else
    ``fit_stages``."""
    if (not cfg.stages and lined and cfg.block_m * cfg.block_n <= 64 * 128
            and tiles <= 2 * sms):
        return fit_stages(cfg, in_bytes, out_bytes, DEEP_STAGES)
    return fit_stages(cfg, in_bytes, out_bytes)


def _step(variant: str, pen: float) -> float:
    return STEP_COST[variant] * pen


def _cost_dp(tiles: int, k_steps: int, sms: int, variant: str, pen: float = 1.0) -> float:
    waves = cdiv(tiles, sms)
    return _step(variant, pen) * waves * (k_steps + EPILOGUE_STEPS[variant])


def _plan_sk(tiles: int, k_steps: int, sms: int, variant: str, pen: float = 1.0,
             forced: bool = False):
    """Best stream-K ``(cost, grid, dp_tiles)`` of ``variant`` (None when none applies)."""
    step = _step(variant, pen)
    if tiles >= 2 * sms:
        if tiles % sms > SK_TAIL * sms and not forced:
            return None  # measured: stream-K over 1.25+ waves of tiles lost to the fix-up
        dp_tiles = (tiles // sms - 1) * sms
        grids = [sms]
    else:
        dp_tiles = 0
        hi = max(1, min(sms, (tiles * k_steps) // MIN_SK_STEPS))
        grids = sorted({g for g in range(max(1, hi // 4), hi + 1)})
    best = None
    for g in grids:
        if g <= 0:
            continue
        sk = tiles - dp_tiles
        total = sk * k_steps
        per = cdiv(total, g)
        if per < 1:
            continue
        segs = _sk_segments(sk, k_steps, g) if sk <= 4 * g else 1.0 + k_steps / per
        split_tiles = segs > 1.0
        # the longest range, plus (for the reducer) the partials it sums, plus one epilogue
        cost = step * ((dp_tiles // g) * (k_steps + EPILOGUE_STEPS[variant]) + per
                       + (FIXUP_STEPS * (segs + 1) if split_tiles else 0.0)
                       + EPILOGUE_STEPS[variant] * cdiv(sk, g))
        if best is None or cost < best[0] - 1e-9:
            best = (cost, g, dp_tiles)
    return best


def reduce_cost(M: int, N: int, split: int, out_bytes: int = 2) -> float:
    """Cost (128x256 K steps) of the ``MODE_SPLITR`` reduce kernel."""
    mb = (split * M * N * 4 + M * N * out_bytes) / float(1 << 20)
    return REDUCE_FIXED_STEPS + REDUCE_STEPS_PER_MB * mb


def _plan_splitr(M, N, tiles, k_steps, sms, variant, pen, split, out_bytes, forced=False):
    """``(cost, split)`` of ``MODE_SPLITR`` with ``split`` K slices (None when none applies)."""
    kps = cdiv(k_steps, max(1, split))
    s = cdiv(k_steps, kps)  # every slice non-empty
    if s < 2 or (not forced and (kps < SPLITR_MIN_STEPS or s * M * N > SPLITR_MAX_FLOATS)):
        return None
    units = tiles * s
    cost = (cdiv(units, sms) * (_step(variant, pen) * (kps + EPILOGUE_STEPS[variant])
                                + SPLITR_UNIT_STEPS) + reduce_cost(M, N, s, out_bytes))
    return cost, s


@functools.lru_cache(maxsize=4096)
def plan(M: int, N: int, K: int, in_bytes: int = 2, out_bytes: int = 2, sms: int = 132, *,
         deterministic: bool = False, variant: Optional[str] = None,
         mode: Optional[int] = None, split: Optional[int] = None,
         pad: Optional[str] = None, stages: Optional[int] = None,
         partials: Optional[str] = None) -> WsPlan:
    """The launch plan of ``C[M, N] = A[M, K] @ B[K, N]`` on ``sms`` SMs (a pure function).

    A's rows and B's (a weight's ``w.t()``: ``[N, K]`` rows) are ``K * in_bytes`` long; where
    they start off 32-byte sectors the rule may copy either onto 128-byte lines first
    (``pad_a`` / ``pad_b``, the copy's cost against the misalignment's, ``penalty``).
    ``deterministic``: one fixed config, data parallel (or ``split`` K slices, which must then
    be a function of K only): every output element's K order is independent of M.
    ``variant`` / ``mode`` / ``split`` / ``pad`` ("", "a", "b", "ab") / ``stages`` force a
    choice (the probe compares them); ``partials`` ("reg", "tma": ``PARTIALS``) how the chosen
    plan moves its fp32 partials (never a factor of the choice: forced only)."""
    if partials is not None and partials not in PARTIALS:
        raise ValueError(f"partials {partials!r} not in {PARTIALS}")
    if deterministic:
        variant = variant or DETERMINISTIC_CONFIG
        mode = MODE_SPLIT if (split or 1) > 1 else MODE_DP
    candidates = [variant] if variant else list(RULE_CONFIGS)
    cls = row_class(K, in_bytes)
    if pad is not None:
        pads = [("a" in pad, "b" in pad)]
    elif AUTO_PAD and cls == 2 and not deterministic:
        pads = [(False, False), (True, False), (False, True), (True, True)]
    else:
        pads = [(False, False)]
    best = None
    for pad_a, pad_b in pads:
        a_cls = 0 if pad_a else cls
        b_cls = 0 if pad_b else cls
        copy = ((copy_steps(M, K, in_bytes) if pad_a else 0.0)
                + (copy_steps(N, K, in_bytes) if pad_b else 0.0))
        pad_rank = 1.0 if not (pad_a or pad_b) else PAD_MARGIN
        for rank, name in enumerate(candidates):
            cfg = WS_CONFIGS[name]
            if cfg.block_n2 and mode not in (None, MODE_DP):
                if variant:
                    raise ValueError(f"{name}: a second accumulator runs data parallel only")
                continue  # a forced partial schedule: the one-accumulator configs
            pen = penalty(name, a_cls, b_cls)
            tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.tile_n)
            k_steps = cdiv(K, cfg.block_k)
            st = stages or plan_stages(cfg, in_bytes, out_bytes, a_cls == 0 and b_cls == 0, tiles,
                                       sms)
            step_scale = 1.0
            if st > fit_stages(cfg, in_bytes, out_bytes) and name == "pp64x128":
                step_scale = STEP_COST["pp64x128st8"] / STEP_COST["pp64x128"]
            pen *= step_scale
            opts = []
            if mode in (None, MODE_DP):
                opts.append((_cost_dp(tiles, k_steps, sms, name, pen),
                             WsPlan(name, MODE_DP, min(tiles, sms), stages=st)))
            # Auto: stream-K only after full data-parallel waves, on the config whose fix-up
            # was measured worth it (few-tile shapes go to smaller tiles instead).
            if mode == MODE_SK or (mode is None and name in SK_CONFIGS and tiles >= 2 * sms):
                sk = _plan_sk(tiles, k_steps, sms, name, pen, forced=mode == MODE_SK)
                if sk is not None:
                    cost, g, dp_tiles = sk
                    opts.append((cost, WsPlan(name, MODE_SK, g, dp_tiles=dp_tiles, stages=st,
                                              ws_tiles=2 * g, counters=tiles - dp_tiles)))
            if mode == MODE_SPLITR or (mode is None and name in SPLITR_CONFIGS
                                       and tiles < 2 * sms):
                for s_req in ([split or 2] if mode == MODE_SPLITR else range(2, SPLITR_MAX + 1)):
                    sp = _plan_splitr(M, N, tiles, k_steps, sms, name, pen, s_req, out_bytes,
                                      forced=mode == MODE_SPLITR)
                    if sp is None and mode == MODE_SPLITR:  # one K step: nothing to split
                        opts.append((_cost_dp(tiles, k_steps, sms, name, pen),
                                     WsPlan(name, MODE_DP, min(tiles, sms), stages=st)))
                    elif sp is not None:
                        opts.append((sp[0], WsPlan(name, MODE_SPLITR, min(tiles * sp[1], sms),
                                                   split=sp[1], stages=st,
                                                   ws_tiles=cdiv(splitr_floats(
                                                       M, N, sp[1], cfg, partials or "reg"),
                                                       cfg.block_m * cfg.block_n))))
            if mode == MODE_SPLIT:
                s_req = max(1, split or 1)
                kps = cdiv(k_steps, s_req)
                s = cdiv(k_steps, kps)  # every slice non-empty
                units = tiles * s
                cost = STEP_COST[name] * cdiv(units, sms) * kps
                opts.append((cost, WsPlan(name, MODE_SPLIT if s > 1 else MODE_DP,
                                          min(units, sms), split=s, stages=st,
                                          ws_tiles=units if s > 1 else 0,
                                          counters=tiles if s > 1 else 0)))
            for cost, p in opts:
                # ties go to the first config, and to no copy
                cost = (cost + copy) / (PREFER_MARGIN if rank else 1.0) / pad_rank
                if best is None or cost < best[0] - 1e-9:
                    best = (cost, dataclasses.replace(p, pad_a=pad_a, pad_b=pad_b))
    cost, p = best
    if partials is not None and p.mode != MODE_DP:
        p = dataclasses.replace(p, partials=partials)
    return dataclasses.replace(p, est=round(cost, 3))


def rule_plans(in_bytes: int = 2, out_bytes: int = 2) -> tuple:
    """Every kernel form ``plan``'s rule can choose (default mode, no forced option): per
    ``RULE_CONFIGS`` entry its ring depths (``plan_stages``) and schedules (data parallel;
    stream-K on ``SK_CONFIGS``; ``MODE_SPLITR`` on ``SPLITR_CONFIGS`` at each split 2 ..
    ``SPLITR_MAX``, the reduce kernel's constant). Grids and scratch sizes are placeholders:
    ``precompile`` binds what these compile to, not a launch. A pure function."""
    out = []
    for name in RULE_CONFIGS:
        cfg = WS_CONFIGS[name]
        depths = {fit_stages(cfg, in_bytes, out_bytes)}
        if not cfg.stages and cfg.block_m * cfg.block_n <= 64 * 128:
            depths.add(fit_stages(cfg, in_bytes, out_bytes, DEEP_STAGES))
        for st in sorted(depths):
            out.append(WsPlan(name, MODE_DP, 1, stages=st))
            if name in SK_CONFIGS:
                out.append(WsPlan(name, MODE_SK, 2, stages=st, ws_tiles=4, counters=1))
            if name in SPLITR_CONFIGS:
                out += [WsPlan(name, MODE_SPLITR, split, split=split, stages=st, ws_tiles=split)
                        for split in range(2, SPLITR_MAX + 1)]
    return tuple(out)


def describe(p: WsPlan) -> str:
    """Short text of a plan (probe tables)."""
    m = {MODE_DP: "dp", MODE_SK: "sk", MODE_SPLIT: "split", MODE_SPLITR: "splitr"}[p.mode]
    extra = f"/{p.dp_tiles}" if p.mode == MODE_SK and p.dp_tiles else ""
    extra += f"x{p.split}" if p.mode in (MODE_SPLIT, MODE_SPLITR) else ""
    extra += ("+pad" + "a" * p.pad_a + "b" * p.pad_b) if p.pad_a or p.pad_b else ""
    extra += "+tma" if p.partials == "tma" and p.mode != MODE_DP else ""
    extra += f"/st{p.stages}" if p.stages and p.stages != fit_stages(p.cfg, 2, 2) else ""
    return f"{p.variant}:{m}{extra}@{p.grid}"
