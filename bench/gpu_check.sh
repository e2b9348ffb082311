#!/usr/bin/env bash
# The gpu_compute check for a machine with CuPy and a CUDA device, run from the repository root:
# the CUDA kernel and worker tests, the ONNX node cases on CUDA, and bench/gpu_compute.py. Logs land in
# $OUT (default /tmp/gpu-check). Wheels in .whl/ (pytest-asyncio, sniffio…) are installed first.
# Timeouts in seconds: UNIT, CONF, BENCH. A cold numba cache costs minutes in the CPU references.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export NUMBA_CACHE_DIR=/tmp/numba-cache
T0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
UNIT=${UNIT:-240}; CONF=${CONF:-240}; BENCH=${BENCH:-120}; JOBS=${JOBS:-8}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import cupy, numpy, onnx, onnxruntime as o; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'onnx', onnx.__version__, 'ort', o.__version__, o.get_available_providers())
from asyncinfer.backends.cupy.device import cuda_unavailable_reason; print('unavailable:', cuda_unavailable_reason())"
} 2>&1 | tee "$OUT/env.txt"

stamp "unit and conformance (in parallel)"
timeout "$UNIT" python3 -m pytest -p no:cacheprovider --continue-on-collection-errors -n 6 --timeout $((UNIT - 30)) -q -rfEs \
  tests/backends/cupy tests/runtime -k "cuda or gpu_compute or test_backend" > "$OUT/unit.log" 2>&1 &
UNIT_PID=$!
timeout "$CONF" python3 -m pytest -p no:cacheprovider -n "$JOBS" --timeout $((CONF - 30)) -q -rfE \
  tests/test_conformance.py -k gpu_compute_cuda > "$OUT/conformance.log" 2>&1
echo "conformance rc=$?"; grep -E " passed| failed" "$OUT/conformance.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/conformance.log" | cut -c1-200 | head -40
wait $UNIT_PID; echo "unit rc=$?"; grep -E " passed| failed| error" "$OUT/unit.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/unit.log" | cut -c1-220 | head -40

stamp bench
timeout "$BENCH" python3 bench/gpu_compute.py --repeats 5 --no-write > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -30 "$OUT/bench.log"
stamp done
