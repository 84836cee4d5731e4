"""A tensor-parallel MLP layer trained with ditron_ops under torchrun (one process per GPU).

    torchrun --nproc-per-node 2 examples/tp_mlp_torchrun.py                    # GPUs (nvshmem)
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/tp_mlp_torchrun.py # CPU (gloo)

Sequence parallel in and out (Megatron style): every rank holds T/W tokens of ``x [T, H]``.
``ag_gemm`` gathers them into the column-parallel up projection (``w1`` split along F),
``gemm_rs`` reduce-scatters the row-parallel down projection (``w2`` split along F) back to
T/W tokens. Autograd pairs the two: each is the other's backward. Every rank builds the full
weights from one seed and keeps its slice, so each can also compute the whole layer alone;
the first step's loss and gradients are checked against that, then a few SGD steps run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import ditron_ops
from ditron_ops.runtime.torchrun import torchrun_group


def main() -> None:
    with torchrun_group() as group:
        w, r, dev = group.world_size, group.rank, group.device
        gpu = dev.type == "cuda"
        dtype = torch.bfloat16 if gpu else torch.float32
        t, h, f = (4096, 4096, 14336) if gpu else (8 * w, 32, 16 * w)
        if t % w or f % w:
            raise SystemExit(f"{w} ranks must divide the {t} tokens and the {f} hidden units")
        gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        x_full = torch.randn(t, h, generator=gen)
        w1_full = torch.randn(h, f, generator=gen) / h ** 0.5
        w2_full = torch.randn(f, h, generator=gen) / f ** 0.5
        target = torch.randn(t, h, generator=gen)
        tok, col = t // w, f // w
        mine = slice(r * tok, (r + 1) * tok)
        x = x_full[mine].to(dev, dtype)
        w1 = w1_full[:, r * col:(r + 1) * col].to(dev, dtype).clone().requires_grad_()
        w2 = w2_full[r * col:(r + 1) * col].to(dev, dtype).clone().requires_grad_()

        def step() -> torch.Tensor:
            hidden = torch.nn.functional.gelu(ditron_ops.ag_gemm(x, w1, group))  # [T, F/W]
            y = ditron_ops.gemm_rs(hidden, w2, group)                             # [T/W, H]
            loss = ((y.float() - target[mine].to(dev)) ** 2).mean() / w
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)  # the mean over all tokens
            return total

        loss = step()
        # the same layer on this process alone, in fp32
        xr, w1r, w2r = (v.to(dev).clone().requires_grad_() for v in (x_full, w1_full, w2_full))
        ref = ((torch.nn.functional.gelu(xr @ w1r) @ w2r - target.to(dev)) ** 2).mean()
        ref.backward()
        tol = 3e-2 if gpu else 1e-4
        rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()  # noqa: E731
        errors = {"loss": abs(loss.item() - ref.item()) / ref.item(),
                  "grad w1": rel(w1.grad, w1r.grad[:, r * col:(r + 1) * col]),
                  "grad w2": rel(w2.grad, w2r.grad[r * col:(r + 1) * col])}
        worst = max(max(group.all_gather_object(errors)[q].values()) for q in range(w))
        if r == 0:
            print(f"{w} ranks, {group.backend} backend, {dtype}: step-1 loss {loss.item():.5f} "
                  f"(one process: {ref.item():.5f}); worst relative error {worst:.2e}")
        assert worst <= tol, errors
        with torch.no_grad():
            for p in (w1, w2):
                p -= 0.1 * p.grad
                p.grad = None
        losses = [loss.item()]
        for _ in range(3):
            losses.append(step().item())
            with torch.no_grad():
                for p in (w1, w2):
                    p -= 0.1 * p.grad
                    p.grad = None
        if r == 0:
            print("losses: " + " ".join(f"{v:.5f}" for v in losses))
        assert losses[-1] < losses[0], losses


if __name__ == "__main__":
    main()
