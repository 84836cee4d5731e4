"""P1 shapes on the GPU: our GEMM core vs a plain tutorial-style persistent TMA kernel of the same
tiles (no bias, specialised sizes), with and without ``tl.range(flatten=True)``, all vs cuBLAS,
timed in turns (``paired_graph_times``). One device call: ``PYTHONPATH=. python
tools/p1_kernel_variants.py [--quick]`` (about 2 minutes with compiles; ``--quick``: ours and the
plain kernel only). H200, 2026-12-01, geo-mean over
the six shapes: ours 0.958, plain 0.972, flattened 3 stages 0.982, 4 stages 0.962.
"""
import sys
import torch, triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from ditron_ops import _env
_env.prepare_cuda_for_virtual_ranks()
from ditron_ops.ag_gemm import matmul
from ditron_ops.bench.ag_gemm import _local_shapes, _inputs
from ditron_ops.bench.harness import paired_graph_times, warm_gpu
from ditron_ops.runtime.virtual import launch


QUICK = "--quick" in sys.argv  # ours and the plain kernel only (fewer compiles)


@triton.jit
def flat_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                FLATTEN: tl.constexpr):
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    group = GROUP_M * tiles_n
    tile_c = start - NUM_SMS
    for tile in tl.range(start, tiles_m * tiles_n, NUM_SMS, flatten=FLATTEN):
        first = (tile // group) * GROUP_M
        size = tl.minimum(tiles_m - first, GROUP_M)
        pm = first + (tile % group) % size
        pn = (tile % group) // size
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pn * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        tile_c += NUM_SMS
        first = (tile_c // group) * GROUP_M
        size = tl.minimum(tiles_m - first, GROUP_M)
        pm = first + (tile_c % group) % size
        pn = (tile_c % group) // size
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
        def flat(flatten, stages, gm=8):
            return lambda: flat_kernel[(min(sms, tiles),)](ad, bd, cd, m, n, k, BLOCK_M=128, BLOCK_N=256,
                                                          BLOCK_K=64, GROUP_M=gm, NUM_SMS=min(sms, tiles),
                                                          FLATTEN=flatten, num_warps=8, num_stages=stages)
        fns = {"cublas": lambda: torch.matmul(a, b), "ours": lambda: matmul(a, b),
               "noflat_s3": flat(False, 3), "flat_s3": flat(True, 3), "flat_s4": flat(True, 4)}
        if QUICK:
            fns = {x: fns[x] for x in ("cublas", "ours", "noflat_s3")}
        ref = torch.matmul(a, b).float()
        for name in [x for x in fns if x not in ("cublas", "ours")]:
            fns[name]()
            err = (out.float() - ref).abs().max().item()
            assert err < 0.1, (name, err)
        t = paired_graph_times(group, fns, rounds=12, target_ms=25)
        line = f"{m}x{n}x{k}: cublas {t['cublas']:.1f}us " + " ".join(
            f"{x} {t['cublas'] / t[x]:.3f}" for x in fns if x != "cublas")
        for x in fns:
            geo.setdefault(x, []).append(t["cublas"] / t[x])
        print(line, flush=True)
    import math
    print("geo " + " ".join(f"{x} {math.exp(sum(map(math.log, v)) / len(v)):.3f}" for x, v in geo.items()), flush=True)

launch(body, 1, torch.device("cuda", 0))
