"""flash_decode default-mode partition sweep on the GPU (one rank): for each problem, the split-KV
launch configuration (``SPLIT_CONFIG`` 128 keys/8 warps/3 stages, 1 per SM, or
``WIDE_SPLIT_CONFIG`` 64/4/2, 3 per SM) x programs aimed at (1-4 x the SMs), against SDPA with
paired CUDA-graph timing. Prints sdpa_us and sdpa/ours per variant (>1: ours faster); ``rule``
is the library's current choice. Usage: ``PYTHONPATH=. python benchmarks/probes/fd_partition_sweep.py``."""
import torch
import torch.nn.functional as F

from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.attention import flash_decode as api
from ditron_ops.runtime.group import sm_count
from ditron_ops.runtime.virtual import launch

CASES = [(1, 4096, 32, 8), (1, 4096, 64, 8), (8, 4096, 32, 8), (8, 4096, 64, 8), (8, 32768, 64, 8),
         (1, 32768, 64, 8), (1, 131072, 32, 8), (1, 131072, 64, 8), (64, 4096, 64, 8)]


def plan_for(s_max: int, want: int) -> tuple:
    block_n = api.SPLIT_CONFIG["BLOCK_N"]
    part = max(api.MIN_PART, -(-(-(-s_max // want)) // block_n) * block_n)
    n = -(-s_max // part)
    return part, part, n, n


def body(group):
    warm_gpu(group.device)
    sms = sm_count(group.device)
    rule_partition, rule_config = api.partition, api._split_config
    d = 128
    for b, kv, hq, hkv in CASES:
        q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=group.device)
        k = torch.randn(b, kv, hkv, d, dtype=torch.bfloat16, device=group.device)
        v = torch.randn_like(k)
        lens = torch.full((b,), kv, dtype=torch.int32, device=group.device)
        qs, ks, vs = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
        want_ref = F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)[:, :, 0].float()
        pairs = b * hkv
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)}
        variants = {"rule": None}
        for name, cfg, per_sm in (("split", api.SPLIT_CONFIG, 1), ("wide", api.WIDE_SPLIT_CONFIG, 3)):
            for waves in (1, 2, 3, 4) if name == "split" else (1, 2):
                variants[f"{name}x{waves}"] = (cfg, plan_for(kv, max(1, waves * per_sm * sms // pairs)))
        scale = 1.0 / d ** 0.5
        for vname, choice in variants.items():
            # each variant's own plan, built under its partition (a group's plan cache would
            # hand every variant the first one's)
            if choice is not None:
                api.partition = lambda *a, plan=choice[1]: plan
                api._split_config = lambda *a, cfg=choice[0], **kw: cfg
            try:
                out = torch.empty_like(q)
                plan = api._DecodePlan(group, q, k, v, lens, out, scale, False)
            finally:
                api.partition, api._split_config = rule_partition, rule_config

            def call(plan=plan, out=out):
                return plan.run(q, k, v, lens, out)
            err = (call().float() - want_ref).abs().max().item()
            assert err < 2e-2, (vname, err)
            fns[vname] = call
        t = paired_graph_times(group, fns, rounds=12, target_ms=20)
        print(f"B={b} KV={kv} {hq}/{hkv}: sdpa {t['sdpa']:.1f}us " + " ".join(
            f"{x} {t['sdpa'] / t[x]:.3f}" for x in fns if x != "sdpa"), flush=True)


launch(body, 1, torch.device("cuda", 0))
