"""torch.compile turns DTensor tensor-parallel code into ditron's fused ops ("async TP").

    torchrun --nproc-per-node 2 examples/async_tp_compile.py     # GPUs: nvshmem when installed
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/async_tp_compile.py   # CPU, gloo

A sequence-parallel Transformer block (attention projections + gated MLP) is parallelized with
``parallelize_module`` as usual; ``ditron_ops.compile.enable()`` makes inductor rewrite the
all-gather -> matmul and matmul -> reduce-scatter pairs of the forward and backward graphs into
``torch.ops.ditron.ag_gemm`` / ``gemm_rs``. The example prints what was rewritten and checks the
compiled step (forward + backward) against eager.
"""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import ditron_ops.compile
from ditron_ops.runtime.torchrun import torchrun_group
from ditron_ops.testing.compile_checks import build


def main() -> None:
    with torchrun_group() as group:
        w, device = group.world_size, group.device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        mesh = init_device_mesh(device.type, (w,))
        block = build(mesh, dim=256, heads=8, hidden=1024)[0].to(device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 64 * w, 256, generator=gen).to(device, dtype)
        local = x[:, group.rank * 64:(group.rank + 1) * 64].clone().requires_grad_()

        def step(x_local):
            return block(DTensor.from_local(x_local, mesh, [Shard(1)])).to_local()

        # allow_reference: without NVSHMEM (CPU gloo, or NCCL alone) the group is a TorchGroup,
        # whose ops run their reference path; the pass leaves those unless asked (docs/compile.md)
        ref = group.backend == "torch"
        report = ditron_ops.compile.explain(step, local, allow_reference=ref)  # fwd + bwd
        if group.rank == 0:
            print(report)
        want = step(local)
        (want_grad,) = torch.autograd.grad(want.float().sum(), [local])
        torch._dynamo.reset()
        with ditron_ops.compile.enable(allow_reference=ref):
            compiled = torch.compile(step)
            got = compiled(local)
            (got_grad,) = torch.autograd.grad(got.float().sum(), [local])
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
        err = max((got - want).abs().max().item(), (got_grad - want_grad).abs().max().item())
        counts = report.counts()
        ok = err <= tol * max(1.0, want.abs().max().item()) and counts.get("ag_gemm", 0) >= 2 \
            and counts.get("gemm_rs", 0) >= 2
        print(f"rank {group.rank}/{w} ({group.backend}): rewritten {counts}, max err {err:.3g}: "
              f"{'OK' if ok else 'FAILED'}", flush=True)
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
