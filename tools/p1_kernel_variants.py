"""P1 shapes on the GPU: our GEMM core vs a plain tutorial-style persistent TMA kernel of the same
tiles (no bias, specialised sizes), with and without ``tl.range(flatten=True)``, and flattened
with the consumer's chunk waits one tile ahead (flags pre-set): ``flat_wait`` through the
library's ``_wait_rows`` (a Triton spin loop), ``flat_asmwait`` through one inline-asm spin block
per tile, ``flat_asmonce`` the same but only until the program has seen the chunk; all vs cuBLAS,
timed in turns (``paired_graph_times``). Compiled for sm_90a on CPU (triton 3.6): the Triton spin
loop inside the flattened loop stops the pipeliner (82 KB shared memory, 2 TMA load sites instead
of 180 KB and 6: no multi-stage prefetch; likely the cause of the 0.45x that ``GPU_CONFIGS``'
note records for a flattened consumer); the asm spin keeps it (180 KB, 6), with or without the
once-only guard. One device call: ``PYTHONPATH=. python tools/p1_kernel_variants.py [--quick]``
(about 2 minutes with compiles; ``--quick``: fewer variants). H200, 2026-12-01, geo-mean over the
six shapes, two runs: ours 0.958 / 0.954, plain 0.972, flattened 3 stages 0.982 / 0.976,
4 stages 0.962, flattened with the asm wait per tile 0.958 (it loses most of the flattening
gain: one acquire load, a proxy fence and a CTA barrier per tile). ``flat_asmonce`` is not
measured yet.
"""
import sys
import torch, triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
from ditron_ops import language as dl
from ditron_ops.ag_gemm import matmul
from ditron_ops.ag_gemm._kernels import _wait_rows
from ditron_ops.runtime.warmup import one_rank_pad
from ditron_ops.bench.ag_gemm import _local_shapes, _inputs
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.runtime.virtual import launch


QUICK = "--quick" in sys.argv  # ours, plain, flattened, flattened with waits (fewer compiles)


@triton.jit
def _wait_rows_asm(sig_ptr, epoch, deadline, err_claim, err_record):
    """One rank's ``_wait_rows`` through ``dl.spin_at_least`` (one inline-asm block; one
    chunk: flag 0)."""
    if dl.spin_at_least(sig_ptr, epoch, deadline) < epoch:
        dl.record_error(err_claim, err_record, 0, 0, 0, epoch, dl.TIMEOUT)
    dl.fence_proxy_async()


@triton.jit
def _wait_rows_asm_once(sig_ptr, epoch, deadline, err_claim, err_record, ready):
    """``_wait_rows_asm`` only while the chunk is not yet seen (``ready == 0``); returns the new
    ``ready``. Once a program has seen the chunk's flag (and fenced once), later tiles skip the
    acquire load and the proxy fence, which may be what costs ``flat_asmwait`` its pipelining
    gain (one acquire load and one ``fence.proxy.async`` per tile)."""
    if ready == 0:
        _wait_rows_asm(sig_ptr, epoch, deadline, err_claim, err_record)
        ready = 1
    return ready


@triton.jit
def _coords(tile, tiles_m, group, GROUP_M: tl.constexpr):
    first = (tile // group) * GROUP_M
    size = tl.minimum(tiles_m - first, GROUP_M)
    return first + (tile % group) % size, (tile % group) // size


@triton.jit
def flat_kernel(a_desc, b_desc, c_desc, sig_ptr, offsets_ptr, err_claim, err_record, M, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                WAIT: tl.constexpr, ASM_WAIT: tl.constexpr = False, ONCE: tl.constexpr = False):
    """Persistent TMA GEMM (B as ``[N, K]``). ``WAIT`` (one rank, flags pre-set): a program
    waits for the rows of its *next* tile at the top of each tile, a whole tile ahead of that
    tile's loads, which the pipeliner of a flattened loop issues only a few K steps early
    (a candidate schedule for the ag_gemm consumer: ``tl.range(flatten=True)`` with chunk waits)."""
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    group = GROUP_M * tiles_n
    epoch = tl.zeros((), tl.int64)
    deadline = tl.zeros((), tl.int64)
    if WAIT:
        epoch = tl.load(sig_ptr + 3, volatile=True)
        deadline = dl.deadline_after(tl.full((), 10**9, tl.int64))
        pm, pn = _coords(start, tiles_m, group, GROUP_M)
        _wait_rows(sig_ptr, offsets_ptr, pm * BLOCK_M, tl.minimum(pm * BLOCK_M + BLOCK_M, M), 0, 1,
                   epoch, deadline, err_claim, err_record, 0)
    tile_c = start - NUM_SMS
    ready = tl.zeros((), tl.int32)  # ONCE: this program has seen the (single) chunk's flag
    for tile in tl.range(start, tiles, NUM_SMS, flatten=FLATTEN):
        if WAIT:
            if tile + NUM_SMS < tiles:
                pm, pn = _coords(tile + NUM_SMS, tiles_m, group, GROUP_M)
                if ONCE:
                    ready = _wait_rows_asm_once(sig_ptr, epoch, deadline, err_claim, err_record,
                                                ready)
                elif ASM_WAIT:
                    _wait_rows_asm(sig_ptr, epoch, deadline, err_claim, err_record)
                else:
                    _wait_rows(sig_ptr, offsets_ptr, pm * BLOCK_M,
                               tl.minimum(pm * BLOCK_M + BLOCK_M, M), 0, 1, epoch, deadline,
                               err_claim, err_record, 0)
        pm, pn = _coords(tile, tiles_m, group, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pn * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        tile_c += NUM_SMS
        pm, pn = _coords(tile_c, tiles_m, group, GROUP_M)
        c0, c1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], c0.to(c_desc.dtype))
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N + BLOCK_N // 2], c1.to(c_desc.dtype))


def body(group):
    warm_gpu(group.device)
    sms = torch.cuda.get_device_properties(group.device).multi_processor_count
    geo = {}
    for (m, n, k), models in _local_shapes(False).items():
        a, w = _inputs(m, n, k, torch.bfloat16, group.device)
        b = w.t()
        out = torch.empty(m, n, dtype=torch.bfloat16, device=group.device)
        ad = TensorDescriptor(a, [m, k], [k, 1], [128, 64])
        bd = TensorDescriptor(w, [n, k], [k, 1], [256, 64])
        cd = TensorDescriptor(out, [m, n], [n, 1], [128, 128])
        tiles = -(-m // 128) * -(-n // 256)
        sig, _, claim, record = one_rank_pad(group.device, (1, 1, m, 1))  # chunk present
        offsets = torch.tensor([0, m], dtype=torch.int32, device=group.device)

        def flat(flatten, stages, wait=False, asm=False, once=False):
            return lambda: flat_kernel[(min(sms, tiles),)](
                ad, bd, cd, sig, offsets, claim, record, m, n, k, BLOCK_M=128, BLOCK_N=256,
                BLOCK_K=64, GROUP_M=8, NUM_SMS=min(sms, tiles), FLATTEN=flatten, WAIT=wait,
                ASM_WAIT=asm, ONCE=once, num_warps=8, num_stages=stages)
        fns = {"cublas": lambda: torch.matmul(a, b), "ours": lambda: matmul(a, b),
               "noflat_s3": flat(False, 3), "flat_s3": flat(True, 3), "flat_s4": flat(True, 4),
               "flat_wait_s3": flat(True, 3, wait=True),
               "flat_asmwait_s3": flat(True, 3, wait=True, asm=True),
               "flat_asmonce_s3": flat(True, 3, wait=True, once=True)}
        if QUICK:
            fns = {x: fns[x] for x in ("cublas", "ours", "flat_s3", "flat_asmwait_s3",
                                       "flat_asmonce_s3")}
        ref = torch.matmul(a, b).float()
        for name in [x for x in fns if x not in ("cublas", "ours")]:
            fns[name]()
            err = (out.float() - ref).abs().max().item()
            assert err < 0.1 and int(record[0]) == 0, (name, err, record.tolist())
        t = paired_graph_times(group, fns, rounds=12, target_ms=25)
        line = f"{m}x{n}x{k}: cublas {t['cublas']:.1f}us " + " ".join(
            f"{x} {t['cublas'] / t[x]:.3f}" for x in fns if x != "cublas")
        for x in fns:
            geo.setdefault(x, []).append(t["cublas"] / t[x])
        print(line, flush=True)
    import math
    print("geo " + " ".join(f"{x} {math.exp(sum(map(math.log, v)) / len(v)):.3f}" for x, v in geo.items()), flush=True)

launch(body, 1, torch.device("cuda", 0))
