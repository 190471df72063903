#!/usr/bin/env bash
# One device call for a session that has a GPU: compiled-kernel tests first, then the benchmark suites.
# Run from the repository root on the GPU machine: `bash benchmarks/gpu_session.sh` (writes under $OUT).
# Copy $OUT/results/<device>/ into benchmarks/results/ and commit it; never type a GPU number by hand.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
# 1. correctness of the compiled kernels (flash via Triton, mosaic via Mosaic GPU, cudnn, precision flags);
#    -rA lists every test's outcome, which step 3 reads (no -x: one backend's failure must not hide the others)
timeout 240 python -m pytest parity_tests -m gpu -q -rA -p no:warnings --durations=10 2>&1 | tee "$OUT/gpu_tests.log"
# 2. benchmarks (split the attention sweep with --max-seq / --impl if one call cannot hold it)
timeout 300 python -m benchmarks run --suite attention --max-seq "${MAX_SEQ:-8192}" --out "$OUT/results" 2>&1 | tee "$OUT/bench_attention.log"
timeout 120 python -m benchmarks run --suite model --out "$OUT/results" 2>&1 | tee "$OUT/bench_model.log"
# 3. the default attention order by evidence (CONVENTIONS §4): advice printed, never applied by the script
for f in "$OUT"/results/*/attention.json; do
  [ -e "$f" ] && python -m benchmarks.default_order --tests "$OUT/gpu_tests.log" --attention "$f" 2>&1 | tee "$OUT/default_order.txt"
done
