#!/usr/bin/env bash
# One device-tool call on a lent multi-GPU H200 machine (nvidia-h200-x2/x4/x8), logs under $OUT.
#
#   bash tools/multigpu_session.sh env check tests tp symm     # parts run in the order given
#
#   env    GPU count, NVLink topology, versions (env.log)
#   check  torchrun -m ditron_ops: every op vs its reference, one process per GPU (check.log)
#   tests  tests/gpu/test_torchrun.py: the multi-process GPU tier (tests.log)
#   checks the suite that test runs, directly under torchrun, output streamed (checks.log)
#   fd1    flash_decode on one GPU under torchrun (fd1.log, CSV): its scaling's first point
#   example  examples/tp_mlp_torchrun.py (example.log)
#   tp     torchrun -m ditron_ops.bench tp: ours vs NCCL + cuBLAS, flash_decode (tp.log, CSV)
#   symm   torchrun -m ditron_ops.bench tp_symm_mem: PyTorch's fused ops (symm.log, CSV)
#   quick  the tp bench with --quick (a smoke run of the bench code)
#   lowp   gemm_rs / gemm_ar of the tp bench with --lowp-partials (lowp.log, CSV)
#
# nvshmem4py comes from .whl (carry it: ../shared/tools/gpu-wheels.sh downloads it). NVLink
# multicast stays off (the lent machines require it). NPROC defaults to every visible GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
. tools/device_setup.sh  # $OUT, nvshmem4py from .whl, PYTHONPATH
NPROC=${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
run() {  # run LOG LIMIT_S CMD...: append the output to LOG, print the rc and the summary lines
  local log=$1 limit=$2; shift 2
  echo "=== $* (limit ${limit}s)" >> "$OUT/$log"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  echo "$log: rc=$rc in $((SECONDS - t0)) s: $*"
  return $rc
}
for part in "$@"; do
  case "$part" in
    env)
      { nvidia-smi -L; nvidia-smi topo -m
        python3 -c 'import torch, triton; print("torch", torch.__version__, "triton",
triton.__version__, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
        python3 -c 'import nvshmem.core as n; print("nvshmem4py ok", n.get_version())'
      } > "$OUT/env.log" 2>&1
      head -3 "$OUT/env.log"; grep -E "GPU0|GPU1" "$OUT/env.log" | head -2; tail -2 "$OUT/env.log"
      ;;
    check)
      run check.log 240 torchrun --nproc-per-node "$NPROC" -m ditron_ops
      tail -16 "$OUT/check.log"
      ;;
    tests)
      run tests.log 300 python3 -m pytest -q -x tests/gpu/test_torchrun.py
      grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
      ;;
    checks)  # the same suite as tests, its output streamed (where it stops shows); SKIP=a,b
      # leaves parts out (--skip: collectives, ag_gemm, flash_decode, gemm_reduce,
      # graphs, back_to_back, timeout)
      run checks.log ${CHECKS_S:-240} torchrun --nproc-per-node "$NPROC" -m ditron_ops.testing.torchrun_checks \
        --skip "${SKIP:-}" --dump-after "${DUMP_S:-100}"
      grep -vE "^W1|^ *\^+$" "$OUT/checks.log" | head -80 | cut -c1-200
      ;;
    example)  # examples/tp_mlp_torchrun.py: a TP MLP layer trained a few steps, checked
      run example.log 200 torchrun --nproc-per-node "$NPROC" examples/tp_mlp_torchrun.py
      grep -E "ranks|losses|Error" "$OUT/example.log" | head -5
      ;;
    fd1)  # flash_decode on one GPU (nvshmem, one PE): the first point of its scaling
      run fd1.log 150 torchrun --nproc-per-node 1 -m ditron_ops.bench tp --only flash_decode \
        --out "$OUT/bench"
      grep -E "flash_decode B" "$OUT/fd1.log" | tail -2
      ;;
    quick)
      run tp.log 200 torchrun --nproc-per-node "$NPROC" -m ditron_ops.bench tp --quick \
        --out "$OUT/bench_quick"
      tail -8 "$OUT/tp.log"
      ;;
    tp)
      run tp.log 330 torchrun --nproc-per-node "$NPROC" -m ditron_ops.bench tp --out "$OUT/bench"
      grep -E "geo|tp |ag_gemm|gemm_rs|gemm_ar|flash" "$OUT/tp.log" | tail -40 | cut -c1-150
      ;;
    lowp)  # gemm_rs / gemm_ar with input-dtype partials (--lowp-partials): the A/B run
      run lowp.log 300 torchrun --nproc-per-node "$NPROC" -m ditron_ops.bench tp --lowp-partials \
        --only gemm_rs,gemm_ar --out "$OUT/bench_lowp"
      grep -E "gemm_rs|gemm_ar" "$OUT/lowp.log" | tail -20 | cut -c1-150
      ;;
    symm)
      run symm.log 240 torchrun --nproc-per-node "$NPROC" -m ditron_ops.bench tp_symm_mem \
        --out "$OUT/bench" || run symm.log 240 torchrun \
        --nproc-per-node "$NPROC" -m ditron_ops.bench tp_symm_mem --timing eager --out "$OUT/bench"
      grep -E "geo|ag_gemm|gemm_rs" "$OUT/symm.log" | tail -24 | cut -c1-150
      ;;
    *) echo "unknown part: $part (env, check, tests, checks, example, fd1, quick, tp, lowp, symm)"; exit 2 ;;
  esac
done
rm -f "$OUT"/bench/*.png "$OUT"/bench_quick/*.png "$OUT"/bench_lowp/*.png
