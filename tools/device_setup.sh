# Sourced by the device-call scripts (h200_session.sh, multigpu_session.sh) from the repo root:
# $OUT (default /tmp/out) with a bench folder, nvshmem4py from a carried .whl (installed once
# per machine into /tmp/site; ../shared/tools/gpu-wheels.sh downloads it) and PYTHONPATH.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/bench"
if ls .whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/nvshmem ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "nvshmem4py install failed (pip.log)"
fi
export PYTHONPATH=/tmp/site:.
# a Triton cache carried from an earlier call (.tcache/tcache.tgz*, parts of at most 15 MB)
if ls .tcache/tcache.tgz* > /dev/null 2>&1 && [ ! -d /tmp/tcache ]; then
  cat .tcache/tcache.tgz* | tar xzf - -C /tmp
fi
export TRITON_CACHE_DIR=/tmp/tcache PYTHONUNBUFFERED=1
