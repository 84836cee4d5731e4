"""CPU tier: the fp8 WS core's host rules (``gemm/_ws_scaled.py``) as pure functions: what it
refuses, and ring depths that fit shared memory."""
import pytest
import torch

from ditron_ops.gemm import _ws_scaled

FP8 = torch.float8_e4m3fn


def _ops(m=256, n=256, k=512, dtype=FP8, out_dtype=torch.bfloat16):
    a = torch.zeros(m, k, dtype=dtype)
    b = torch.zeros(n, k, dtype=dtype).t()  # the weight's w.t(), as k_major gives it
    return a, b, torch.empty(m, n, dtype=out_dtype)


def test_operand_refusal():
    a, b, out = _ops()
    assert _ws_scaled.operand_refusal(a, b, out, None) is None
    assert _ws_scaled.operand_refusal(a, b, out, torch.zeros(256, dtype=torch.bfloat16)) is None
    assert "M <=" in _ws_scaled.operand_refusal(*_ops(m=32), None)
    assert "e4m3" in _ws_scaled.operand_refusal(*_ops(dtype=torch.float8_e5m2), None)
    assert "K or N" in _ws_scaled.operand_refusal(*_ops(k=0), None)
    a, b, out = _ops(k=1000)  # 1000-byte rows: no TMA descriptor
    assert "16-byte rows" in _ws_scaled.operand_refusal(a, b, out, None)
    a, b, out = _ops()
    assert "16-byte rows" in _ws_scaled.operand_refusal(a, b.t().contiguous(), out, None)
    odd = torch.empty(256, 257, dtype=torch.bfloat16)[:, :256]  # 514-byte rows
    assert "16-byte rows" in _ws_scaled.operand_refusal(a, b, odd, None)
    assert "bias" in _ws_scaled.operand_refusal(a, b, out, torch.zeros(512)[::2])


@pytest.mark.parametrize("name", list(_ws_scaled.SCALED_CONFIGS))
@pytest.mark.parametrize("out_bytes", [2, 4])
def test_stages_fit_shared_memory(name, out_bytes):
    cfg = _ws_scaled.SCALED_CONFIGS[name]
    st = _ws_scaled.stages(cfg, out_bytes)
    staging = 2 * cfg.epi_bufs * 64 * _ws_scaled.epi_n(out_bytes) * out_bytes  # (per consumer)
    used = st * (cfg.block_m + cfg.block_n) * _ws_scaled.BLOCK_K + staging
    assert 3 <= st <= _ws_scaled.MAX_STAGES and used <= _ws_scaled.SMEM_BYTES
    # block scales: each 128-column half of a split tile, or a ping-pong tile, inside one
    # 128-column block; a warpgroup's 64 rows (registers); the ping-pong's ring holds pairs
    if cfg.split:
        assert cfg.block_m == 128 and cfg.block_n in (128, 256)
    else:
        assert (cfg.block_m, cfg.block_n) == (64, 128) and st % 2 == 0
    assert set(cfg.modes) <= {1, 2} and cfg.modes
    # two K steps a promotion: split tiles on tensor / row scales only (block scales change
    # every step); one or two C staging tiles a consumer
    assert cfg.promote == 1 or (cfg.promote == 2 and cfg.split and cfg.modes == (1, ))
    assert cfg.epi_bufs in (1, 2)


def test_every_scale_mode_has_ws_configs():
    assert _ws_scaled.configs_for(1) == ("split128x256p2e2", "split128x128p2e2")
    assert _ws_scaled.configs_for(2) == ("split128x128e2", "pp64x128")
    for mode, name in _ws_scaled.CONSUMER_FORMS:  # (a waiting consumer is split)
        cfg = _ws_scaled.SCALED_CONFIGS[name]
        assert cfg.split and mode in cfg.modes, (mode, name)
    with pytest.raises(ValueError, match="not in"):
        _ws_scaled.WsScaledGemm(*_ops(), None, None, None, 1, 1, 1, "coop128x128")


def test_consumer_config_rule():
    """The ag_gemm consumer's config (a rule: a waiting kernel cannot be timed): block scales
    the 128-wide split; tensor / row scales 128 wide where 256-wide tiles leave most SMs idle
    or a near-empty last wave (1280x1152, 384x4608, 1280x4096 at 132 programs), 256 wide
    where they fill the waves (753x4096: one wave of 96 against two of 192; 7040x7168); every
    answer one of the precompiled ``CONSUMER_FORMS``."""
    pick = _ws_scaled.consumer_config
    assert pick(2, 7040, 7168, 132) == "split128x128e2"
    for m, n in ((1280, 1152), (384, 4608), (1280, 4096), (971, 4608)):
        assert pick(1, m, n, 132) == "split128x128p2e2", (m, n)
    for m, n in ((753, 4096), (7040, 7168), (256, 16384), (2165, 7168)):
        assert pick(1, m, n, 132) == "split128x256p2e2", (m, n)
    forms = {(mode, pick(mode, m, n, sms)) for mode in (1, 2) for m in (1, 100, 1280, 9000)
             for n in (64, 1152, 4096, 29568) for sms in (1, 66, 131, 132)}
    assert forms == set(_ws_scaled.CONSUMER_FORMS)
