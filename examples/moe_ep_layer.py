"""An expert-parallel MoE layer trained with ``ditron_ops.moe`` on virtual ranks.

    python examples/moe_ep_layer.py                # GPU: 4 virtual ranks, bf16; CPU: 2 ranks, fp32, tiny
    python examples/moe_ep_layer.py --world-size 3 # any W dividing the experts

Every rank holds T tokens and E / W experts (a SiLU MLP each: ``w1 [H, F]``, ``w2 [F, H]``). A
router (``H -> E``, replicated) picks k experts per token with renormalized softmax weights;
``dispatch`` sends the tokens to their experts' ranks in the ``expert_contig`` layout, each rank
runs its experts with two grouped GEMMs over the device-side ``offsets`` (no host sync), and
``combine`` sums the outputs with the router weights. Autograd runs through all of it: the
experts' gradients come back through the dispatch (a combine), the router's through the
combine's weights; the replicated router's gradient is all-reduced.

Every rank also builds the whole layer from the same seed and computes it alone on all ranks'
tokens (the single-process reference). The first step's loss and gradients must match it, then
a few SGD steps run on both and the losses must keep matching.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import ditron_ops


def full_layer(seed: int, world: int, tokens: int, hidden: int, ffn: int, experts: int):
    """The whole problem, identical on every rank: tokens of all ranks, router, experts, target."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(world * tokens, hidden, generator=gen)
    router = torch.randn(hidden, experts, generator=gen) / hidden ** 0.5
    w1 = torch.randn(experts, hidden, ffn, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn ** 0.5
    target = torch.randn(world * tokens, hidden, generator=gen)
    return x, router, w1, w2, target


def route(x: torch.Tensor, router: torch.Tensor, topk: int):
    """Top-k experts per token and their renormalized softmax weights (fp32)."""
    probs = torch.softmax(x.float() @ router, dim=-1)
    top = probs.topk(topk, dim=-1)
    return top.indices, top.values / top.values.sum(-1, keepdim=True)


def reference_forward(x, router, w1, w2, topk: int) -> torch.Tensor:
    """The layer in one process: ``out[t] = sum_j w[t, j] * mlp_{e_j}(x[t])`` (dense loop)."""
    idx, weights = route(x, router, topk)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w1.shape[0]):
        hit = idx == e  # [T, k]
        rows = hit.any(-1)
        if rows.any():
            y = F.silu(x[rows] @ w1[e]) @ w2[e]
            out[rows] += (weights * hit)[rows].sum(-1, keepdim=True) * y.float()
    return out


def train(group, args) -> list[float]:
    w, r, dev = group.world_size, group.rank, group.device
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    t, h, f, e, k = (256, 1024, 512, 16, 4) if gpu else (6, 32, 16, 2 * w, 2)
    align = 16 if gpu else 8  # grouped GEMMs want each expert's rows a multiple of 16 on the GPU
    # the reference starts from the same (dtype-rounded) values, so both route every token alike
    x_all, router0, w1_all, w2_all, target_all = (v.to(dtype).float() if i in (0, 2, 3) else v for i, v in
                                                   enumerate(full_layer(0, w, t, h, f, e)))
    el, mine = e // w, slice(r * t, (r + 1) * t)
    x, target = x_all[mine].to(dev, dtype), target_all[mine].to(dev)
    router = router0.clone().to(dev).requires_grad_()
    w1 = w1_all[r * el:(r + 1) * el].to(dev, dtype).requires_grad_()
    w2 = w2_all[r * el:(r + 1) * el].to(dev, dtype).requires_grad_()
    ref = [p.clone().requires_grad_() for p in (router0, w1_all, w2_all)]
    tol, grad_tol = (3e-2, 5e-2) if gpu else (1e-5, 1e-4)  # bf16 GEMMs on the GPU
    losses = []
    with ditron_ops.moe.Buffer(group, num_experts=e, max_tokens_per_rank=t, hidden=h, topk=k, dtype=dtype) as buf:
        for step in range(4):
            idx, weights = route(x, router, k)
            d = buf.dispatch(x, idx, weights, layout="expert_contig", expert_alignment=align)
            ends = d.offsets[1:]  # int32 on the device: each local expert's last row (exclusive)
            y = torch._grouped_mm(F.silu(torch._grouped_mm(d.x, w1, offs=ends)), w2, offs=ends)
            out = buf.combine(y, d.handle)  # weights: the router's, from the dispatch
            loss = ((out.float() - target) ** 2).sum() / (w * t * h)  # this rank's share
            loss.backward()
            router.grad = ditron_ops.all_reduce(router.grad)  # replicated: sum every rank's share
            total = float(ditron_ops.all_reduce(loss.detach().reshape(1)))

            ref_out = reference_forward(x_all, *ref, k)
            ref_loss = ((ref_out - target_all) ** 2).mean()
            ref_loss.backward()
            assert abs(total - ref_loss.item()) <= tol * max(1.0, ref_loss.item()), (step, total, ref_loss.item())
            if step == 0:
                for name, got, want in (("router", router.grad, ref[0].grad),
                                        ("w1", w1.grad, ref[1].grad[r * el:(r + 1) * el]),
                                        ("w2", w2.grad, ref[2].grad[r * el:(r + 1) * el])):
                    err = (got.float().cpu() - want).abs().max().item()
                    assert err <= grad_tol * want.abs().max().item(), (name, err, want.abs().max().item())
            with torch.no_grad():
                for p, q in zip((router, w1, w2), ref):
                    p -= args.lr * p.grad
                    q -= args.lr * q.grad
                    p.grad = q.grad = None
            losses.append(total)
    return losses


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="virtual ranks (GPU 4, CPU 2)")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args(argv)
    from ditron_ops import _env

    _env.prepare_cuda_for_virtual_ranks()
    world = args.world_size or (4 if torch.cuda.is_available() else 2)
    losses = ditron_ops.launch(train, world, args=(args,))[0]
    print("loss per step:", " ".join(f"{v:.5f}" for v in losses), "(matches the single-process layer)")
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not decrease")
    return losses


if __name__ == "__main__":
    main()
