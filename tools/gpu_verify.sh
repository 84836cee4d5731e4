#!/usr/bin/env bash
# One H200 call: the GPU tests that cover a change set, then the import cost; logs under $OUT.
# usage: bash tools/gpu_verify.sh [pytest paths...]   (run from the repository root)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_verify}; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for t in "$@"; do
  name=$(basename "$t" .py)
  timeout 240 python -m pytest -q -p no:cacheprovider "$t" > "$out/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$out/$name.log")"
done
for i in 1 2 3; do
  python -c "import time; t=time.perf_counter(); import torch; t1=time.perf_counter(); import ditron_ops; t2=time.perf_counter(); import sys; print(f'import torch {t1-t:.2f} s, ditron_ops +{t2-t1:.2f} s, triton loaded: {\"triton\" in sys.modules}')"
done
