"""CPU tests of the warp-specialized GEMM's planning rule and work decomposition
(``ditron_ops/gemm/_ws_configs.py``; the kernel's scheduling arithmetic mirrored in Python)."""
import importlib.util
import os
import random
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ditron_ops",
                     "gemm", "_ws_configs.py")
_spec = importlib.util.spec_from_file_location("ws_configs_under_test", _PATH)
C = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = C  # pure Python: no ditron_ops import (its import picks CPU/GPU modes)
_spec.loader.exec_module(C)


def _units(p, G, tiles, ks, mode, dp_tiles, split):
    """``_sched`` + ``_unit`` + the consumer's partial bookkeeping of ``_ws_kernels`` for
    program ``p``: [(tile, kb, ke, partial, counter, nseg, my_slot, reader_slots)]."""
    out = []
    if mode == C.MODE_SK:
        n_dp = dp_tiles // G
        total = (tiles - dp_tiles) * ks
        q, r = divmod(total, G)
        s = p * q + min(p, r)
        e = s + q + (p < r)
        t0 = s // ks
        n = n_dp + ((e - 1) // ks - t0 + 1 if e > s else 0)

        def owner(g):
            big = r * (q + 1)
            return g // (q + 1) if g < big else r + (g - big) // max(q, 1)
        for i in range(n):
            tt = t0 + (i - n_dp)
            base = tt * ks
            if i < n_dp:
                tile, kb, ke = p + i * G, 0, ks
            else:
                tile, kb, ke = dp_tiles + tt, max(s, base) - base, min(e, base + ks) - base
            partial = i >= n_dp and (kb > 0 or ke < ks)
            first = owner(base)
            nseg = owner(base + ks - 1) - first + 1
            slot = 2 * p + (i > n_dp)
            readers = [2 * (first + j) + (((first + j) * q + min(first + j, r)) < base)
                       for j in range(nseg)]
            out.append((tile, kb, ke, partial, tt, nseg, slot, readers))
    elif mode in (C.MODE_SPLIT, C.MODE_SPLITR):
        kps = -(-ks // split)
        n = -(-(tiles * split - p) // G)
        for i in range(n):
            u = p + i * G
            tile = u // split
            kb = (u % split) * kps
            ke = min(ks, kb + kps)
            if mode == C.MODE_SPLITR:  # plane kb // kps, read by the reduce kernel in order
                out.append((tile, kb, ke, True, None, split, kb // kps, list(range(split))))
            else:
                out.append((tile, kb, ke, split > 1, tile, split, u,
                            [tile * split + j for j in range(split)]))
    else:
        n = -(-(tiles - p) // G)
        for i in range(n):
            out.append((p + i * G, 0, ks, False, None, 1, None, None))
    return out


def _check_plan(M, N, K, pl):
    cfg = pl.cfg
    tiles = C.cdiv(M, cfg.block_m) * C.cdiv(N, cfg.tile_n)
    ks = C.cdiv(K, cfg.block_k)
    cover = {}
    planes = set()
    writers = {}
    readers = {}
    for p in range(pl.grid):
        seen_slots = set()
        for tile, kb, ke, partial, cnt, nseg, slot, rd in _units(p, pl.grid, tiles, ks, pl.mode,
                                                                pl.dp_tiles, pl.split):
            assert 0 <= tile < tiles and 0 <= kb < ke <= ks, (tile, kb, ke)
            for k in range(kb, ke):
                assert (tile, k) not in cover, "a K step done twice"
                cover[(tile, k)] = p
            if partial and pl.mode == C.MODE_SPLITR:
                assert 0 <= slot < pl.split and (tile, slot) not in planes, "a plane twice"
                planes.add((tile, slot))
                writers.setdefault(tile, []).append((kb, slot))
                readers.setdefault(tile, set()).add((nseg, tuple(rd)))
            elif partial:
                assert slot not in seen_slots, "a program reuses a workspace slot"
                seen_slots.add(slot)
                assert 0 <= slot < pl.ws_tiles and 0 <= cnt < pl.counters
                writers.setdefault(tile, []).append((kb, slot))
                readers.setdefault(tile, set()).add((nseg, tuple(rd)))
            else:
                assert (kb, ke) == (0, ks), "a partial range takes the direct epilogue"
    assert len(cover) == tiles * ks, "K steps missed"
    if pl.mode == C.MODE_SPLITR:  # every tile has all planes; the workspace holds them
        assert len(planes) == tiles * pl.split
        assert pl.ws_tiles * cfg.block_m * cfg.block_n >= pl.split * M * N
    for tile, ws in writers.items():
        (nseg, rd), = readers[tile]  # every contributor agrees on the reduction
        assert len(ws) == nseg
        # the reducer reads the slots in K order: exactly the writers' slots sorted by k_begin
        assert list(rd) == [slot for _, slot in sorted(ws)]


SHAPES = [(512, 1536, 4096), (3000, 1536, 4096), (4096, 7392, 8192), (512, 576, 4608),
          (6256, 392, 2024), (64, 4096, 4096), (129, 136, 72), (2100, 7000, 648), (1, 8, 8),
          (16384, 16384, 128)]


PARTIAL_CONFIGS = [v for v in C.RULE_CONFIGS if not C.WS_CONFIGS[v].block_n2]
"""The rule's configs that may move partials (two-accumulator tiles run data parallel only)."""


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("variant,mode", [(v, m) for v in C.RULE_CONFIGS
                                          for m in (None, C.MODE_DP, C.MODE_SK)
                                          if v in PARTIAL_CONFIGS or m != C.MODE_SK])
def test_decomposition_covers_once(M, N, K, mode, variant):
    _check_plan(M, N, K, C.plan(M, N, K, variant=variant, mode=mode))


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("mode", [C.MODE_SPLIT, C.MODE_SPLITR])
def test_split_k_decomposition(split, mode):
    for M, N, K in SHAPES[:6] + [(129, 136, 72)]:
        for variant in PARTIAL_CONFIGS:
            pl = C.plan(M, N, K, variant=variant, mode=mode, split=split)
            _check_plan(M, N, K, pl)


def test_rule_is_pure_and_seeded_sweep():
    """A seeded sweep nobody tuned for: valid plans, the same plan twice, grid within SMs."""
    rng = random.Random(20240)
    for _ in range(60):
        M, N, K = (rng.randint(1, 2048) * 8 for _ in range(3))
        for sms in (132, 114, 78):
            pl = C.plan(M, N, K, sms=sms)
            assert pl == C.plan(M, N, K, sms=sms)
            assert 1 <= pl.grid <= sms
            assert pl.variant in C.RULE_CONFIGS
            assert pl.mode in (C.MODE_DP, C.MODE_SK, C.MODE_SPLITR)
            if pl.mode == C.MODE_SPLITR:
                assert 2 <= pl.split <= C.SPLITR_MAX
                assert pl.split * M * N <= C.SPLITR_MAX_FLOATS
        _check_plan(M, N, K, C.plan(M, N, K))


def test_rule_prefers_full_waves_and_small_tiles_when_few():
    # 4 x 6 tiles of 128x256 with 64 K steps: far fewer tiles than SMs -> smaller tiles or
    # K slices reduced by the second kernel
    pl = C.plan(512, 1536, 4096)
    assert pl.variant != "coop128x256" or pl.mode == C.MODE_SPLITR
    assert pl.grid > 64
    # 20 tiles of 128x128 and 72 K steps: 64x128 tiles or K slices, most SMs busy
    pl = C.plan(512, 576, 4608)
    assert pl.variant == "pp64x128" and pl.grid > 32
    # split K pays only on small M x N (the partial planes' traffic): never on wide shapes
    for M, N, K in ((512, 4096, 1024), (4096, 576, 4608), (512, 12288, 3584)):
        assert C.plan(M, N, K).mode != C.MODE_SPLITR
    # unaligned K rows (not 128-byte multiples) keep the big tile
    assert C.plan(6256, 392, 2024).variant == "coop128x256"
    # forced stream-K on few tiles: every SM gets a share of the K steps
    assert C.plan(512, 1536, 4096, variant="coop128x256", mode=C.MODE_SK).grid > 24
    # an exact number of waves of a long K: data parallel
    pl = C.plan(4096, 8448, 4096, variant="coop128x256")
    assert (pl.mode, pl.grid) == (C.MODE_DP, 132)
    # a partial last wave (928 tiles = 7.03 waves of 132): stream-K after full DP waves
    pl = C.plan(4096, 7392, 8192, variant="coop128x256")
    assert pl.mode == C.MODE_SK and pl.dp_tiles % pl.grid == 0 and pl.dp_tiles > 0


def test_deterministic_mode_is_batch_invariant():
    """The deterministic plan's config and K split never depend on M."""
    for N, K in ((1536, 4096), (576, 4608), (7392, 8192)):
        plans = {C.plan(M, N, K, deterministic=True) for M in (1, 7, 512, 1000, 4096, 12345)}
        assert {(p.variant, p.mode, p.split) for p in plans} == {
            (C.DETERMINISTIC_CONFIG, C.MODE_DP, 1)}
    p = C.plan(100, 1536, 8192, deterministic=True, split=4)
    q = C.plan(9000, 1536, 8192, deterministic=True, split=4)
    assert (p.variant, p.mode, p.split) == (q.variant, q.mode, q.split) == (
        C.DETERMINISTIC_CONFIG, C.MODE_SPLIT, 4)


def test_splitr_cost_grows_with_planes():
    """More K slices cost more reduction; the workspace cap bounds the planned split."""
    assert C.reduce_cost(512, 576, 4) > C.reduce_cost(512, 576, 2) > C.REDUCE_FIXED_STEPS
    pl = C.plan(512, 576, 4608, variant="pp64x128", mode=C.MODE_SPLITR, split=3)
    assert (pl.mode, pl.split, pl.grid) == (C.MODE_SPLITR, 3, 120)
    assert pl.ws_tiles * 64 * 128 >= 3 * 512 * 576
    # one K step: nothing to split, data parallel
    assert C.plan(100, 100, 64, variant="pp128x128", mode=C.MODE_SPLITR, split=4).mode == C.MODE_DP


def test_stages_fit_shared_memory():
    for cfg in C.WS_CONFIGS.values():
        for in_b, out_b in ((2, 2), (2, 4)):
            st = C.fit_stages(cfg, in_b, out_b)
            assert st >= 2 and C.smem_bytes(cfg, st, in_b, out_b) <= C.SMEM_BYTES - 256


def test_row_class_and_stage_rule():
    """Row alignment is a function of (K * elem_bytes) % 128; the deep ring only for lined
    64-row tiles of at most two waves; forced copies land in the plan."""
    assert [C.row_class(k, 2) for k in (4096, 4112, 4104, 2024)] == [0, 1, 2, 2]
    assert C.penalty("coop128x256", 0, 0) == 1.0 < C.penalty("coop128x256", 1, 1) \
        < C.penalty("coop128x256", 2, 2)
    pl = C.plan(512, 1536, 4096)
    assert pl.variant == "pp64x128" and pl.stages == C.DEEP_STAGES
    assert C.plan(512, 1536, 4104, variant="pp64x128").stages < C.DEEP_STAGES
    assert C.plan(16384, 1536, 4096, variant="pp64x128").stages < C.DEEP_STAGES
    p = C.plan(6256, 392, 2024, variant="coop128x256", pad="b")
    assert (p.pad_a, p.pad_b) == (False, True)
    for M, N, K in ((3000, 4000, 2024), (512, 576, 4608)):
        assert not (C.plan(M, N, K).pad_a or C.plan(M, N, K).pad_b) or C.AUTO_PAD
        for in_b, out_b in ((2, 2), (2, 4)):
            p = C.plan(M, N, K, in_b, out_b)
            assert C.smem_bytes(p.cfg, p.stages, in_b, out_b) <= C.SMEM_BYTES - 256


def test_partials_form_is_forced_only():
    """The rule never picks ``partials="tma"``; forcing it keeps the plan and pads the split
    planes (rows to whole tiles, pitch to lines)."""
    rng = random.Random(7)
    for _ in range(30):
        M, N, K = (rng.randint(1, 2048) * 8 for _ in range(3))
        assert C.plan(M, N, K).partials == "reg"
    for kw in (dict(variant="coop128x256", mode=C.MODE_SK),
               dict(variant="pp128x128", mode=C.MODE_SPLIT, split=3),
               dict(variant="pp64x128", mode=C.MODE_SPLITR, split=3)):
        reg = C.plan(512, 576, 4608, **kw)
        tma = C.plan(512, 576, 4608, partials="tma", **kw)
        assert tma.partials == "tma" and (tma.variant, tma.mode, tma.grid, tma.split) == (
            reg.variant, reg.mode, reg.grid, reg.split)
        if tma.mode == C.MODE_SPLITR:
            rows, ld = C.splitr_pitch(512, 576, tma.cfg)
            assert (rows, ld) == (512, 640)
            assert tma.ws_tiles * 64 * 128 >= 3 * rows * ld > reg.ws_tiles * 64 * 128 - 64 * 128
        else:
            assert tma.ws_tiles == reg.ws_tiles
    assert C.plan(512, 576, 4608, variant="pp64x128", mode=C.MODE_DP,
                  partials="tma").partials == "reg"  # nothing to move
    assert "+tma" in C.describe(C.plan(512, 576, 4608, variant="coop128x256", mode=C.MODE_SK,
                                       partials="tma"))
    with pytest.raises(ValueError):
        C.plan(512, 576, 4608, partials="smem")


def test_the_plain_matmul_refuses_rows_off_sectors_and_small_m():
    """``operand_refusal`` (the WS core's share of ``matmul``): rows on 32-byte sectors (A's,
    and B's given as ``w.t()``) with M above the skinny tiles' bound are taken; rows off
    sectors, M <= 32, a column-major A or an fp32 A are refused with the reason."""
    import torch

    from ditron_ops.gemm._ws_launch import operand_refusal

    def take(m, k, n, b_nk=True, dtype=torch.bfloat16):
        a = torch.zeros(m, k, dtype=dtype)
        b = torch.zeros(n, k, dtype=dtype).t() if b_nk else torch.zeros(k, n, dtype=dtype)
        return operand_refusal(a, b, torch.zeros(m, n, dtype=dtype), None)

    assert take(512, 4096, 1536) is None
    assert take(512, 3696, 1536) is None  # 7392-byte rows: on sectors, off lines
    assert take(33, 4096, 1536) is None
    assert "sectors" in take(512, 4424, 1536)  # 8848-byte rows: 16 past a sector
    assert "skinny" in take(32, 4096, 1536)
    assert take(512, 4104, 1536, b_nk=False) is not None  # A's rows off sectors
    assert take(512, 4096, 1544, b_nk=False) is None  # row-major B: N-long rows, 16-byte pitch
    a = torch.zeros(4096, 512, dtype=torch.bfloat16).t()
    b = torch.zeros(4096, 256, dtype=torch.bfloat16)
    assert operand_refusal(a, b, torch.zeros(512, 256, dtype=torch.bfloat16), None) is not None
    assert "dtypes" in take(512, 4096, 1536, dtype=torch.float32)


def test_two_accumulator_tiles_count_their_whole_width():
    """``block_n2`` configs (192 columns as 128 + 64): tiles are counted ``tile_n`` wide, both
    B boxes sit in every ring stage, and only data-parallel schedules are planned."""
    import pytest

    from ditron_ops.gemm import _ws_configs as w

    cfg = w.WS_CONFIGS["coop128x192"]
    assert cfg.tile_n == 192 and cfg.block_n + cfg.block_n2 == 192
    st = w.fit_stages(cfg, 2, 2)
    assert w.smem_bytes(cfg, st, 2, 2) <= w.SMEM_BYTES - w.SMEM_RESERVE
    assert st * (128 + 192) * 64 * 2 < w.smem_bytes(cfg, st, 2, 2)
    p = w.plan(312, 7168, 10240, variant="coop128x192")
    assert p.mode == w.MODE_DP and p.grid == 3 * 38  # 7168 / 192 -> 38 tile columns
    with pytest.raises(ValueError, match="data parallel"):
        w.plan(312, 7168, 10240, variant="coop128x192", mode=w.MODE_SK)
    for mode in (w.MODE_SK, w.MODE_SPLIT, w.MODE_SPLITR):  # forced schedules skip it
        assert not w.plan(312, 7168, 10240, mode=mode, split=2).cfg.block_n2


def test_auto_core_keeps_the_faster_plan(monkeypatch):
    """``matmul(core="auto")`` times both plans once where the WS core takes the product and
    keeps the WS one only under ``TUNE_MARGIN`` of the portable one's time; the plan is cached
    (a repeated call times nothing); deterministic mode (unless ``DET_ON_WS``) and
    ``DITRON_GEMM_TUNE=0`` (``TUNE_CORES``) time nothing; a WS plan that fails to build marks the core broken and the
    portable plan stays. (Stand-ins for the GPU parts: the refusal, the WS plan and the
    timer.)"""
    import torch

    from ditron_ops.gemm import _core

    timed, times, built = [], {}, []

    class StubWs:
        name = "ws:stub"

        def __init__(self, a, b, out, bias, sms, deterministic=False):
            built.append(deterministic)

        def run(self, a, b, out, bias):
            return out.copy_((a.float() @ b.float()).to(out.dtype))

    def fake_time(fns, device):
        timed.append(len(fns))
        return [times["tl"], times["ws"]]

    monkeypatch.setattr(_core, "ws_refusal", lambda *args: None)
    monkeypatch.setattr(_core, "WsGemm", StubWs)
    monkeypatch.setattr(_core, "time_alternating", fake_time)
    monkeypatch.setattr(_core, "TUNE_CORES", True)
    broken = []
    monkeypatch.setattr(_core, "ws_mark_broken", broken.append)

    made = {}

    def call(m, **kw):  # the same tensors per m: a plan's key holds where rows start in a line
        a, b = made.setdefault(m, (torch.randn(m, 32, dtype=torch.float16),
                                   torch.randn(32, 16, dtype=torch.float16)))
        out = _core.matmul(a, b, **kw)
        torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)
        return _core.matmul_config(a, b, **kw)

    times.update(tl=1.0, ws=0.9)
    assert call(40, deterministic=False) == "ws:stub" and timed == [2]
    assert call(40, deterministic=False) == "ws:stub" and timed == [2]  # cached: not timed
    times.update(tl=1.0, ws=0.98)  # within the margin: the portable plan stays
    assert not call(41, deterministic=False).startswith("ws:") and timed == [2, 2]
    monkeypatch.setattr(_core, "DET_ON_WS", False)
    call(42, deterministic=True)
    assert timed == [2, 2]
    monkeypatch.setattr(_core, "DET_ON_WS", True)  # (a GPU showed both cores' bits equal)
    times.update(tl=1.0, ws=0.9)
    assert call(46, deterministic=True) == "ws:stub" and timed == [2, 2, 2]
    assert built[-1] is True and not any(built[:-1])  # (the WS core's deterministic plan)
    monkeypatch.setattr(_core, "DET_ON_WS", False)
    monkeypatch.setattr(_core, "TUNE_CORES", False)
    times.update(tl=1.0, ws=0.5)
    assert not call(43, deterministic=False).startswith("ws:") and timed == [2, 2, 2]
    monkeypatch.setattr(_core, "TUNE_CORES", True)

    class FailingWs(StubWs):
        def __init__(self, *args, **kw):
            raise AttributeError("shared_memory_descriptor has no attribute _reinterpret")

    monkeypatch.setattr(_core, "WsGemm", FailingWs)
    assert not call(44, deterministic=False).startswith("ws:") and timed == [2, 2, 2]
    assert [type(e) for e in broken] == [AttributeError]

    class OutOfResources(Exception):  # one config's limits: that plan stays portable only
        pass

    class HungryWs(StubWs):
        def __init__(self, *args, **kw):
            raise OutOfResources("shared memory")

    monkeypatch.setattr(_core, "WsGemm", HungryWs)
    assert not call(45, deterministic=False).startswith("ws:") and len(broken) == 1


def test_time_alternating_takes_each_plans_best_segment(monkeypatch):
    """``time_alternating``'s bookkeeping on a fake clock (CUDA events stand-ins): per function
    the best segment's time per call, segments of about ``TUNE_SEGMENT_S`` each, one final
    synchronize; a slow first segment (launch gaps) does not count."""
    import torch

    from ditron_ops.gemm import _tune

    clock = {"t": 0.0, "syncs": 0, "events": 0}

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = clock["t"]
            clock["events"] += 1

        def synchronize(self):
            clock["syncs"] += 1

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    calls = {"a": 0, "b": 0}

    def fn(name, cost):
        def call():
            calls[name] += 1
            # 4 events for the two estimates, then the first mark: "a"'s first segment runs
            # behind launch gaps (3x its cost)
            first_segment = name == "a" and clock["events"] == 5
            clock["t"] += cost * (3.0 if first_segment else 1.0)
        return call

    t = _tune.time_alternating([fn("a", 20e-6), fn("b", 50e-6)], torch.device("cpu"))
    assert abs(t[0] - 20e-6) < 1e-9 and abs(t[1] - 50e-6) < 1e-9
    assert clock["syncs"] == 3  # two estimates, one at the end
    for name, cost in (("a", 20e-6), ("b", 50e-6)):  # segments of about TUNE_SEGMENT_S
        n, rest = divmod(calls[name] - 2, _tune.TUNE_ROUNDS)
        assert rest == 0 and round(_tune.TUNE_SEGMENT_S / cost) <= n <= round(
            _tune.TUNE_SEGMENT_S / cost) + 1, (name, n)


def test_another_tritons_gluon_is_refused_after_one_warning(monkeypatch):
    """On a Triton other than ``GLUON_VERSION`` (the Gluon API the WS core is written
    against) ``refusal`` refuses every product with one warning and tries no compile."""
    import warnings

    import pytest
    import torch

    from ditron_ops.gemm import _ws_launch

    class Cuda:  # a CPU tensor standing in for one on an sm_90 device
        type = "cuda"

    if not _ws_launch.HAVE_GLUON:
        pytest.skip("no Gluon: refused before any version question")
    monkeypatch.setitem(_ws_launch._STATE, "broken", None)
    monkeypatch.setattr(_ws_launch, "GLUON_VERSION", "0.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    class Operand:
        def __init__(self, t):
            self.t, self.device = t, Cuda()

    a = Operand(torch.zeros(512, 4096, dtype=torch.bfloat16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = _ws_launch.refusal(a, None, None, None)
        again = _ws_launch.refusal(a, None, None, None)
    assert first == again and "unavailable" in first
    assert sum("warp-specialized" in str(w.message) for w in seen) == 1


def test_rule_plans_cover_every_form_the_rule_picks():
    """``rule_plans`` (what ``precompile`` binds) holds every (config, schedule, ring depth,
    reduce split) ``plan`` returns on a seeded sweep of shapes, SM counts and both C sizes it
    may be asked for, and nothing ``plan`` cannot return."""
    forms = {(p.variant, p.mode, p.stages, p.split if p.mode == C.MODE_SPLITR else 1)
             for p in C.rule_plans(2, 2)}
    rng = random.Random(39)
    picked = set()
    for _ in range(6000):
        m = rng.choice([rng.randint(65, 20000), rng.randint(65, 1024)])
        n = rng.choice([rng.randint(1, 30000), rng.randint(2, 3750) * 8, rng.randint(1, 32) * 64])
        k = rng.choice([rng.randint(1, 30000), rng.randint(2, 3750) * 8, rng.randint(1, 400) * 64])
        p = C.plan(m, n, k, 2, 2, rng.choice([132, 114, 78, 66]))
        picked.add((p.variant, p.mode, p.stages, p.split if p.mode == C.MODE_SPLITR else 1))
    assert picked <= forms, picked - forms
    # every config, schedule and depth is picked somewhere (the splits of MODE_SPLITR are rare)
    assert {f[:3] for f in picked} == {f[:3] for f in forms}
