"""Offline sm_90a compiles of the warp-specialized GEMM's ``partials="tma"`` variants
(``ditron_ops/gemm/_ws_kernels.py``) through the stand-in driver (``ditron_ops.testing.sm90``):
every new form compiles without spills, and its PTX moves partials the way it claims (TMA
stores of the staged partial, 16-byte loads in the fix-up and the reduce). Compiles only: Gluon
kernels do not run in the interpreter, so numerics and speed are the GPU probe's
(``python tools/ws_probe.py --partials``)."""
import importlib.util
import os
import re
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def _gluon_api_of_triton_36() -> bool:
    """The WS core is written against triton 3.6's Gluon API (3.9 renamed or dropped some of it:
    ``shared_memory_descriptor._reinterpret``, ``thread_barrier``); elsewhere the portable core
    serves and these compiles are not expected to work."""
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return False
    import triton
    return triton.__version__.startswith("3.6")


pytestmark = pytest.mark.skipif(not _gluon_api_of_triton_36(),
                                reason="the WS core targets triton 3.6's Gluon API")


@pytest.fixture(scope="module")
def ws():
    """``_ws_launch`` (loaded as the probe loads it: no ``ditron_ops`` import) with Triton
    compiling for sm_90a; the process's previous driver is restored afterwards."""
    from triton.runtime.driver import driver

    sys.path.insert(0, os.path.join(_ROOT, "tools"))
    import ws_probe

    from ditron_ops.testing.sm90 import use_sm90_stand_in_driver
    prev = driver._active
    use_sm90_stand_in_driver()
    try:
        yield ws_probe._ws_module(), ws_probe
    finally:
        driver._active = prev


def _compile(ws, probe, name, M, N, K, out_dtype, bias, b_kn=False, trace=False):
    import torch
    pl = probe.variant_plan(ws, name, M, N, K, 2, out_dtype.itemsize)
    a = torch.empty(M, K, dtype=torch.bfloat16)
    b = (torch.empty(K, N, dtype=torch.bfloat16) if b_kn
         else torch.empty(N, K, dtype=torch.bfloat16).t())
    out = torch.empty(M, N, dtype=out_dtype)
    bias_t = torch.empty(N, dtype=torch.bfloat16) if bias else None
    stamps = (torch.zeros(pl.grid, ws.TRACE_UNITS, ws.TRACE_POINTS, dtype=torch.int64) if trace
              else None)
    args, meta = ws.ws_operands(a, b, out, bias_t, pl, stamps)
    kernel = ws.ws_gemm_kernel.warmup(*args, **meta, grid=(pl.grid, ))
    reduce = None
    if pl.mode == ws.MODE_SPLITR:
        grid, rargs, rmeta = ws.ws_reduce_operands(out, bias_t, pl, args[4])
        reduce = ws.reduce_kernel(pl).warmup(*rargs, **rmeta, grid=grid)
    return pl, kernel, reduce


def _ops(ptx):
    return re.findall(r"\b((?:st|ld)\.global[.\w]*|cp\.async\.bulk\.tensor[.\w:]*)", ptx)


@pytest.mark.parametrize("name,M,N,K,out32,bias", [
    ("coop128x256:sk@tma", 4096, 576, 4608, False, False),   # in-kernel fix-up, 2 warpgroups
    ("pp128x128:split3@tma", 3000, 1536, 4096, True, True),   # ping-pong, fp32 C, one ahead
    ("pp64x128:sk@tma", 512, 1792, 12288, False, True),       # ping-pong 64-row, two ahead
])
def test_fixup_variants_compile(ws, name, M, N, K, out32, bias):
    import torch
    mod, probe = ws
    pl, kernel, _ = _compile(mod, probe, name, M, N, K,
                             torch.float32 if out32 else torch.bfloat16, bias, b_kn=out32)
    assert pl.partials == "tma" and pl.mode in (mod.MODE_SK, mod.MODE_SPLIT)
    st = probe._sass_stats(kernel)
    assert st["spills"] == 0 and st["local"] == 0 and st["hgmma"] > 0, st
    ops = _ops(kernel.asm["ptx"])
    # partials leave by TMA (the staged fp32 blocks beside C's stores); no register stores of
    # tiles (the counter reset is the one scalar st.global)
    assert "cp.async.bulk.wait_group 0;" in kernel.asm["ptx"]
    assert not any(o.startswith("st.global.v") for o in ops), sorted(set(ops))
    loads = [o for o in ops if o.startswith("ld.global.cg")]  # the fix-up's (bias: plain)
    assert loads and set(loads) == {"ld.global.cg.v4.b32"}, sorted(set(loads))


def test_splitr_tma_compiles(ws):
    import torch
    mod, probe = ws
    pl, kernel, reduce = _compile(mod, probe, "pp64x128:splitr3@tma", 512, 576, 4608,
                                  torch.bfloat16, True)
    assert pl.partials == "tma" and pl.mode == mod.MODE_SPLITR
    rows, ld = mod.splitr_pitch(512, 576, pl.cfg)
    assert pl.ws_tiles * 64 * 128 >= 3 * rows * ld
    st = probe._sass_stats(kernel)
    assert st["spills"] == 0 and st["local"] == 0
    ops = _ops(kernel.asm["ptx"])
    assert not any(o.startswith("st.global") for o in ops), sorted(set(ops))
    assert sum(o.startswith("cp.async.bulk.tensor.2d.global.shared") for o in ops) >= 4
    rops = _ops(reduce.asm["ptx"])
    plane_loads = [o for o in rops if o.startswith("ld.global.cg")]
    assert len(plane_loads) == 3 * 4 and set(plane_loads) == {"ld.global.cg.v4.b32"}, rops
    assert any(o.startswith("cp.async.bulk.tensor.2d.global.shared") for o in rops)  # C by TMA
    assert not any(o.startswith("st.global") for o in rops)


@pytest.mark.parametrize("name", ["coop128x256:sk", "pp128x128:sk@tma", "pp128x128"])
def test_traced_variants_compile(ws, name):
    """``TRACE`` adds the consumers' global-timer stamps (the probe's timeline) and nothing
    else: the untraced binary reads no timer and the traced one spills no more."""
    import torch
    mod, probe = ws
    plain = _compile(mod, probe, name, 3000, 1536, 4096, torch.bfloat16, False)[1]
    traced = _compile(mod, probe, name, 3000, 1536, 4096, torch.bfloat16, False, trace=True)[1]
    assert "%globaltimer" not in plain.asm["ptx"] and "%globaltimer" in traced.asm["ptx"]
    st, st0 = probe._sass_stats(traced), probe._sass_stats(plain)
    assert st["spills"] == st0["spills"] and st["hgmma"] == st0["hgmma"], (st, st0)


def test_timeline_breakdown_adds_up_to_the_last_programs_span(ws):
    """``ws_probe.timeline``: the program that finished last, its mainloops, partial store,
    fix-up, epilogue and gaps between units sum to the launch's span (stamps in ns)."""
    import torch
    _, probe = ws
    st = torch.zeros(2, 64, 4, dtype=torch.int64)
    st[0, 0] = torch.tensor([1000, 11000, 0, 12000])  # data-parallel unit: epilogue 1 us
    st[0, 1] = torch.tensor([12500, 20000, 23000, 26000])  # partial: store 3, fix-up 3
    st[1, 0] = torch.tensor([2000, 9000, 0, 10000])
    t = probe.timeline(st, 2)
    assert t == {"span": 25.0, "units": 2, "start": 0.0, "main": 17.5, "store": 3.0,
                 "fixup": 3.0, "epilogue": 1.0, "gaps": 0.5}, t
    parts = sum(t[k] for k in ("start", "main", "store", "fixup", "epilogue", "gaps"))
    assert parts == t["span"]


@pytest.mark.parametrize("name", ["coop128x256:dp", "coop128x192:dp", "pp128x128:dp",
                                  "pp64x128:dp"])
def test_waiting_consumer_variants_compile(ws, name):
    """``WAIT`` (the ag_gemm consumer): the loader's bounded waits (acquire polls of the flags,
    the global timer, the proxy fence before TMA reads) compile into every data-parallel form
    without spills; the plain binary has none of them; a waiting plan with partials is
    refused before any compile."""
    import torch
    mod, probe = ws
    M, N, K = 3000, 1536, 4096
    pl = probe.variant_plan(mod, name, M, N, K)
    a = torch.empty(M, K, dtype=torch.bfloat16)
    b = torch.empty(N, K, dtype=torch.bfloat16).t()
    out = torch.empty(M, N, dtype=torch.bfloat16)
    sig, record = torch.zeros(32, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    offsets = torch.zeros(5, dtype=torch.int32)
    wait = (sig, offsets, record, record, 1, 4, 10**6, 3)
    args, meta = mod.ws_operands(a, b, out, None, pl, wait=wait)
    assert meta["WAIT"]
    kernel = mod.ws_gemm_kernel.warmup(*args, **meta, grid=(pl.grid, ))
    st = probe._sass_stats(kernel)
    assert st["spills"] == 0 and st["local"] == 0 and st["hgmma"] > 0, st
    ptx = kernel.asm["ptx"]
    assert "%globaltimer" in ptx and "fence.proxy.async.global" in ptx
    assert re.search(r"(?:ld|atom)\.global\.sys\.acquire", ptx)  # (the flag polls)
    plain = _compile(mod, probe, name, M, N, K, torch.bfloat16, False)[1]
    assert "%globaltimer" not in plain.asm["ptx"]
    with pytest.raises(ValueError, match="data parallel"):
        mod.ws_operands(a, b, out, None, probe.variant_plan(mod, "coop128x256:sk", M, N, K),
                        wait=wait)


def _check_pushes(probe, kernel):
    """A pushing producer's sm_90a build: no spill, wgmma (bf16 or fp8) in the SASS, fp32 tiles
    out with plain 8-byte global stores of column pairs, no TMA store of C."""
    st = probe._sass_stats(kernel)
    assert st["spills"] == 0 and st["local"] == 0 and st["hgmma"] > 0, st
    ptx = kernel.asm["ptx"]
    stores = re.findall(r"\bst\.global[.\w]*", ptx)
    assert stores and set(stores) == {"st.global.v2.b32"}, stores
    assert not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)


@pytest.mark.parametrize("name", ["coop128x256:dp", "coop128x192:dp", "pp128x128:dp",
                                  "pp64x128:dp"])
@pytest.mark.parametrize("broadcast", [False, True])
def test_pushing_producer_variants_compile(ws, name, broadcast):
    """``PUSH`` (the gemm_rs / gemm_ar producer): every data-parallel form compiles without
    spills, stores fp32 tiles with plain global stores and writes no C (no TMA store); a
    pushing plan with partials is refused before any compile."""
    import torch
    mod, probe = ws
    M, N, K = 3000, 1536, 4096
    pl = probe.variant_plan(mod, name, M, N, K)
    a = torch.empty(M, K, dtype=torch.bfloat16)
    b = torch.empty(N, K, dtype=torch.bfloat16).t()
    out = torch.empty(M // 4, N, dtype=torch.bfloat16)
    slots = torch.empty(4 * M * N, dtype=torch.float32)
    peers = torch.zeros(4, dtype=torch.int64)
    offsets = torch.zeros(5, dtype=torch.int32)
    push = (slots, peers, offsets, M, 1, 4, broadcast)
    args, meta = mod.ws_operands(a, b, out, torch.empty(N, dtype=torch.bfloat16), pl, push=push)
    assert meta["PUSH"] == (2 if broadcast else 1)
    _check_pushes(probe, mod.ws_gemm_kernel.warmup(*args, **meta, grid=(pl.grid, )))
    with pytest.raises(ValueError, match="data parallel"):
        mod.ws_operands(a, b, out, None, probe.variant_plan(mod, "coop128x256:sk", M, N, K),
                        push=push)


@pytest.mark.parametrize("mode,config", [(1, "split128x256p2e2"), (1, "split128x128p2e2"),
                                         (2, "split128x128e2")])
@pytest.mark.parametrize("broadcast", [False, True])
def test_fp8_pushing_producer_variants_compile(ws, mode, config, broadcast):
    """The fp8 WS core's ``PUSH`` (``gemm_rs_scaled`` / ``gemm_ar_scaled``'s producer), every
    config the wave rule gives: compiles without spills, stores fp32 sums with plain 8-byte
    global stores, writes no C (no TMA store, no staging tile: the ring takes its memory), and
    covers all of A's rows whatever ``out`` holds; the ping-pong is refused before any
    compile."""
    import torch

    from ditron_ops.gemm import _ws_scaled
    _, probe = ws
    M, N, K = 3000, 1536, 4096
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    b = torch.empty(N, K, dtype=torch.float8_e4m3fn).t()
    out = torch.empty(M // 4, N, dtype=torch.bfloat16)
    sa, sb = torch.ones(M, 32), torch.ones(32, N // 128)
    push = (torch.empty(4 * M * N), torch.zeros(4, dtype=torch.int64),
            torch.zeros(5, dtype=torch.int32), M, 1, 4, broadcast)
    cfg = _ws_scaled.SCALED_CONFIGS[config]
    grid, args, meta = _ws_scaled.scaled_operands(a, b, out, None, sa, sb, 32, N // 128, mode,
                                                  cfg, 132, push=push)
    assert meta["PUSH"] == (2 if broadcast else 1)
    assert meta["STAGES"] == _ws_scaled.stages(cfg, 4, push=True) >= _ws_scaled.stages(cfg, 2)
    # the whole product's rows, though this rank's out holds a quarter of them
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    assert args[8:11] == (M, N, K) and grid == (min(tiles, 132), )
    _check_pushes(probe, _ws_scaled.ws_scaled_kernel.warmup(*args, **meta, grid=grid))
    with pytest.raises(ValueError, match="split"):
        _ws_scaled.scaled_operands(a, b, out, None, sa, sb, 32, N // 128, 2,
                                   _ws_scaled.SCALED_CONFIGS["pp64x128"], 132, push=push)


def test_precompile_binds_every_form_the_rule_picks(ws, monkeypatch):
    """``precompile_ws`` (``precompile``'s WS share) binds each ``rule_plans`` form per B layout
    and bias, the deterministic plan into fp32 (data parallel, per B layout), the reduce kernel
    at every split, and with ``wait`` only the data-parallel forms,
    waiting. Recorded, not compiled (``compiler.prepare``): the compiles of these forms are the
    tests above and the GPU's ``precompile``."""
    import torch

    from ditron_ops.runtime import compiler
    mod, _ = ws
    made = []
    monkeypatch.setattr(compiler, "prepare", made.append)
    mod.precompile_ws(torch.device("cpu"), (torch.bfloat16, ))

    def forms(kernels):
        return {(k.kwargs["MODE"], k.kwargs["STAGES"], k.kwargs["PINGPONG"], k.kwargs["N2"],
                 k.kwargs["B_KN"], k.kwargs["HAS_BIAS"], k.kwargs["WAIT"])
                for k in kernels if k.name == "ws_gemm_kernel"}
    plans = mod.rule_plans(2, 2)
    want = {(p.mode, p.stages, p.cfg.pingpong, p.cfg.block_n2, b_kn, bias, False)
            for p in plans for b_kn in (False, True) for bias in (False, True)}
    assert forms(made) == want
    fp32_c = [k for k in made if k.name == "ws_gemm_kernel"  # (C's layout: 32-bit elements)
              and k._templates[2][4].element_bitwidth == 32]
    assert {(k.kwargs["MODE"], k.kwargs["PINGPONG"], k.kwargs["N2"], k.kwargs["B_KN"])
            for k in fp32_c} == {(mod.MODE_DP, False, 0, b_kn) for b_kn in (False, True)}
    splits = {k.kwargs["SPLIT"] for k in made if k.name == "ws_reduce_kernel"}
    from ditron_ops.gemm._ws_configs import SPLITR_MAX
    assert splits == set(range(2, SPLITR_MAX + 1))
    made.clear()
    sig = torch.zeros(16, dtype=torch.int64)
    offsets = torch.zeros(2, dtype=torch.int32)
    mod.precompile_ws(torch.device("cpu"), (torch.float16, ),
                      wait=(sig, offsets, sig[:1], sig, 0, 1, 10**6, 0))
    assert forms(made) == {f[:6] + (True, ) for f in want if f[0] == mod.MODE_DP}
    assert all(k.name == "ws_gemm_kernel" for k in made)
    made.clear()
    slots = torch.zeros(1 << 16, dtype=torch.float32)
    for broadcast in (False, True):
        mod.precompile_ws(torch.device("cpu"), (torch.bfloat16, ),
                          push=(slots, sig, offsets, 64, 0, 1, broadcast))
    pushed = {(k.kwargs["MODE"], k.kwargs["STAGES"], k.kwargs["B_KN"], k.kwargs["HAS_BIAS"],
               k.kwargs["PUSH"]) for k in made}
    assert pushed == {(f[0], f[1], f[4], False, push) for f in want if f[0] == mod.MODE_DP
                      for push in (1, 2)}
