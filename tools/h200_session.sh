#!/usr/bin/env bash
# One device-tool call on the lent H200: the GPU test tier and/or the benches, logs under $OUT.
#
#   bash tools/h200_session.sh tests      # tests/gpu, one pytest run per file (about 7 minutes)
#   bash tools/h200_session.sh benches    # ag_gemm, gemm_rs, flash_decode benches (about 3-4)
#   bash tools/h200_session.sh main       # python -m ditron_ops (main.log)
#   bash tools/h200_session.sh overhead   # host cost per eager call: the bench and pytest-benchmark
#   TESTS="moe ulysses" bash tools/h200_session.sh tests     # only tests/gpu/test_{moe,ulysses}_gpu.py
#   TESTS=fuzz PYTEST_ARGS="-k programs" bash tools/h200_session.sh tests   # one part of a file
#   bash tools/h200_session.sh soak       # tools/soak.py: 10^4 calls, W=4 (soak.log, CSV + JSON under $OUT/soak)
#   bash tools/h200_session.sh bench:moe  # one bench (bench.log), CSV under $OUT/bench
#   bash tools/h200_session.sh splitk     # split-K calibration: gemm_sweep --only splitk (CSV under
#                                         # $OUT/splitk), then tools/gemm_rule_fit.py --splitk on it
#   bash tools/h200_session.sh cache      # the Triton cache back as $OUT/tcache.tgz.NN (15 MB parts)
#   bash tools/h200_session.sh fp8        # the fp8 WS core's and the fp8 ops' GPU tests, then bench
#                                         # fp8 --only tensor,row,block,present,fused (about 6 min)
#   bash tools/h200_session.sh new        # fp8 WS producer, paged decode: tests, probe, bench
#   bash tools/h200_session.sh pending    # what no GPU has run since 7b284ab (fp8 WS producer, row
#                                         # packer, the norm's peer loads): tests, probes (<= 10 min)
#
# nvshmem4py is installed from .whl when the call carries it (../shared/tools/gpu-wheels.sh
# downloads it), so the one-PE NVSHMEM smoke test runs instead of skipping.
#
# A call gets at most 10 minutes: run the two parts in separate calls.
#
# The device machine's copy of the checkout reports a stale git commit, so the recorded commit
# comes from COMMIT (set it in the call: COMMIT=$(git rev-parse --short HEAD) here, pasted into
# the command; the benches get it as --commit). Only about 8 files come back from $OUT per call: logs go
# to tests.log and benches.log, and PNGs are dropped (rebuild them from the CSVs with
# python -m ditron_ops.bench plot benchmarks/results/*.csv, i.e. ditron_ops.bench.plots).
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_setup.sh  # $OUT, nvshmem4py from .whl, PYTHONPATH
for part in "$@"; do
  case "$part" in
    tests)
      files=tests/gpu/test_*.py
      [ -n "${TESTS:-}" ] && files=$(for t in $TESTS; do echo tests/gpu/test_${t}_gpu.py; done)
      for f in $files; do
        echo "=== $f" >> "$OUT/tests.log"
        # the fuzz file's 2000 programs take about 10 minutes: one call per part
        # (PYTEST_ARGS="-k part0", "-k part1", "-k 'not programs'"); its own bound, its timings shown
        bound=240; extra=""; [ "$(basename "$f")" = test_fuzz_gpu.py ] && bound=570 extra="-rP --durations=0"
        timeout $bound python -m pytest -q $extra ${PYTEST_ARGS:-} "$f" > "$OUT/test.tmp" 2>&1
        rc=$?
        cat "$OUT/test.tmp" >> "$OUT/tests.log"
        if [ $rc = 124 ]; then summary="TIMEOUT after $bound s (no summary)"
        else summary="rc=$rc $(grep -E "passed|failed|error|skipped" "$OUT/test.tmp" | tail -1)"; fi
        echo "$(basename "$f" .py): $summary"; rm -f "$OUT/test.tmp"
      done
      ;;
    benches)
      for b in ag_gemm gemm_rs flash_decode; do
        echo "=== bench $b" >> "$OUT/benches.log"
        timeout 200 python -m ditron_ops.bench "$b" --out "$OUT/bench" ${COMMIT:+--commit "$COMMIT"} \
          > "$OUT/bench.tmp" 2>&1
        echo "bench $b: rc=$?"
        cat "$OUT/bench.tmp" >> "$OUT/benches.log"
        grep -E "geo|present|det |one-shot|fused M|producer|B=" "$OUT/bench.tmp" | cut -c1-110
        rm -f "$OUT/bench.tmp"
      done
      rm -f "$OUT"/bench/*.png
      ;;
    main)
      timeout 240 python -m ditron_ops > "$OUT/main.log" 2>&1
      echo "python -m ditron_ops: rc=$?"; tail -16 "$OUT/main.log"
      ;;
    overhead)
      timeout 300 python -m ditron_ops.bench overhead --out "$OUT/bench" ${COMMIT:+--commit "$COMMIT"} \
        > "$OUT/overhead.log" 2>&1; echo "bench overhead: rc=$?"; tail -24 "$OUT/overhead.log"
      timeout 200 python -m pytest benchmarks/ --benchmark-only -q \
        --benchmark-columns=median,min,max,rounds > "$OUT/pytest_benchmark.log" 2>&1
      echo "pytest-benchmark: rc=$?"; grep -E "test_eager_call|passed|failed" "$OUT/pytest_benchmark.log" | cut -c1-120
      rm -f "$OUT"/bench/*.png
      ;;
    fp8)
      timeout 200 python -m pytest -q tests/gpu/test_ws_scaled_gpu.py \
        -k "every_config or either_core" > "$OUT/fp8_ws_tests.log" 2>&1
      echo "test_ws_scaled_gpu: rc=$? $(grep -E "passed|failed" "$OUT/fp8_ws_tests.log" | tail -1)"
      timeout 200 python -m pytest -q tests/gpu/test_ag_gemm_scaled_gpu.py \
        > "$OUT/fp8_ag_tests.log" 2>&1
      echo "test_ag_gemm_scaled_gpu: rc=$? $(grep -E "passed|failed" "$OUT/fp8_ag_tests.log" | tail -1)"
      timeout 300 python -m ditron_ops.bench fp8 --only tensor,row,block,present,fused --rounds 3 \
        --target-ms 4 --out "$OUT/bench" ${COMMIT:+--commit "$COMMIT"} > "$OUT/bench_fp8.log" 2>&1
      echo "bench fp8: rc=$?"; grep -E "worst five" "$OUT/bench_fp8.log" | cut -c1-160
      rm -f "$OUT"/bench/*.png
      ;;
    pending)
      # what no GPU has run since 7b284ab: the fp8 WS core's pushing producer (its tests, then
      # its time in the probe beside the portable one), the fp8 row packer (the probe: against
      # the torch copies, each producer at one rank) with the fp8 ops' tests, and the norm's
      # four-at-a-time peer loads with its tests and, where an older copy of the kernel file
      # was put beside the probe (untracked: git show 7b284ab:ditron_ops/collectives/
      # _norm_kernels.py > benchmarks/probes/_norm_kernels_7b284ab.py), both timed in turn
      timeout 200 python -m pytest -q tests/gpu/test_ag_gemm_scaled_gpu.py -k ws_producer \
        > "$OUT/ws_producer_tests.log" 2>&1
      echo "fp8 WS producer tests: rc=$? $(grep -E "passed|failed" "$OUT/ws_producer_tests.log" | tail -1)"
      timeout 120 python benchmarks/probes/fp8_fused_parts.py > "$OUT/fp8_parts.log" 2>&1
      echo "fp8_fused_parts: rc=$?"; grep -E "pack|fused copy|gemm_rs" "$OUT/fp8_parts.log"
      timeout 180 python -m pytest -q tests/gpu/test_ag_gemm_scaled_gpu.py -k "not ws_producer" \
        tests/gpu/test_all_reduce_rmsnorm_gpu.py > "$OUT/pending_tests.log" 2>&1
      echo "fp8 ops + norm tests: rc=$? $(grep -E "passed|failed" "$OUT/pending_tests.log" | tail -1)"
      old=benchmarks/probes/_norm_kernels_7b284ab.py
      if [ -f $old ]; then
        timeout 90 python benchmarks/probes/norm_programs_probe.py norm --worlds 8,4,2 \
          --programs 0 --kernels $old,head > "$OUT/norm_probe.log" 2>&1
        echo "norm probe: rc=$?"; grep "^norm" "$OUT/norm_probe.log" | cut -c1-150
      fi
      ;;
    new)
      # the fp8 WS producer (tests, then the probe's producer times), the paged decode (its
      # GPU tests, then bench serving's decode cases at W = 2: paged over contiguous)
      timeout 200 python -m pytest -q tests/gpu/test_ag_gemm_scaled_gpu.py -k ws_producer \
        > "$OUT/ws_producer_tests.log" 2>&1
      echo "fp8 WS producer tests: rc=$? $(grep -E "passed|failed" "$OUT/ws_producer_tests.log" | tail -1)"
      timeout 120 python benchmarks/probes/fp8_fused_parts.py > "$OUT/fp8_parts.log" 2>&1
      echo "fp8_fused_parts: rc=$?"; grep -E "pack|fused copy|gemm_rs" "$OUT/fp8_parts.log"
      timeout 120 python -m pytest -q tests/gpu/test_flash_decode_paged_gpu.py \
        > "$OUT/paged_tests.log" 2>&1
      echo "paged decode tests: rc=$? $(grep -E "passed|failed" "$OUT/paged_tests.log" | tail -1)"
      if [ -z "${SKIP_BENCH:-}" ]; then  # (SKIP_BENCH=1: tests and probe only, about 7 min)
        timeout 150 python -m ditron_ops.bench serving --only decode --world-sizes 2 \
          --out "$OUT/bench" ${COMMIT:+--commit "$COMMIT"} > "$OUT/serving_decode.log" 2>&1
        echo "bench serving decode W=2: rc=$?"
        grep -E "paged P=|geo" "$OUT/serving_decode.log" | cut -c1-130
        rm -f "$OUT"/bench/*.png
      fi
      ;;
    bench:*)
      b=${part#bench:}
      timeout 400 python -m ditron_ops.bench "$b" --out "$OUT/bench" ${COMMIT:+--commit "$COMMIT"} \
        > "$OUT/bench_$b.log" 2>&1; echo "bench $b: rc=$?"; tail -40 "$OUT/bench_$b.log" | cut -c1-160
      rm -f "$OUT"/bench/*.png
      ;;
    splitk)
      timeout 540 python -m ditron_ops.bench gemm_sweep --only splitk --out "$OUT/splitk" \
        ${COMMIT:+--commit "$COMMIT"} > "$OUT/splitk.log" 2>&1
      echo "bench gemm_sweep --only splitk: rc=$?"; grep -E "^splitk " "$OUT/splitk.log" | cut -c1-170
      rm -f "$OUT"/splitk/*.png
      python tools/gemm_rule_fit.py --splitk "$OUT/splitk/gemm_sweep-bf16-cuda.csv" \
        > "$OUT/splitk_fit.log" 2>&1
      sed -n '/^split-K calibration/,$p' "$OUT/splitk_fit.log" | grep -E "fitted|constants:"
      ;;
    soak) timeout 300 python tools/soak.py --out "$OUT/soak" ${COMMIT:+--commit "$COMMIT"} > "$OUT/soak.log" 2>&1; echo "soak: rc=$?"; tail -12 "$OUT/soak.log" ;;
    cache)
      tar czf - -C /tmp tcache | split -b 15m -d - "$OUT/tcache.tgz."; ls -la "$OUT"/tcache.tgz.*
      ;;
    *) echo "unknown part: $part (tests, benches, main, overhead, bench:NAME, splitk, soak, cache, fp8)"; exit 2 ;;
  esac
done
