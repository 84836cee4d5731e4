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
#   bash tools/h200_session.sh pending    # what no GPU has run at HEAD (fp8 WS producer in graphs,
#                                         # fused fp8 figures, the norm's peer loads at W = 8)
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
      # what no GPU has run at HEAD: the fp8 WS pushing producer under CUDA graphs and queued
      # calls (the default from K >= SCALED_WS_MIN_K), the fused fp8 figures with that rule,
      # and, where an older copy of the norm's kernels was put beside the probe (untracked:
      # git show 7b284ab:ditron_ops/collectives/_norm_kernels.py >
      # benchmarks/probes/_norm_kernels_7b284ab.py), the norm's four-at-a-time peer loads
      # against it (W = 8: an H200)
      timeout 200 python -m pytest -q tests/gpu/test_ag_gemm_scaled_gpu.py \
        -k "graph_replay or back_to_back or ws_producer" > "$OUT/pending_tests.log" 2>&1
      echo "fp8 graph / queued / WS producer tests: rc=$? $(tail -1 "$OUT/pending_tests.log")"
      timeout 200 python -m ditron_ops.bench fp8 --only fused --rounds 3 --target-ms 4 \
        --out "$OUT/bench" ${COMMIT:+--commit "$COMMIT"} > "$OUT/bench_fp8.log" 2>&1
      echo "bench fp8 fused: rc=$? (last six: the geo-means)"; grep -E "^fused" "$OUT/bench_fp8.log" | tail -6 | cut -c1-120
      rm -f "$OUT"/bench/*.png
      old=benchmarks/probes/_norm_kernels_7b284ab.py
      if [ -f $old ]; then
        timeout 120 python benchmarks/probes/norm_programs_probe.py norm --worlds 8,4,2 \
          --programs 0 --kernels $old,head > "$OUT/norm_probe.log" 2>&1
        echo "norm probe: rc=$?"; grep "^norm" "$OUT/norm_probe.log" | cut -c1-150
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
