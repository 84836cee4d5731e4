"""Per-rank bodies of the ``ditron_ops.compile`` tests (CPU gloo, GPU, the torchrun example).

A tensor-parallel Transformer block (attention projections + gated MLP, sequence parallel over
``[B, S, H]``), a row-sharded 2-D MLP with biases, and a non-sequence-parallel head whose
row-parallel outputs are all-reduced (one into ``add + RMSNorm``), written with DTensor's
``parallelize_module`` as a user would, compiled with inductor and the pass, and compared with
eager (forward and backward).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def fresh_compile():
    """Inductor's FX-graph and AOTAutograd caches off: a graph found in the cache (an earlier
    run's, on disk) skips the post-grad passes, so the pass's reports, which the checks read,
    would be empty."""
    import contextlib

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack

C10D = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.ffn = Attention(dim, heads), FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attn(self.norm1(x))
        return h + self.ffn(self.norm2(h))


class Head(nn.Module):
    """Tensor parallel without sequence parallelism: ``mm -> all_reduce`` twice, one of them
    followed by ``add + RMSNorm``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.c, self.d = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x):
        y = self.norm(x + self.b(F.gelu(self.a(x))))
        return self.d(F.gelu(self.c(y)))


def build(mesh, dim=24, heads=6, hidden=96, seed=0):
    """The three modules, parallelized over ``mesh`` (same weights on every rank)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(seed)
    block, mlp, head = Block(dim, heads, hidden), FeedForward(dim, hidden, bias=True), Head(dim, hidden)
    seq = (Shard(1),)
    gather = dict(input_layouts=seq, desired_input_layouts=(Replicate(),))
    parallelize_module(block, mesh, {
        "norm1": SequenceParallel(), "norm2": SequenceParallel(),
        "attn": PrepareModuleInput(**gather), "ffn": PrepareModuleInput(**gather),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    parallelize_module(mlp, mesh, {
        "w1": ColwiseParallel(input_layouts=Shard(0)), "w3": ColwiseParallel(input_layouts=Shard(0)),
        "w2": RowwiseParallel(output_layouts=Shard(0))})
    parallelize_module(head, mesh, {"a": ColwiseParallel(), "b": RowwiseParallel(),
                                    "c": ColwiseParallel(), "d": RowwiseParallel()})
    return block, mlp, head


def make_step(mesh, block, mlp, head):
    """``step(x3, x2, x)``: the three modules on local tensors (sequence shards for the first
    two, the full replicated rows for the head)."""
    from torch.distributed.tensor import DTensor, Shard

    def step(x3, x2, x):
        y3 = block(DTensor.from_local(x3, mesh, [Shard(1)])).to_local()
        return y3, mlp(x2), head(x)
    return step


def graph_recorder(store: list):
    """A post-grad pass recording the call targets of every graph (after the ditron pass)."""
    def record(graph):
        store.append([str(n.target) for n in graph.nodes if n.op == "call_function"])
    return record


def tp_compile_body(group, dtype=torch.float32, batch=2, seq=24, dim=24, heads=6, hidden=96):
    """On every rank: eager vs compiled-with-the-pass (forward, backward), the graphs' ops, and
    deterministic mode's bitwise repeatability. Returns a dict of numbers and flags."""
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    import ditron_ops
    import ditron_ops.compile as dc
    from ditron_ops.compile import passes

    device = group.device
    w = group.world_size
    mesh = init_device_mesh(device.type, (w,))
    block, mlp, head = (m.to(device=device, dtype=dtype) for m in build(mesh, dim, heads, hidden))
    step = make_step(mesh, block, mlp, head)
    gen = torch.Generator().manual_seed(1)
    x3 = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)
    x2 = torch.randn(seq, dim, generator=gen).to(device, dtype)
    x = torch.randn(6, dim, generator=gen).to(device, dtype)
    rows = seq // w
    inputs = [x3[:, group.rank * rows:(group.rank + 1) * rows].clone().requires_grad_(),
              x2[group.rank * rows:(group.rank + 1) * rows].clone().requires_grad_(),
              x.clone().requires_grad_()]
    params = [p for m in (block, mlp, head) for p in m.parameters()]

    def run(fn):
        outs = fn(*inputs)
        loss = sum((o.float() * (1 + torch.arange(o.numel(), device=device).view(o.shape) % 7)).sum()
                   for o in outs)
        grads = torch.autograd.grad(loss, inputs + params)
        return [o.detach() for o in outs], [g.to_local() if hasattr(g, "to_local") else g
                                            for g in grads]

    eager_out, eager_grads = run(step)
    graphs: list = []
    results = {}
    for det in (False, True):
        torch._dynamo.reset()
        start = len(passes._reports)
        with ditron_ops.deterministic(det), dc.enable(allow_reference=True):
            ours = inductor_config.post_grad_custom_post_pass
            ours = list(ours) if isinstance(ours, (list, tuple)) else [ours]
            graphs.clear()
            with inductor_config.patch(post_grad_custom_post_pass=ours + [graph_recorder(graphs)],
                                       fx_graph_cache=False):
                compiled = torch.compile(step)
                out1, grads1 = run(compiled)
                out2, grads2 = run(compiled)
        reports = passes._reports[start:]
        err = max(max((a.float() - b.float()).abs().max().item() for a, b in zip(out1, eager_out)),
                  max((a.float() - b.float()).abs().max().item() for a, b in zip(grads1, eager_grads)))
        targets = [t for g in graphs for t in g]
        results[det] = {
            "max_err": err,
            "repeat_equal": all(torch.equal(a, b) for a, b in zip(out1 + grads1, out2 + grads2)),
            "ditron_ops": sorted({t for t in targets if t.startswith("ditron.")}),
            "c10d_left": sorted(t for t in targets if t.startswith("_c10d_functional.")
                                and t.split(".")[1] in C10D),
            "rewritten": sorted(e.op for r in reports for e in r.entries if e.rewritten),
            "left": [(e.op, e.detail) for r in reports for e in r.entries if not e.rewritten],
            "modes": sorted({r.deterministic for r in reports}),
            "graphs": len(graphs),
        }
    # inference (no autograd): one graph, where the all-reduced sum is not saved for a backward
    torch._dynamo.reset()
    start = len(passes._reports)
    with torch.no_grad():
        want = step(*inputs)
        with dc.enable(allow_reference=True), fresh_compile():
            got = torch.compile(step)(*inputs)
    reports = passes._reports[start:]
    results["inference"] = {
        "max_err": max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)),
        "rewritten": sorted(e.op for r in reports for e in r.entries if e.rewritten),
        "kinds": sorted({r.kind for r in reports})}
    return results


def funcol_body(group, dtype=torch.float32, rows=8, k=32, n=48):
    """Functional collectives written by hand (they stay in the graph at any W, W = 1
    included): ``all_gather -> mm``, ``mm -> reduce_scatter``, ``mm -> all_reduce``, compiled
    with the pass, against eager; deterministic mode run twice. Returns a dict."""
    import torch.distributed._functional_collectives as funcol

    import ditron_ops
    import ditron_ops.compile as dc
    from ditron_ops.compile import passes

    pg = getattr(group, "pg", None)
    w, device = group.world_size, group.device
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w1, w2, w3 = (torch.randn(*s, generator=gen).div(s[0] ** 0.5).to(device, dtype)
                  for s in ((k, n), (n, k), (k, n)))

    def f(x, w1, w2, w3):
        h = funcol.all_gather_tensor(x, 0, pg) @ w1
        y = funcol.reduce_scatter_tensor(h @ w2, "sum", 0, pg)
        return funcol.all_reduce(y @ w3, "sum", pg)

    # the eager reference in fp32 on the CPU: the group is gloo, whose collectives are for CPU
    # tensors (its all_gather of CUDA tensors crashed the one-PE NVSHMEM child)
    want = f(*(t.float().cpu() for t in (x, w1, w2, w3)))
    out = {}
    for det in (False, True):
        torch._dynamo.reset()
        start = len(passes._reports)
        with ditron_ops.deterministic(det), dc.enable(allow_reference=True), fresh_compile():
            compiled = torch.compile(f)
            got, again = compiled(x, w1, w2, w3), compiled(x, w1, w2, w3)
        reports = passes._reports[start:]
        out[str(det)] = {
            "max_err": (got.float().cpu() - want).abs().max().item(),
            "scale": want.abs().max().item(),
            "repeat_equal": bool(torch.equal(got, again)),
            "rewritten": sorted(e.op for r in reports for e in r.entries if e.rewritten),
            "left": [e.detail for r in reports for e in r.entries if not e.rewritten],
            "shape_ok": tuple(got.shape) == tuple(want.shape) and got.stride() == want.stride(),
        }
    del w
    return out


def _rms(h, w, eps=1e-6):
    """RMSNorm as Llama/Gemma write it (fp32 statistics), ``w`` applied in fp32."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(h.dtype)


def _entries(reports) -> tuple:
    """``(rewritten ops, [(op, reason)] left)`` of the pass's reports."""
    return (sorted(e.op for r in reports for e in r.entries if e.rewritten),
            [(e.op, e.detail) for r in reports for e in r.entries if not e.rewritten])


def patterns_body(group, rows=8, k=16, n=24):
    """On a one-rank gloo group (the collectives stay in the graph): the rewrites and refusals
    of the pass on hand-written patterns. Returns a dict per case: what was rewritten, what was
    left with which reason, and the compiled result's error against eager."""
    import torch.distributed._functional_collectives as funcol

    import ditron_ops.compile as dc
    from ditron_ops.compile import passes

    pg = group.pg
    gen = torch.Generator().manual_seed(5)

    def rand(*shape, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(dtype)

    def compiled(fn, args, allow_reference=True, dynamic=None):
        torch._dynamo.reset()
        start = len(passes._reports)
        with dc.enable(allow_reference=allow_reference), fresh_compile():
            got = torch.compile(fn, dynamic=dynamic)(*args)
        rewritten, left = _entries(passes._reports[start:])
        want = fn(*args)
        errs = [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want)]
        return {"rewritten": rewritten, "left": left, "errs": errs, "max_err": max(errs)}

    out = {}

    # 1. refusals that must leave the pattern (not crash), next to a Gemma norm whose weight
    # ``1 + w`` is computed after the sum (the fused call is inserted where the sum is read)
    def refusals(x, res, w, a1, b1, a2, b2, a3, b3, c16, d16):
        h = funcol.all_reduce(x, "sum", pg) + res
        normed = _rms(h, 1.0 + w)                                      # rewritten
        bad_w = _rms(funcol.all_reduce(x * 2, "sum", pg) + res, w[:1])  # weight [1]: left
        # [1, N] + [M, N]: a broadcasting sum of products
        bcast = funcol.reduce_scatter_tensor(a1[:1] @ b1 + a2 @ b2, "sum", 0, pg)
        # a view that changes the product's last dim
        cols = funcol.reduce_scatter_tensor((a3 @ b3).view(-1, n // 2), "sum", 0, pg)
        # fp16 + fp32 products (type promotion)
        mixed = funcol.reduce_scatter_tensor(c16 @ d16 + a2 @ b2, "sum", 0, pg)
        return normed, h, bad_w, bcast, cols, mixed

    args = (rand(rows, k), rand(rows, k), rand(k), rand(rows, k), rand(k, n), rand(rows, k),
            rand(k, n), rand(rows, k), rand(k, n), rand(rows, k, dtype=torch.float16),
            rand(k, n, dtype=torch.float16))
    out["refusals"] = compiled(refusals, args)

    # 2. the residual reused after the norm in fp16 (rewritten: the add has two users, the
    # upcast and the next residual) and bf16 (matched; left only for the CPU path's dtypes)
    def reused(x16, r16, w16, x_bf, r_bf, w_bf):
        outs = []
        for x, r, w in ((x16, r16, w16), (x_bf, r_bf, w_bf)):
            h = funcol.all_reduce(x, "sum", pg) + r
            outs += [torch.nn.functional.rms_norm(h, (h.shape[-1],), w, 1e-6), h * 3]
        return outs

    args = tuple(rand(*s, dtype=dt) for dt in (torch.float16, torch.bfloat16)
                 for s in ((rows, k), (rows, k), (k,)))
    out["reused"] = compiled(reused, args)

    # 3. a TorchGroup without allow_reference: left (the reference path is not faster)
    def mlp(x, w1, w2):
        h = funcol.all_gather_tensor(x, 0, pg) @ w1
        return (funcol.reduce_scatter_tensor(h @ w2, "sum", 0, pg),)

    args = (rand(rows, k), rand(k, n), rand(n, k))
    out["no_reference"] = compiled(mlp, args, allow_reference=False)

    # 4. dynamic shapes: left, with the reason
    out["dynamic"] = compiled(mlp, args, dynamic=True)
    return out


def cache_child(tmpdir: str) -> dict:
    """One fresh process of the cache test: a one-rank gloo group, ``mlp`` compiled with the
    pass and inductor's caches on (``TORCHINDUCTOR_CACHE_DIR`` set by the caller), run once
    under the profiler. Returns whether the pass ran here, the ditron ops that ran, the cache
    hits, and the error against eager."""
    import os

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._dynamo.utils import counters

    import ditron_ops.compile as dc
    from ditron_ops.compile import passes

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmpdir, 'store')}",
                            rank=0, world_size=1)
    try:
        pg = dist.group.WORLD

        def mlp(x, w1, w2, w3):
            h = funcol.all_gather_tensor(x, 0, pg) @ w1
            y = funcol.reduce_scatter_tensor(h @ w2, "sum", 0, pg)
            return funcol.all_reduce(y @ w3, "sum", pg)

        gen = torch.Generator().manual_seed(0)
        args = [torch.randn(*s, generator=gen) / 4 for s in ((8, 16), (16, 24), (24, 16), (16, 24))]
        with dc.enable(allow_reference=True):
            fn = torch.compile(mlp)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = fn(*args)
        ran = sorted({e.name for e in prof.events() if e.name.startswith("ditron::")})
        result = {"pass_ran": bool(passes._reports), "ditron_ran": ran,
                  "hits": {k: v for k, v in counters["inductor"].items() if "hit" in k}
                  | {k: v for k, v in counters["aot_autograd"].items() if "hit" in k},
                  "max_err": (got - mlp(*args)).abs().max().item()}
        result["remap"] = _remap_checks(tmpdir)
        return result
    finally:
        dist.destroy_process_group()


def _remap_checks(tmpdir: str) -> dict:
    """The group mapping after the process group is destroyed and created again under the same
    name, and after an NVSHMEM group is registered over it (a stand-in: no NVSHMEM on CPU)."""
    import os

    import torch.distributed as dist

    from ditron_ops.compile import groups
    from ditron_ops.runtime import group as rg

    name = dist.group.WORLD.group_name
    first, first_name = groups.ditron_group(name)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmpdir, 'store2')}",
                            rank=0, world_size=1)
    pg = dist.group.WORLD
    groups.drop_stale()  # what the pass's cache key does before inductor looks a graph up
    again, again_name = groups.ditron_group(pg.group_name)
    resolved = rg.resolve_group(again_name)

    class StandIn(rg.Group):  # an NVSHMEM group over ``pg``, as init_nvshmem would register
        backend = "nvshmem"

        def _alloc_symmetric(self, nbytes):
            raise NotImplementedError

    nv = StandIn(0, 1, torch.device("cpu"), f"nvshmem:{pg.group_name}")
    nv.pg = pg
    rg.register_group(nv)
    try:
        later, later_name = groups.ditron_group(pg.group_name)
    finally:
        rg.unregister_group(nv)
    return {"same_name": pg.group_name == name and first_name == again_name,
            "new_group": again is not first and again.pg is pg and resolved is again,
            "nvshmem_later": later is nv and later_name == nv.group_name}
