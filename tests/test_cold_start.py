"""CPU tier: cold start (issue 25). A first call prepares (compiles, on a GPU) only the kernels
its plans launch, all of them before the call's first waiting launch; ``launch`` compiles
nothing up front; a new signature meets once and a repeated call meets nothing; host barriers
wait out a peer's compile; the progress line's logic; ``precompile`` and its CLI on a CPU; every
family's precompile list binds to its kernels' signatures."""
import inspect
import io
import threading
import time

import pytest
import torch

import ditron_ops
from ditron_ops.__main__ import main
from ditron_ops.runtime import compiler, precompile as precompile_module
from ditron_ops.runtime.virtual import CompileAwareBarrier, VirtualGroup

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tier")


class Events:
    """Per rank, in order: ("prepare", kernel name, inside a plan build) and ("wait", op)."""

    def __init__(self, monkeypatch):
        self.by_rank: dict[str, list] = {}
        self.lock = threading.Lock()
        real_wait = VirtualGroup.waiting_launch

        def prepare(kernel):
            self._add(("prepare", kernel.name, getattr(compiler._local, "batch", None) is not None))

        def waiting_launch(group, op="?", epoch=-1):
            self._add(("wait", op))
            return real_wait(group, op, epoch)

        monkeypatch.setattr(compiler, "prepare", prepare)
        monkeypatch.setattr(VirtualGroup, "waiting_launch", waiting_launch)

    def _add(self, event):
        with self.lock:
            self.by_rank.setdefault(threading.current_thread().name, []).append(event)

    def prepared(self) -> set:
        return {e[1] for seq in self.by_rank.values() for e in seq if e[0] == "prepare"}


def _all_reduce(group, algorithm, n=64):
    x = torch.full((n,), float(group.rank + 1))
    return ditron_ops.all_reduce(x, group, algorithm=algorithm)[0].item()


def test_first_all_reduce_prepares_only_its_kernel_before_any_waiting_launch(monkeypatch):
    events = Events(monkeypatch)
    assert ditron_ops.launch(_all_reduce, 2, args=("two_shot",)) == [3.0, 3.0]
    assert events.prepared() == {"push_combine_kernel"}
    for seq in events.by_rank.values():
        # both plans of the two-shot call (reduce-scatter, then gather) before its first launch
        assert seq == [("prepare", "push_combine_kernel", True)] * 2 + [("wait", "all_reduce")] * 2, seq


def _ag_gemm(group):
    a = torch.ones(3, 8, dtype=torch.float32)
    b = torch.ones(8, 16, dtype=torch.float32)
    return ditron_ops.ag_gemm(a, b, group, impl="fused")[0, 0].item()


def test_first_ag_gemm_prepares_only_ag_gemm_kernels(monkeypatch):
    events = Events(monkeypatch)
    assert ditron_ops.launch(_ag_gemm, 2) == [8.0, 8.0]
    # small gathers take the one-launch push path: its kernel is all the call compiles
    assert events.prepared() == {"ag_gemm_push_kernel"}
    for seq in events.by_rank.values():
        first_wait = seq.index(("wait", "ag_gemm"))
        assert all(e[0] == "prepare" and e[2] for e in seq[:first_wait]), seq
        assert all(e[0] == "wait" for e in seq[first_wait:]), seq


def test_launch_compiles_nothing_up_front(monkeypatch):
    events = Events(monkeypatch)

    def refuse(device, dtypes):
        raise AssertionError("launch ran a precompile family")

    for name, (_, ops) in list(precompile_module._registry.items()):
        monkeypatch.setitem(precompile_module._registry, name, (refuse, ops))
    assert ditron_ops.launch(lambda g: g.rank, 3) == [0, 1, 2]
    assert events.prepared() == set()


def _barriers_per_call(group):
    seen, real = [0], group.barrier

    def counting():
        seen[0] += 1
        real()

    group.barrier = counting  # this rank's host barriers (exchanges and meetings)
    counts = []
    for n in (64, 32, 32, 32):  # (the first call also allocates the workspace: collective)
        before = seen[0]
        _all_reduce(group, "one_shot", n)
        counts.append(seen[0] - before)
    return counts, "waiting_launch" in group.__dict__


def test_new_signature_meets_once_and_a_repeated_call_meets_nothing():
    # CPU worlds have no launch gate, so a new signature (n = 32) arms one meeting before the
    # next waiting launch: the agreement's two barriers plus that one, then nothing per call
    for counts, armed in ditron_ops.launch(_barriers_per_call, 2):
        assert counts[1:] == [3, 0, 0] and not armed, counts


def test_barrier_waits_for_a_compiling_peer_and_still_times_out_without_one():
    barrier = CompileAwareBarrier(2)
    errors = []

    def compiling_peer():
        with compiler.activity("fake build"):
            time.sleep(1.2)  # longer than the waiter's timeout
        barrier.wait(0.3)

    peer = threading.Thread(target=compiling_peer)
    peer.start()
    time.sleep(0.05)
    try:
        barrier.wait(0.3)
    except threading.BrokenBarrierError as err:
        errors.append(err)
    peer.join()
    assert errors == []
    start = time.monotonic()
    with pytest.raises(threading.BrokenBarrierError):
        CompileAwareBarrier(2).wait(0.3)  # nobody compiles, nobody comes
    assert 0.25 < time.monotonic() - start < 2.0


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_after_two_seconds_only():
    clock, out = FakeClock(), io.StringIO()
    p = compiler.Progress(stream=out, clock=clock, after_s=2.0)
    p.add("all_reduce", 3)
    clock.now = 1.0
    p.tick()
    assert out.getvalue() == ""
    p.finish(1)
    clock.now = 2.5
    p.tick()
    p.tick()  # not a terminal: one line, not one per tick
    assert out.getvalue() == "ditron: compiling kernels for all_reduce: 1/3 done (2 s; first use, cached afterwards)\n"
    p.finish(2)
    clock.now = 7.25
    p.close()
    assert out.getvalue().splitlines()[-1] == "ditron: compiled 3 kernel(s) for all_reduce in 7.2 s"
    fast = io.StringIO()
    q = compiler.Progress(stream=fast, clock=clock, after_s=2.0)
    q.add("ag_gemm", 2)
    clock.now += 1.9
    q.tick()
    q.finish(2)
    q.close()
    assert fast.getvalue() == ""  # warm (or quick): silent


def test_progress_redraws_in_place_on_a_terminal():
    clock, out = FakeClock(), Tty()
    p = compiler.Progress(stream=out, clock=clock, after_s=0.0)
    p.add("flash_decode", 2)
    p.tick()
    p.finish(1)
    p.tick()
    p.finish(1)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "1/2 done" in text and "compiled 2 kernel(s) for flash_decode" in text


def test_a_slow_build_on_the_pool_draws_the_line_and_a_fast_one_does_not(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(compiler, "progress", compiler.Progress(stream=out, after_s=0.2))
    fast = compiler.submit(("test", "fast", time.time()), lambda: 1, "quick op")
    compiler.wait([fast])
    assert fast.result() == 1 and out.getvalue() == ""
    slow = compiler.submit(("test", "slow", time.time()), lambda: time.sleep(0.8) or 2, "slow op")
    again = compiler.submit(("test", "slow", None), lambda: 3, "slow op")  # another key
    compiler.wait([slow, again])
    for _ in range(50):  # the pool's done callback closes the line
        if "compiled" in out.getvalue():
            break
        time.sleep(0.02)
    lines = out.getvalue().splitlines()
    assert slow.result() == 2 and len(lines) == 2, lines
    assert lines[0].startswith("ditron: compiling kernels for slow op: ") and "2/2" not in lines[0]
    assert lines[1].startswith("ditron: compiled 2 kernel(s) for slow op in ")
    key = ("test", "shared", time.time())
    first = compiler.submit(key, lambda: time.sleep(0.1) or "once", "shared op")
    assert compiler.submit(key, lambda: "twice", "shared op") is first  # ranks share a compile
    compiler.wait([first])


def test_precompile_on_cpu_has_nothing_to_compile(capsys):
    assert main(["precompile"]) == 0
    assert "nothing to compile" in capsys.readouterr().out
    assert main(["precompile", "--ops", "all_reduce", "ag_gemm", "--dtypes", "fp16"]) == 0
    assert "families: collectives, ag_gemm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["precompile", "--ops", "no_such_op"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        ditron_ops.precompile(ops=["no_such_op"])
    got = ditron_ops.precompile()
    assert got["kernels"] == 0 and got["device"] is None


def test_precompile_families_cover_every_op_and_bind_to_their_kernels(monkeypatch):
    """Each family's list of variants, made on the CPU: every ``BoundKernel`` binds to its
    kernel's signature (the GPU compiles exactly these)."""
    served = {op for ops in precompile_module.families().values() for op in ops}
    assert served >= {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ag_gemm",
                      "gemm_rs", "gemm_ar", "flash_decode", "ulysses_attention", "moe_dispatch",
                      "moe_combine", "ag_gemm_scaled", "gemm_rs_scaled", "gemm_ar_scaled"}
    made: dict[str, int] = {}
    options = {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"}

    def bind(kernel):
        params = inspect.signature(kernel.fn.fn).parameters
        kwargs = {k: v for k, v in kernel.kwargs.items() if k not in options}
        bound = inspect.signature(kernel.fn.fn).bind_partial(*kernel.args, **kwargs)
        missing = [n for n, p in params.items() if n not in bound.arguments
                   and p.default is inspect.Parameter.empty]
        assert not missing, (kernel.name, missing)
        made[kernel.name] = made.get(kernel.name, 0) + 1

    monkeypatch.setattr(compiler, "prepare", bind)
    for fn, _ in precompile_module._registry.values():
        fn(torch.device("cpu"), tuple(precompile_module.DTYPE_NAMES.values()))
    from ditron_ops.gemm._core_configs import rule_configs

    configs = len(rule_configs(torch.device("cpu")))  # every tile configuration the rule can pick
    # per configuration: 20 fp16/bf16 variants, and 8 fp8 ones per output dtype and scale mode
    assert made["push_combine_kernel"] == 18 and made["persistent_gemm_kernel"] == 52 * configs
    assert {"gemm_rs_kernel", "split_kv_kernel", "ulysses_attention_kernel", "all_to_all_kernel",
            "dispatch_kernel", "combine_kernel", "start_barrier_kernel"} <= set(made)


def _variant(kernel) -> tuple:
    """What a compiled variant is keyed by, as far as the arguments a plan passes can change
    it: the kernel, its constexprs and launch options, every tensor's dtype and 16-byte
    alignment, every descriptor's dtype and block (integers that change from call to call are
    ``do_not_specialize``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def arg(v):
        if isinstance(v, torch.Tensor):
            return (v.dtype, v.data_ptr() % 16 == 0)
        if isinstance(v, TensorDescriptor):
            return ("desc", v.base.dtype, tuple(v.block_shape))
        return None
    kwargs = {k: v for k, v in kernel.kwargs.items() if k != "COPY_BLOCK"}  # (interpreter's own)
    return (kernel.name, tuple(sorted(kwargs.items())), tuple(map(arg, kernel.args)))


def test_precompile_covers_every_variant_the_fp8_ops_launch(monkeypatch):
    """Every variant the fp8 ops' plans make (each scale mode and output dtype; fused with each
    producer, baseline, deterministic, both all-reduce algorithms, with and without bias) is
    among those ``precompile`` makes for fp8 (the GPU then compiles exactly these). Values are
    the fp8 tests' business (the interpreter rounds bf16 wrongly)."""
    from ditron_ops.gemm import _ag_launch
    from ditron_ops.testing.scaled_checks import reduce_inputs, scaled_inputs

    launched: set = set()
    monkeypatch.setattr(compiler, "prepare", lambda k: launched.add(_variant(k)))

    def body(group):
        r = group.rank
        for mode, out_dtype in (("tensor", torch.bfloat16), ("row", torch.float16),
                                ("block", torch.bfloat16)):
            bias = torch.ones(24, dtype=out_dtype)
            a, sa, b, sb = scaled_inputs([3, 5], 144, 24, mode, group.device)
            for impl, with_bias in (("fused", True), ("baseline", False)):
                ditron_ops.ag_gemm_scaled(a[r], b, sa[r], sb, group, out_dtype=out_dtype,
                                          impl=impl, shard_sizes=[3, 5],
                                          bias=bias if with_bias else None)
            a, sa, b, sb = reduce_inputs(6, [136, 128], 24, mode, group.device)[r]
            for op, kw in ((ditron_ops.gemm_rs_scaled, {}),
                           (ditron_ops.gemm_ar_scaled, dict(algorithm="one_shot")),
                           (ditron_ops.gemm_ar_scaled, dict(algorithm="two_shot"))):
                for impl, det, with_bias in (("fused", False, True), ("fused", True, False),
                                             ("baseline", True, True)):
                    op(a, b, sa, sb, group, out_dtype=out_dtype, impl=impl, deterministic=det,
                       bias=bias if with_bias else None, **kw)
        return True
    for producer in ("push", "copy", "pull"):
        monkeypatch.setattr(_ag_launch, "PRODUCER", producer)
        assert ditron_ops.launch(body, 2) == [True, True]
    made: set = set()
    monkeypatch.setattr(compiler, "prepare", lambda k: made.add(_variant(k)))
    for fn, _ in precompile_module._registry.values():
        fn(torch.device("cpu"), (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32))
    missing = launched - made
    assert not missing, sorted(map(str, missing))[:3]
    assert {k[0] for k in launched} >= {"persistent_gemm_kernel", "ag_gemm_push_kernel",
                                         "ag_pull_kernel", "gemm_rs_kernel", "gemm_broadcast_kernel"}
