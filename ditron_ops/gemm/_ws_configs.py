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
    """
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    pingpong: bool
    stages: int = 0
    group_m: int = 8
    epi_n: int = 64

    @property
    def consumers(self) -> int:
        return 2 if self.pingpong else 1


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
}
"""The tile configs; ``plan`` picks among ``RULE_CONFIGS``."""
WS_DEFAULT = "coop128x256"
DETERMINISTIC_CONFIG = "coop128x256"
"""The deterministic mode's one fixed tile config (batch invariance: never a function of M)."""
RULE_CONFIGS = ("coop128x256", "pp128x128", "pp64x128")
"""Configs the rule chooses between."""

# Cost model constants, in units of one K step (block_m x block_n x block_k) of the 128x256
# tile (about 0.78 us on an H200), fitted on H200 probes (tools/ws_probe.py, model shards +
# seeded random shapes).
FIXUP_STEPS = 12.0
"""Cost of one fp32 partial tile through the workspace (write, arrive, ordered read by the
reducer); measured high (the reducer's loads are serialized), so stream-K only wins on long
K with a partial last wave."""
EPILOGUE_STEPS = {"coop128x256": 0.8, "pp128x128": 0.15, "pp64x256": 0.15, "pp64x128": 0.1,
                  "coop128x128": 0.4, "pp64x128st8": 0.1}
"""Epilogue per tile not hidden under a mainloop (the cooperative schedule stores in line)."""
STEP_COST = {"coop128x256": 1.0, "pp128x128": 0.5, "pp64x256": 0.55, "pp64x128": 0.33,
             "coop128x128": 0.55, "pp64x128st8": 0.33}
"""Relative time of one K step of each config (128x256x64 = 1)."""
UNALIGNED_PENALTY = {"pp128x128": 1.25, "pp64x256": 1.25, "pp64x128": 2.0,
                     "coop128x128": 1.25, "pp64x128st8": 2.0}
"""Factor on a config's K step when A/B rows are not 128-byte multiples (the smaller tiles
move twice the operand bytes per FLOP and suffer more from split sectors)."""
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

    @property
    def cfg(self) -> WsConfig:
        return WS_CONFIGS[self.variant]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fit_stages(cfg: WsConfig, in_bytes: int, out_bytes: int, max_stages: int = 6) -> int:
    """Ring depth: ``cfg.stages`` if set, else the most stages (<= ``max_stages``) whose A and B
    tiles fit in shared memory beside one ``[block_m, epi_n]`` staging tile per consumer."""
    if cfg.stages:
        return cfg.stages
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * in_bytes
    staging = cfg.consumers * cfg.block_m * cfg.epi_n * out_bytes
    return max(2, min(max_stages, (SMEM_BYTES - SMEM_RESERVE - 64 - staging) // stage))


def smem_bytes(cfg: WsConfig, stages: int, in_bytes: int, out_bytes: int) -> int:
    """Shared memory of one program of ``cfg`` with ``stages`` (ring, staging, barriers)."""
    return (stages * (cfg.block_m + cfg.block_n) * cfg.block_k * in_bytes
            + cfg.consumers * cfg.block_m * cfg.epi_n * out_bytes + 16 * stages + 32)


def sk_ranges(sk_tiles: int, k_steps: int, grid: int):
    """Stream-K ranges ``[(start, end)]`` of the ``sk_tiles * k_steps`` iterations (the kernel's
    arithmetic: ``q = T // grid``, the first ``T % grid`` ranges one longer)."""
    total = sk_tiles * k_steps
    q, r = divmod(total, grid)
    out = []
    for p in range(grid):
        s = p * q + min(p, r)
        out.append((s, s + q + (p < r)))
    return out


def _sk_segments(sk_tiles: int, k_steps: int, grid: int) -> float:
    """Mean number of ranges per stream-K tile (partials the reducer sums)."""
    total = sk_tiles * k_steps
    q, r = divmod(total, grid)

    def owner(g):
        big = r * (q + 1)
        return g // (q + 1) if g < big else r + (g - big) // max(q, 1)
    n = sum(owner(t * k_steps + k_steps - 1) - owner(t * k_steps) + 1 for t in range(sk_tiles))
    return n / sk_tiles


def _step(variant: str, aligned: bool) -> float:
    return STEP_COST[variant] * (1.0 if aligned else UNALIGNED_PENALTY.get(variant, 1.0))


def _cost_dp(tiles: int, k_steps: int, sms: int, variant: str, aligned: bool = True) -> float:
    waves = cdiv(tiles, sms)
    return _step(variant, aligned) * waves * (k_steps + EPILOGUE_STEPS[variant])


def _plan_sk(tiles: int, k_steps: int, sms: int, variant: str, aligned: bool = True,
             forced: bool = False):
    """Best stream-K ``(cost, grid, dp_tiles)`` of ``variant`` (None when none applies)."""
    step = _step(variant, aligned)
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


def _plan_splitr(M, N, tiles, k_steps, sms, variant, aligned, split, out_bytes, forced=False):
    """``(cost, split)`` of ``MODE_SPLITR`` with ``split`` K slices (None when none applies)."""
    kps = cdiv(k_steps, max(1, split))
    s = cdiv(k_steps, kps)  # every slice non-empty
    if s < 2 or (not forced and (kps < SPLITR_MIN_STEPS or s * M * N > SPLITR_MAX_FLOATS)):
        return None
    units = tiles * s
    cost = (cdiv(units, sms) * (_step(variant, aligned) * (kps + EPILOGUE_STEPS[variant])
                                + SPLITR_UNIT_STEPS) + reduce_cost(M, N, s, out_bytes))
    return cost, s


@functools.lru_cache(maxsize=4096)
def plan(M: int, N: int, K: int, in_bytes: int = 2, out_bytes: int = 2, sms: int = 132, *,
         deterministic: bool = False, variant: Optional[str] = None,
         mode: Optional[int] = None, split: Optional[int] = None) -> WsPlan:
    """The launch plan of ``C[M, N] = A[M, K] @ B[K, N]`` on ``sms`` SMs (a pure function).

    ``deterministic``: one fixed config, data parallel (or ``split`` K slices, which must then
    be a function of K only): every output element's K order is independent of M.
    ``variant`` / ``mode`` / ``split`` force a choice (the probe compares them)."""
    if deterministic:
        variant = variant or DETERMINISTIC_CONFIG
        mode = MODE_SPLIT if (split or 1) > 1 else MODE_DP
    candidates = [variant] if variant else list(RULE_CONFIGS)
    aligned = (K * in_bytes) % 128 == 0
    best = None
    for rank, name in enumerate(candidates):
        cfg = WS_CONFIGS[name]
        tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        k_steps = cdiv(K, cfg.block_k)
        stages = fit_stages(cfg, in_bytes, out_bytes)
        opts = []
        if mode in (None, MODE_DP):
            opts.append((_cost_dp(tiles, k_steps, sms, name, aligned),
                         WsPlan(name, MODE_DP, min(tiles, sms), stages=stages)))
        # Auto: stream-K only after full data-parallel waves, on the config whose fix-up was
        # measured worth it (few-tile shapes go to smaller tiles instead).
        if mode == MODE_SK or (mode is None and name in SK_CONFIGS and tiles >= 2 * sms):
            sk = _plan_sk(tiles, k_steps, sms, name, aligned, forced=mode == MODE_SK)
            if sk is not None:
                cost, g, dp_tiles = sk
                opts.append((cost, WsPlan(name, MODE_SK, g, dp_tiles=dp_tiles, stages=stages,
                                          ws_tiles=2 * g, counters=tiles - dp_tiles)))
        if mode == MODE_SPLITR or (mode is None and name in SPLITR_CONFIGS
                                   and tiles < 2 * sms):
            for s_req in ([split or 2] if mode == MODE_SPLITR else range(2, SPLITR_MAX + 1)):
                sp = _plan_splitr(M, N, tiles, k_steps, sms, name, aligned, s_req, out_bytes,
                                  forced=mode == MODE_SPLITR)
                if sp is None and mode == MODE_SPLITR:  # one K step: nothing to split
                    opts.append((_cost_dp(tiles, k_steps, sms, name, aligned),
                                 WsPlan(name, MODE_DP, min(tiles, sms), stages=stages)))
                elif sp is not None:
                    opts.append((sp[0], WsPlan(name, MODE_SPLITR, min(tiles * sp[1], sms),
                                               split=sp[1], stages=stages,
                                               ws_tiles=cdiv(sp[1] * M * N,
                                                             cfg.block_m * cfg.block_n))))
        if mode == MODE_SPLIT:
            s_req = max(1, split or 1)
            kps = cdiv(k_steps, s_req)
            s = cdiv(k_steps, kps)  # every slice non-empty
            units = tiles * s
            cost = STEP_COST[name] * cdiv(units, sms) * kps
            opts.append((cost, WsPlan(name, MODE_SPLIT if s > 1 else MODE_DP,
                                      min(units, sms), split=s, stages=stages,
                                      ws_tiles=units if s > 1 else 0,
                                      counters=tiles if s > 1 else 0)))
        for cost, p in opts:
            cost = cost / (PREFER_MARGIN if rank else 1.0)  # ties go to the first config
            if best is None or cost < best[0] - 1e-9:
                best = (cost, p)
    cost, p = best
    return dataclasses.replace(p, est=round(cost, 3))


def describe(p: WsPlan) -> str:
    """Short text of a plan (probe tables)."""
    m = {MODE_DP: "dp", MODE_SK: "sk", MODE_SPLIT: "split", MODE_SPLITR: "splitr"}[p.mode]
    extra = f"/{p.dp_tiles}" if p.mode == MODE_SK and p.dp_tiles else ""
    extra += f"x{p.split}" if p.mode in (MODE_SPLIT, MODE_SPLITR) else ""
    return f"{p.variant}:{m}{extra}@{p.grid}"
