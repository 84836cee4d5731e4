"""GPU tier (H200): per-call plans with the compiled launchers."""
import pytest
import torch

import ditron_ops
from ditron_ops.errors import DitronError
from ditron_ops.runtime import launcher as launcher_module
from ditron_ops.runtime.launcher import BoundKernel

pytestmark = pytest.mark.gpu


def _ops(group):
    dev = group.device
    gen = torch.Generator(device="cpu").manual_seed(group.rank)

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(dtype=torch.bfloat16, device=dev)

    a, weight, x = rand(64, 256), rand(512, 256), rand(1024)
    q, cache = rand(2, 8, 128), rand(2, 600, 2, 128)
    lens = torch.tensor([600, 77], dtype=torch.int32, device=dev)
    return {
        "ag_gemm": lambda: ditron_ops.ag_gemm(a, weight.t(), impl="fused"),
        "gemm_rs": lambda: ditron_ops.gemm_rs(a, weight.t(), impl="fused"),
        "gemm_ar": lambda: ditron_ops.gemm_ar(a, weight.t(), impl="fused"),
        "all_reduce": lambda: ditron_ops.all_reduce(x),
        "all_gather": lambda: ditron_ops.all_gather(x),
        "flash_decode": lambda: ditron_ops.flash_decode(q, cache, cache, lens),
        "matmul": lambda: ditron_ops.gemm.matmul(a, weight.t()),
    }


def test_repeated_calls_bind_and_convert_nothing(monkeypatch):
    """An op called in a loop (its outputs dropped): CUDA's caching allocator hands its outputs
    the same addresses, so after a few calls an identical call binds no kernel and converts no
    descriptor; every launch goes through the compiled launcher directly (no Triton ``run``)."""
    made = {"bind": 0, "desc": 0}
    bound = []  # checked after each op's first call: a plan binds its kernels at the end of its build
    init, expand = BoundKernel.__init__, launcher_module._expand_descriptor

    def counting_init(obj, *args, **kwargs):
        made["bind"] += 1
        init(obj, *args, **kwargs)
        bound.append(obj)

    def counting_expand(*args):
        made["desc"] += 1
        return expand(*args)

    monkeypatch.setattr(BoundKernel, "__init__", counting_init)
    monkeypatch.setattr(launcher_module, "_expand_descriptor", counting_expand)

    def body(group):
        changed = {}
        for name, op in _ops(group).items():
            first = op().clone()
            slow = [str(k.fn) for k in bound if k._fast is None]
            assert not slow, f"{name}: fell back to the slow launch path: {slow}"
            for _ in range(4):  # the loop below's pattern: the last result alive during a call
                last = op()
            group.synchronize()
            before = dict(made), group.plans.builds
            for _ in range(4):
                last = op()
            group.synchronize()
            assert torch.equal(last, first), name
            if (dict(made), group.plans.builds) != before:
                changed[name] = (before, (dict(made), group.plans.builds))
        return changed

    assert ditron_ops.launch(body, 1) == [{}]


def test_new_plan_during_capture_raises_and_warm_capture_replays():
    def body(group):
        x = torch.randn(4096, device=group.device)
        y = ditron_ops.all_reduce(x)  # warm: this plan exists
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=group.stream, capture_error_mode="thread_local"):
            z = ditron_ops.all_reduce(x)
        graph.replay()
        group.synchronize()
        assert torch.equal(z, y)
        bad = torch.cuda.CUDAGraph()
        with pytest.raises(DitronError, match="plan"):
            with torch.cuda.graph(bad, stream=group.stream, capture_error_mode="thread_local"):
                ditron_ops.all_reduce(torch.randn(777, device=group.device))
        return True

    assert ditron_ops.launch(body, 1) == [True]


def _call_once(group, name):
    """One call of ``name`` on fresh tensors; returns them (inputs and output) only."""
    dev = group.device
    gen = torch.Generator(device="cpu").manual_seed(group.rank)

    def rand(*shape, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float16):
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=dev)

    if name in ("ag_gemm", "gemm_rs", "gemm_ar", "matmul"):
        a, weight = rand(64, 256), rand(512, 256)
        fn = {"ag_gemm": ditron_ops.ag_gemm, "gemm_rs": ditron_ops.gemm_rs,
              "gemm_ar": ditron_ops.gemm_ar}.get(name)
        out = ditron_ops.gemm.matmul(a, weight.t()) if fn is None else fn(a, weight.t(), impl="fused")
        return [a, weight, out]
    if name in ("all_reduce", "all_reduce_rmsnorm"):
        x, res, w = rand(32, 1024), rand(32, 1024), rand(1024)
        if name == "all_reduce":
            return [x, ditron_ops.all_reduce(x)]
        return [x, res, w, *ditron_ops.all_reduce_rmsnorm(x, res, w)]
    if name in ("flash_decode", "flash_decode paged"):
        q, k = rand(2, 8, 128), rand(2, 64, 2, 128)
        lens = torch.tensor([64, 17], dtype=torch.int32, device=dev)
        if name == "flash_decode":
            return [q, k, lens, ditron_ops.flash_decode(q, k, k, lens)]
        pages = k.reshape(8, 16, 2, 128)
        table = torch.arange(8, dtype=torch.int32, device=dev).view(2, 4)
        return [q, pages, lens, table, ditron_ops.flash_decode(q, pages, pages, lens, block_table=table)]
    a = rand(64, 256).to(torch.float8_e4m3fn)  # ag_gemm_scaled: row-wise scales
    b = rand(512, 256).to(torch.float8_e4m3fn).t()
    sa, sb = rand(64, 1, dtype=torch.float32).abs() + 0.5, rand(1, 512, dtype=torch.float32).abs() + 0.5
    return [a, b, sa, sb, ditron_ops.ag_gemm_scaled(a, b, sa, sb, impl="fused")]


@pytest.mark.parametrize("name", ["ag_gemm", "gemm_rs", "gemm_ar", "matmul", "all_reduce",
                                  "all_reduce_rmsnorm", "flash_decode", "flash_decode paged",
                                  "ag_gemm_scaled"])
def test_a_plan_keeps_no_call_tensor_alive(name):
    """The compiled launch path (bound flat arguments, descriptor caches) holds addresses, never
    a call's tensors: after the call, its inputs and outputs are freed (W = 2)."""
    import gc
    import weakref

    def body(group):
        tensors = _call_once(group, name)
        group.synchronize()
        refs = [weakref.ref(t) for t in tensors]
        del tensors
        gc.collect()
        return [i for i, r in enumerate(refs) if r() is not None]

    assert ditron_ops.launch(body, 2) == [[], []]
