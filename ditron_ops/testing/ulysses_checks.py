"""Checks of ``ulysses_attention`` and ``all_to_all`` on any group (virtual, nvshmem, torch).

Used by the gloo test (torch backend: the unfused path) and the one-PE NVSHMEM test; a
multi-GPU run can call ``check_ulysses`` from ``torchrun_checks``.
"""
from __future__ import annotations

import torch

from .. import reference
from ..attention.ulysses import ulysses_attention
from ..collectives import all_to_all
from ..runtime.group import Group
from .checks import make_input

REL_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def check_ulysses(group: Group, dtype: torch.dtype) -> dict[str, float]:
    """Forward (causal and not; KV split, and replicated where ``W % Hkv == 0`` allows it) and
    gradients vs the references, all_to_all bitwise. Returns ``{case: max abs error}``; raises
    AssertionError beyond ``REL_TOL``."""
    w, gpu = group.world_size, group.device.type == "cuda"
    s_r, d = (1000, 128) if gpu else (7, 64)
    errors = {}
    for hq, hkv in ((4 * w, 2 * w), (2 * w, 1)):
        full = [make_input((1, s_r * w, h, d), dtype, group.device, seed)
                for seed, h in ((1, hq), (2, hkv), (3, hkv))]
        start = group.rank * s_r
        q, k, v = (x[:, start:start + s_r].contiguous() for x in full)
        for causal in (False, True):
            out = ulysses_attention(q, k, v, group, causal=causal)
            want = reference.attention(*full, causal=causal)[:, start:start + s_r]
            err = (out.float() - want.float()).abs().max().item()
            assert err <= REL_TOL[dtype] * max(1.0, want.float().abs().max().item()), \
                f"rank {group.rank}: ulysses {hq}/{hkv} causal={causal}: error {err}"
            errors[f"{hq}/{hkv} causal={causal}"] = err
        # gradients against the full sequence's autograd (fp32 reference)
        ref = [x.float().requires_grad_() for x in full]
        dout = make_input((1, s_r * w, hq, d), torch.float32, group.device, 4)
        (reference.attention(*ref, causal=True) * dout).sum().backward()
        mine = [x.detach().requires_grad_() for x in (q, k, v)]
        ulysses_attention(*mine, group, causal=True).backward(
            dout[:, start:start + s_r].to(dtype))
        for name, x, r in zip("qkv", mine, ref):
            want = r.grad[:, start:start + s_r]
            err = (x.grad.float() - want).abs().max().item()
            assert err <= 1.5 * REL_TOL[dtype] * max(1.0, want.abs().max().item()), \
                f"rank {group.rank}: ulysses {hq}/{hkv} d{name}: error {err}"
    x = make_input((2, s_r, 4 * w, d), dtype, group.device, 10 + group.rank)
    assert torch.equal(all_to_all(x, 2, 1, group), reference.all_to_all(x, group, 2, 1))
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()
    group.check()
    return errors


def replicated_dk_reference(group: Group, q, k, v, dout, dtype: torch.dtype) -> torch.Tensor:
    """This rank's gradient of a KV head replicated on every rank (``Hkv = 1``, causal,
    deterministic): every replica's partial from the local backward, each over its own query
    heads, gathered back and summed in rank order in fp32, rounded once to ``dtype``."""
    from ..attention.ulysses import kv_for_ranks, local_attention_backward

    w = group.world_size
    heads = [all_to_all(x.contiguous(), 2, 1, group) for x in (q, kv_for_ranks(k, w), kv_for_ranks(v, w), dout)]
    qh, kh, vh, doh = (x.transpose(1, 2) for x in heads)
    _, dk_part, _ = local_attention_backward(qh, kh, vh, doh, True, q.shape[-1] ** -0.5, True)
    back = all_to_all(dk_part.transpose(1, 2).contiguous(), 1, 2, group)  # [1, S_r, W, D]
    return reference.rank_ordered_sum([back[:, :, [s]] for s in range(w)], dtype)


def rank_1_skips_a_call(group: Group, x: torch.Tensor):
    """One call on every rank, then a second that rank 1 skips: ``"skipped"`` on rank 1, the
    ``DitronTimeoutError`` its peers raise elsewhere (AssertionError if they raise none)."""
    from ..errors import DitronTimeoutError

    ulysses_attention(x, x, x, group)
    group.synchronize()
    if group.rank == 1:
        return "skipped"
    try:
        ulysses_attention(x, x, x, group)
        group.synchronize()
    except DitronTimeoutError as err:
        return err
    raise AssertionError(f"rank {group.rank}: no DitronTimeoutError while rank 1 skipped the call")


def check_op_integration(group: Group, q, k, v, scale: float, deterministic: bool) -> bool:
    """opcheck of ``ulysses_attention`` and ``all_to_all`` (schema, autograd registration,
    fake, AOT dispatch), and ``torch.compile(fullgraph=True)`` equal to eager (True)."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ditron.ulysses_attention.default,
                          (q, k, v, group.group_name, True, scale, deterministic), test_utils=utils)
    torch.library.opcheck(torch.ops.ditron.all_to_all.default, (q, group.group_name, 2, 1),
                          test_utils=utils)

    def step(x):
        return ulysses_attention(x * 1.0, k, v, group, causal=True)

    torch._dynamo.reset()
    return torch.equal(torch.compile(step, fullgraph=True)(q), step(q))
