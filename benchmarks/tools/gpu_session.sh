#!/usr/bin/env bash
# Device calls for a session that has a GPU: compiled-kernel tests first, then the benchmark suites.
# Run from the repository root on the GPU machine; writes under $OUT.
#   bash benchmarks/tools/gpu_session.sh                               # every step, in order
#   bash benchmarks/tools/gpu_session.sh tests attention model order   # only these steps
# Steps: tests, attention, model, order (reads the tests log and attention.json of the same $OUT), train, decode.
# Where a device call is limited to 10 minutes, give each call steps whose timeouts add up to less: e.g.
# `tests attention order`, then `model`, then `train`, then `decode`. A suite killed by its timeout writes
# nothing (results are replaced only by complete ones).
# Results go to $OUT/results/<device>/ (the committed layout): copy that folder into benchmarks/results/ and commit
# it, then `python -m benchmarks.readme`; never type a GPU number by hand.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
ALL_STEPS=(tests attention model order train decode)
if [ "$#" -gt 0 ]; then STEPS=("$@"); else STEPS=("${ALL_STEPS[@]}"); fi
for s in "${STEPS[@]}"; do
  case " ${ALL_STEPS[*]} " in
    *" $s "*) ;;
    *) echo "gpu_session.sh: unknown step '$s'; steps: ${ALL_STEPS[*]}" >&2; exit 2 ;;
  esac
done
want() {
  local s
  for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
# the results directory name of this device, as `python -m benchmarks run` names it by default
DEVICE=$(python -c "from benchmarks import measure; print(measure.device_slug(measure.env_info()))")
RES="$OUT/results/$DEVICE"
# 1. correctness of the compiled kernels (flash via Triton, mosaic via Mosaic GPU, cudnn, precision flags);
#    -rA lists every test's outcome, which step "order" reads (no -x: one backend's failure must not hide the others)
if want tests; then
  timeout 240 python -m pytest parity_tests -m gpu -q -rA -p no:warnings --durations=10 2>&1 | tee "$OUT/gpu_tests.log"
fi
# 2. benchmarks (split the attention sweep with --max-seq / --impl if one call cannot hold it)
if want attention; then
  timeout 300 python -m benchmarks run --suite attention --max-seq "${MAX_SEQ:-8192}" --out "$RES" 2>&1 \
    | tee "$OUT/bench_attention.log"
fi
if want model; then
  timeout 120 python -m benchmarks run --suite model --out "$RES" 2>&1 | tee "$OUT/bench_model.log"
fi
# 3. the default attention order by evidence (design §4): advice printed, never applied by the script
if want order; then
  for f in "$RES"/attention.json; do
    [ -e "$f" ] && python -m benchmarks.tools.default_order --tests "$OUT/gpu_tests.log" --attention "$f" 2>&1 \
      | tee "$OUT/default_order.txt"
  done
fi
# 4. train: one step of the 1b preset at B=1, S=2048 per technique toggle, torch and JAX (benchmarks/suites/train.py;
#    rows not started within its 480 s budget are recorded as skipped, so the suite ends inside this timeout)
if want train; then
  timeout 570 python -m benchmarks run --suite train --out "$RES" 2>&1 | tee "$OUT/bench_train.log"
fi
# 5. decode: prefill and KV-cache decode tokens/s per batch size, fp32 / bf16 / int8 weights
if want decode; then
  timeout 540 python -m benchmarks run --suite decode --out "$RES" 2>&1 | tee "$OUT/bench_decode.log"
fi
