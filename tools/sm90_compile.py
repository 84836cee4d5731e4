"""Compile ditron kernels for sm_90a on a machine without a GPU (ptxas ships with triton).

Reports registers, spills and shared memory per kernel variant, so kernel edits can be checked
before a GPU session; ``moe`` also counts SASS instructions (barriers, calls, local memory) and
says which kernels fit on one SM beside a dispatch program::

    PYTHONPATH=. python tools/sm90_compile.py [ulysses] [all_to_all] [flash_decode] [gemm] [moe] [ws]
    PYTHONPATH=. python tools/sm90_compile.py splitk   # gemm's split-K variants only

How: the kernels are imported as compiled-mode ``triton.jit`` functions (``ditron_ops`` imported
while ``torch.cuda.is_available`` answers True) and ``JITFunction.warmup`` runs against a
stand-in driver whose target is ``cuda:90``; warm-up compiles without launching. Arguments are
CPU tensors: only their dtype and 16-byte alignment reach the compiler.
"""
from __future__ import annotations

import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compiled_mode():
    import torch

    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        from ditron_ops import _env
    finally:
        torch.cuda.is_available = available
    # kernel modules (``language`` included) are imported on first use, each asking then:
    # compiled mode for all of them
    _env.use_interpreter = lambda: False
    if "ditron_ops.language._jit" in sys.modules:
        sys.modules["ditron_ops.language._jit"].use_interpreter = _env.use_interpreter
    from ditron_ops.runtime.launcher import BoundKernel
    from ditron_ops.testing.sm90 import use_sm90_stand_in_driver

    use_sm90_stand_in_driver()
    BoundKernel._forget_examples = lambda self: None  # compiled below from the bound arguments


def _ptxas(kernel, cubin=None) -> str:
    """ptxas's verbose output for the kernel's PTX on sm_90a (``cubin``: keep the binary there)."""
    import os
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(kernel.asm["ptx"])
    try:
        return subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", fh.name, "-o", cubin or os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(fh.name)


def resources(kernel) -> dict:
    """Registers, spill bytes, shared memory, warps and SASS counts (instructions, ``BAR``,
    ``CALL``: IEEE divisions and the like, ``LDL``/``STL``: local memory) of a kernel."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        got = _ptxas(kernel, cubin)
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(
        re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]
        for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
    regs = re.findall(r"Used (\d+) registers", got)
    spills = re.findall(r"(\d+) bytes spill stores", got)
    md = kernel.metadata
    return dict(regs=int(regs[-1]) if regs else 0, spills=int(spills[-1]) if spills else 0,
                shared=md.shared, warps=md.num_warps, instr=sum(ops.values()), bar=ops["BAR"],
                call=ops["CALL"], local=ops["LDL"] + ops["STL"])


def sm_footprint(res: dict) -> tuple:
    """What one program takes of an sm_90 SM: (registers, threads, shared bytes); registers
    are allocated per warp in units of 256, shared memory with 1 KB reserved per program."""
    regs = -(-res["regs"] * 32 // 256) * 256 * res["warps"]
    return regs, 32 * res["warps"], res["shared"] + 1024


def fits_beside(*programs: dict) -> bool:
    """Whether these programs (``resources`` dicts) can be resident on one H100/H200 SM at
    once: 64K registers, 2048 threads, 228 KB shared memory."""
    use = [sm_footprint(p) for p in programs]
    return (sum(u[0] for u in use) <= 65536 and sum(u[1] for u in use) <= 2048
            and sum(u[2] for u in use) <= 228 * 1024)


def report(name, kernel) -> str:
    """One line: ptxas's resource usage of the kernel's PTX for sm_90a, shared memory."""
    import re

    got = _ptxas(kernel)
    regs = re.findall(r"Used (\d+) registers", got)
    spills = re.findall(r"(\d+) bytes spill stores", got)
    md = kernel.metadata
    serialized = ", wgmma SERIALIZED" if "serialized" in got else ""
    return (f"{name}: regs {regs[-1] if regs else '?'}{serialized}, spill stores "
            f"{spills[-1] if spills else '?'} B, shared {md.shared} B, warps {md.num_warps}, "
            f"stages {md.num_stages}"
            + (f", global scratch {md.global_scratch_size} B"
               if getattr(md, "global_scratch_size", 0) else ""))


def ulysses() -> list[str]:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ditron_ops.attention import ulysses as api
    from ditron_ops.attention._ulysses_kernels import ulysses_attention_kernel

    lines = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in api.HEAD_DIMS:
            for name, cfg in api.GPU_CONFIGS.items():
                buf = torch.zeros(1 << 16, dtype=dtype)
                rows = buf.numel() // d
                qd = TensorDescriptor(buf, [rows, d], [d, 1], [cfg.block_m, d])
                kd = TensorDescriptor(buf, [rows, d], [d, 1], [cfg.block_n, d])
                x = torch.zeros(64, dtype=dtype)
                i64 = torch.zeros(16, dtype=torch.int64)
                args, kwargs = api.kernel_args(x, x, x, qd, kd, buf, i64, x, i64, i64, i64, i64,
                                               dims=(1, 8, 4, 2, 4, 2, 0, 1), strides=(8,) * 12,
                                               offsets=(0, 0, 0, 0, 0), causal=1, scale=0.1,
                                               merge_runs=1, pack=1, fingerprint=1,
                                               timeout_us=1000, op_id=0, d=d, cfg=cfg,
                                               push_rows=api.PUSH_ROWS["cuda"])
                t0 = time.time()
                k = ulysses_attention_kernel.warmup(*args, grid=(1,), **kwargs)
                lines.append(report(f"ulysses {dtype} D={d} {name}", k)
                             + f" ({time.time() - t0:.1f} s)")
                print(lines[-1], flush=True)
    return lines


def all_to_all() -> list[str]:
    import importlib

    import torch

    from ditron_ops.collectives._all_to_all_kernels import all_to_all_kernel

    api = importlib.import_module("ditron_ops.collectives.all_to_all")  # the package exports the fn

    lines = []
    i64 = torch.zeros(16, dtype=torch.int64)
    view = api._canonical([8, 4, 64], 2, (0, 2))
    for dtype in api.DTYPES:
        for vec in (16 // torch.empty((), dtype=dtype).element_size(), 1):
            x = torch.zeros(4096, dtype=dtype)
            k = all_to_all_kernel.warmup(x, x, x, i64, i64, i64, i64, i64, 0, 2,
                                         *api._view_args(view), 2048, 4096, 1, 1000, 0,
                                         BLOCK_R=api._GPU_BLOCKS[0], BLOCK_C=api._GPU_BLOCKS[1],
                                         VEC=vec, num_warps=4, grid=(1,))
            lines.append(report(f"all_to_all {dtype} VEC={vec}", k))
            print(lines[-1], flush=True)
    return lines


def flash_decode() -> list[str]:
    """Every kernel of a flash_decode call (split-KV per config and FLUSH / DIRECT, the combine
    both ways, the start barrier and the merge), plus the collectives' push/combine kernel."""
    import torch

    from ditron_ops.attention import flash_decode as api
    from ditron_ops.attention._flash_decode_kernels import (chunk_combine_kernel,
                                                            decode_merge_kernel, split_kv_kernel)
    from ditron_ops.collectives._kernels import push_combine_kernel
    from ditron_ops.language.barrier import start_barrier_kernel

    lines = []
    i64 = torch.zeros(16, dtype=torch.int64)
    f32 = torch.zeros(4096, dtype=torch.float32)
    i32 = torch.zeros(16, dtype=torch.int32)
    errors = (i64, i64, 0)

    def add(name, k):
        lines.append(report(name, k))
        print(lines[-1], flush=True)

    for dtype in api.GPU_DTYPES:
        x = torch.zeros(4096, dtype=dtype)
        q, kv = x.view(1, 4, 1024)[:, :, :128], x.view(1, 8, 4, 128)
        for cname, cfg in (("split", api.SPLIT_CONFIG), ("wide", api.WIDE_SPLIT_CONFIG)):
            for plan, direct in (((64, 64, 1, 1), False), ((64, 128, 2, 1), False),
                                 ((64, 64, 1, 1), True)):
                args, kwargs, grid = api._split_kv_args(q, kv, kv, i32, f32, f32, 0.1, plan, cfg,
                                                        direct, errors)
                add(f"split_kv {dtype} {cname} FLUSH={plan[1] != plan[0]} DIRECT={direct}",
                    split_kv_kernel.warmup(*args, grid=grid, **kwargs))
            for page in (16, 256):  # paged: per-key entries, or one entry a block
                pages = torch.zeros(64 * page * 512, dtype=dtype).view(64, page, 4, 128)
                table = torch.zeros(1, 64, dtype=torch.int32)
                args, kwargs, grid = api._split_kv_args(q, pages, pages, i32, f32, f32, 0.1,
                                                        (64, 128, 2, 1), cfg, False, errors,
                                                        table)
                add(f"split_kv {dtype} {cname} paged PAGE={page} stages={kwargs['num_stages']}",
                    split_kv_kernel.warmup(*args, grid=grid, **kwargs))
        for final in (True, False):
            add(f"chunk_combine {dtype} FINAL={final}", chunk_combine_kernel.warmup(
                f32, f32, i32, x, f32, i64, 1, 1, 64, 2, 0, 2, 1000, D=128, FINAL=final, grid=(1,),
                **api.COMBINE_CONFIG))
        add(f"decode_merge {dtype}", decode_merge_kernel.warmup(
            x, f32, i64, i64, i64, i64, 1, 0, 2, 1000, 0, D=128, BLOCK_P=api.MERGE_BLOCK_P,
            num_warps=4, grid=(1,)))
        add(f"push_combine {dtype} reduce", push_combine_kernel.warmup(
            x, x, x, i64, i64, i64, i64, i64, 0, 2, 64, 8, 512, 2048, 1024, 1000, 0,
            SPLIT_SRC=True, REDUCE=True, BLOCK=2048, VEC=8, num_warps=4, grid=(1,)))
    add("start_barrier", start_barrier_kernel.warmup(i64, i64, i64, i64, 0, 2, 0, 1000, 0,
                                                     grid=(1,)))
    return lines


SHARED_LIMIT = 232448
"""The H200's shared memory per block (opt-in), bytes: a variant above it cannot launch."""


def gemm(dtypes=("bf16",), only=None) -> list[str]:
    """Every GEMM-core variant of every tile configuration the rule can pick
    (``_core_configs.rule_configs`` on the GPU): the ``ag_gemm`` and ``gemm_rs`` families'
    precompile lists (persistent GEMM with and without waits, fp32 products with the stages
    ``fit_stages`` leaves on the H200, the one-launch push call, the reduce-scatter, broadcast
    and finish kernels), plus the TMA-store variants of the persistent kernels, fp32 products
    included (the precompile lists made on a CPU have none); and ``matmul``'s split-K family
    (``_core_precompile._precompile``: the split GEMM per configuration, dtype and B layout, with its fp32
    TMA store of the partials added here, and the reduce into each dtype and fp32). A line ends
    in ``OVER`` when its shared memory exceeds the H200's ``SHARED_LIMIT``."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ditron_ops.gemm import _ag_launch, _core, _core_configs, _core_precompile, _rs_launch
    from ditron_ops.runtime import compiler
    from ditron_ops.runtime.precompile import DTYPE_NAMES

    cpu = torch.device("cpu")
    _core_configs.INTERPRETER_CANDIDATES = _core_configs.GPU_CANDIDATES  # the GPU's list on a CPU
    fit = _core.fit_stages
    _core._shared_memory_limit = lambda index: SHARED_LIMIT
    _core.fit_stages = lambda cfg, device, i, o: fit(cfg, torch.device("cuda", 0), i, o)
    made = []
    compiler.prepare = made.append  # every BoundKernel the lists make, not compiled
    wanted = tuple(DTYPE_NAMES[d] for d in dtypes)
    _ag_launch._precompile(cpu, wanted)
    _rs_launch._precompile(cpu, wanted)
    _core_precompile._precompile(cpu, wanted)
    _core_precompile.precompile_plain_only(cpu, wanted)  # (GPU only in _precompile)
    for k in list(made):  # the split GEMM's TMA store of its fp32 partials (P_TMA), as on a GPU
        if k.name == "splitk_gemm_kernel" and not k.kwargs["P_TMA"]:
            parts, args = k.args[3], list(k.args)
            args[2] = TensorDescriptor(parts, list(parts.shape), [parts.shape[1], 1],
                                       [k.kwargs["BLOCK_M"], k.kwargs["BLOCK_N"] // 2])
            made.remove(k)
            made.append(type("K", (), dict(fn=k.fn, args=args, grid=k.grid, name=k.name,
                                           kwargs=dict(k.kwargs, P_TMA=True)))())
    for k in list(made):  # the persistent kernels' TMA store (C_TMA) variants
        if k.name in ("persistent_gemm_kernel", "ag_gemm_push_kernel") and not k.kwargs["C_TMA"]:
            out = torch.empty(64, 64, dtype=k.args[4].dtype)
            half = [k.kwargs["BLOCK_M"], k.kwargs["BLOCK_N"] // 2]
            args = list(k.args)
            args[3], args[4] = TensorDescriptor(out, [64, 64], [64, 1], half), out
            made.append(type("K", (), dict(fn=k.fn, args=args, grid=k.grid, name=k.name,
                                           kwargs=dict(k.kwargs, C_TMA=True)))())
    lines, seen = [], set()
    for k in made:
        if only is not None and k.name not in only:
            continue
        kw = {n: v for n, v in sorted(k.kwargs.items())}
        dts = tuple(str(a.dtype) for a in k.args if isinstance(a, torch.Tensor))
        key = (k.name, tuple(kw.items()), dts)
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        compiled = k.fn.warmup(*k.args, grid=k.grid, **k.kwargs)
        tiles = (f"{kw.get('BLOCK_M')}x{kw.get('BLOCK_N')}x{kw.get('BLOCK_K')}"
                 if "BLOCK_M" in kw else "")
        flags = " ".join(f"{n}={int(v)}" for n, v in kw.items()
                         if n in ("B_KN", "C_TMA", "WAIT", "ALIGNED", "SPLIT_TAIL", "P_TMA"))
        line = report(f"{k.name} {tiles} {flags} {dts[0] if dts else ''}", compiled)
        over = compiled.metadata.shared > SHARED_LIMIT
        lines.append(line + f" ({time.time() - t0:.1f} s)" + (" OVER" if over else ""))
        print(lines[-1], flush=True)
    over = [ln for ln in lines if ln.endswith("OVER")]
    print(f"gemm: {len(lines)} variants, {len(over)} over {SHARED_LIMIT} B of shared memory",
          flush=True)
    return lines


def splitk() -> list[str]:
    """Only ``gemm``'s split-K variants (``splitk_gemm_kernel``, ``splitk_reduce_kernel``)."""
    return gemm(only=("splitk_gemm_kernel", "splitk_reduce_kernel"))


def moe() -> list[str]:
    """The MoE kernels with the GPU tile rules (``moe._launch``) for DeepSeek-V3's layer (hidden
    7168, top-8 of 256 experts; W = 8, 16 tokens a rank: the tiles do not depend on the token
    count past 4) and a small one: every layout kernel, the dispatch (bf16 and fp8, fresh and
    cached; fp8 also in each other quantization variant, ``split`` with its quantize kernel),
    the combine (in place and staged, its own dtype and the fp32 weight-gradient
    rows). Checks what the kernels promise the references: no FMA in the combine, IEEE
    divisions in the fp8 quantization.

    Per variant: registers, spills, shared memory, SASS instructions, barriers, calls and
    local-memory accesses. ``det`` and the default mode launch the same dispatch binary
    (``det`` is a runtime argument): they differ in their layout kernels only. A virtual
    world's ranks share one GPU's SMs (W x programs dispatch programs on 132 SMs), so the
    table at the end says which layout (and quantize) kernels can run on an SM beside a
    dispatch program (a kernel that cannot waits for SMs without one)."""
    from types import SimpleNamespace

    import torch

    from ditron_ops.moe import _launch as L

    L._gpu = lambda device: True  # GPU tile rules and programs for the CPU stand-in tensors
    lines = []
    seen = {}

    def add(name, bound):
        k = bound.fn.warmup(*bound.args, grid=bound.grid, **bound.kwargs)
        ptx = k.asm["ptx"]
        if bound.fn is L.combine_kernel:
            assert "fma" not in ptx, "the combine must not fuse products into sums"
        if (bound.fn is L.dispatch_kernel and bound.kwargs.get("FP8")) or bound.fn is L.quantize_kernel:
            assert "div.full" not in ptx and "div.approx" not in ptx, "fp8 scales need IEEE divisions"
        tiles = {n: v for n, v in bound.kwargs.items() if n.startswith(("BLOCK", "KC", "UNITS", "JB", "EB"))}
        res = resources(k)
        seen[name] = res
        lines.append(f"{name}: regs {res['regs']}, spill stores {res['spills']} B, shared "
                     f"{res['shared']} B, warps {res['warps']}, SASS {res['instr']} (BAR {res['bar']}, "
                     f"CALL {res['call']}, LDL/STL {res['local']}) {tiles}")
        print(lines[-1], flush=True)

    for (world, experts, tokens, hidden, topk), dtype in (
            ((8, 256, 16, 7168, 8), torch.bfloat16), ((2, 8, 16, 2048, 2), torch.float16)):
        for fp8 in (False, True):
            reg = L.Regions(world, experts, tokens, topk, hidden, dtype, fp8, world * tokens * topk)
            local = torch.zeros(reg.nbytes, dtype=torch.uint8)
            _, _, claim, record = L.one_rank_pad(torch.device("cpu"))
            group = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=world,
                                    timeout_us=lambda: 10**7, _error_tensors=lambda: (record, claim),
                                    sm_share=lambda: 132)  # an H200's SMs
            buf = SimpleNamespace(group=group, regions=reg, programs=L.MAX_PROGRAMS, views=reg.views(local),
                                  sym=SimpleNamespace(local=local, ptr_table=L.pointer_table(local)),
                                  claim=claim, record=record)
            buf.scratch = L.Scratch(reg, buf.programs, group.device)
            name = f"{str(dtype)[6:]} H={hidden} k={topk}"
            for det, cached in ((True, False), (False, False), (False, True)):
                plan = L.DispatchPlan(buf, x_dtype=dtype, idx_dtype=None if cached else torch.int64,
                                      fp8=fp8, round_scale=False, det=det, has_w=True, cached=cached,
                                      padded=False, alignment=1, rows=reg.capacity, variant="div")
                if not fp8 and not cached:
                    for bound in plan.layout:
                        add(f"moe {bound.name} {name}", bound)
                add(f"moe dispatch {name} fp8={fp8} det={det} cached={cached}", plan.kernel)
            for variant in (v for v in L.FP8_VARIANTS if fp8 and v != "div"):
                plan = L.DispatchPlan(buf, x_dtype=dtype, idx_dtype=torch.int64, fp8=fp8, round_scale=False,
                                      det=False, has_w=True, cached=False, padded=False, alignment=1,
                                      rows=reg.capacity, variant=variant)
                add(f"moe dispatch {name} fp8={fp8} det=False cached=False variant={variant}", plan.kernel)
                if plan.stage is not None:
                    add(f"moe quantize_kernel {name} variant={variant}", plan.stage)
            if not fp8:
                for (y_dtype, width), in_place in itertools.product(
                        ((dtype, hidden), (torch.float32, 8)), (True, False)):
                    plan = L.CombinePlan(buf, dtype=y_dtype, hidden=width, has_w=True, in_place=in_place)
                    add(f"moe combine {name} y={str(y_dtype)[6:]}x{width} in_place={in_place}",
                        plan.kernel)
    name = "bfloat16 H=7168 k=8"
    layouts = [n for n in seen if n.startswith("moe layout") and n.endswith(name)]
    quantize = [n for n in seen if n.startswith("moe quantize_kernel") and name in n]
    for fp8, variant in ((False, ""), (True, ""), (True, " variant=rcp"), (True, " variant=split")):
        d = seen[f"moe dispatch {name} fp8={fp8} det=False cached=False{variant}"]
        regs, _, _ = sm_footprint(d)
        fits = ", ".join(f"{n.split()[1]} {'yes' if fits_beside(d, seen[n]) else 'NO'}"
                         f" ({sm_footprint(seen[n])[0]} regs)" for n in layouts + (quantize if "split" in variant else []))
        scan = [seen[n] for n in layouts if "scan" in n]
        chunk = [seen[n] for n in layouts if "chunk" in n]
        both = fits_beside(d, *chunk, *scan) if chunk and scan else None
        lines.append(f"beside one {name} fp8={fp8}{variant} dispatch program ({regs} of 65536 registers): "
                     f"{fits}; chunk + scan together: {'yes' if both else 'NO'}")
        print(lines[-1], flush=True)
    return lines


def ws(dtypes=("bf16", "fp16")) -> list[str]:
    """Every form ``precompile`` binds of the warp-specialized core (``_ws_launch.precompile_ws``:
    the rule's forms per B layout and bias, the reduce at each split, the ag_gemm consumer's
    waiting forms and the gemm_reduce producer's pushing ones), compiled for sm_90a; a line ends
    in ``SPILL`` where ptxas spills and ``OVER`` where shared memory exceeds the H200's."""
    import torch

    from ditron_ops.gemm import _ws_launch
    from ditron_ops.runtime import compiler
    from ditron_ops.runtime.precompile import DTYPE_NAMES

    cpu, wanted = torch.device("cpu"), tuple(DTYPE_NAMES[d] for d in dtypes)
    made = []
    compiler.prepare = made.append  # every BoundKernel the lists make, not compiled
    _ws_launch.precompile_ws(cpu, wanted)
    sig, offsets = torch.zeros(16, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)
    _ws_launch.precompile_ws(cpu, wanted, wait=(sig, offsets, sig[:1], sig, 0, 1, 10**6, 0))
    slots = torch.zeros(1 << 16, dtype=torch.float32)
    for broadcast in (False, True):
        _ws_launch.precompile_ws(cpu, wanted, push=(slots, sig, offsets, 64, 0, 1, broadcast))
    return _compile_bound(made, "ws")


def ws_scaled(only_push: bool = False) -> list[str]:
    """Every form ``precompile`` binds of the WS core's fp8 form (``_ws_scaled.
    precompile_scaled_ws``: config, scale mode, C dtype, bias; the waiting ag_gemm consumer's
    and the pushing gemm_rs / gemm_ar producer's too), compiled for sm_90a; ``only_push``
    (``ws_scaled_push``): the pushing forms alone."""
    import torch

    from ditron_ops.gemm import _ws_scaled
    from ditron_ops.runtime import compiler

    made = []
    compiler.prepare = made.append
    _ws_scaled.precompile_scaled_ws(torch.device("cpu"), (torch.bfloat16, torch.float16),
                                    wait=True, push=True)
    if only_push:
        made = [k for k in made if k.kwargs.get("PUSH")]
    return _compile_bound(made, "ws_scaled")


def _compile_bound(made, what: str) -> list[str]:
    """Compile each distinct ``BoundKernel`` of ``made`` (the WS core's lists); a line each,
    ending in ``SPILL`` where ptxas spills and ``OVER`` past the H200's shared memory."""
    import re

    import torch
    lines, seen = [], set()
    for k in made:
        kw = dict(sorted(k.kwargs.items()))
        dts = tuple(str(a.dtype) for a in k.args if isinstance(a, torch.Tensor))
        key = (k.name, tuple(kw.items()), dts,
               tuple(str(getattr(a, "layout", "")) for a in k.args))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.time()
        compiled = k.fn.warmup(*k.args, grid=k.grid, **k.kwargs)
        flags = " ".join(f"{n}={int(v)}" for n, v in kw.items()
                         if n in ("MODE", "STAGES", "PINGPONG", "N2", "B_KN", "HAS_BIAS", "WAIT",
                                  "PUSH", "SPLIT", "HALVES", "EPI_BUFS", "PROMOTE", "SCALE"))
        line = report(f"{k.name} {flags} {dts[0] if dts else ''}", compiled)
        spill = not re.search(r"spill stores 0 B", line)
        over = compiled.metadata.shared > SHARED_LIMIT
        lines.append(line + f" ({time.time() - t0:.1f} s)" + (" SPILL" if spill else "")
                     + (" OVER" if over else ""))
        print(lines[-1], flush=True)
    bad = [ln for ln in lines if ln.endswith(("SPILL", "OVER")) or "SERIALIZED" in ln]
    print(f"{what}: {len(lines)} variants, {len(bad)} spilling, over {SHARED_LIMIT} B or with "
          "wgmma serialized", flush=True)
    return lines

if __name__ == "__main__":
    _compiled_mode()
    kinds = {"ulysses": ulysses, "all_to_all": all_to_all, "flash_decode": flash_decode,
             "gemm": gemm, "splitk": splitk, "moe": moe, "ws": ws,
             "ws_scaled": ws_scaled, "ws_scaled_push": lambda: ws_scaled(only_push=True)}
    for what in sys.argv[1:] or [k for k in kinds if k not in ("splitk", "ws_scaled_push")]:
        kinds[what]()
