#!/usr/bin/env bash
# Steps for a TPU VM (none is lent to this project yet): the splash kernel against the oracle on the real chip,
# then the timed suites and the compile record of this generation. Run from the repository root; writes under $OUT.
#   bash benchmarks/tools/tpu_session.sh                          # every step, in order
#   bash benchmarks/tools/tpu_session.sh tests attention          # only these steps
# Steps: tests, attention, model, train, decode, compile. On a TPU the default attention order is
# splash -> chunked -> xla and the splash tests run the compiled kernel (interpret=None follows the target). torch
# has no TPU path here (torch_xla is out of scope): its rows run on the VM's CPU, labelled with that device.
# Results go to $OUT/results/<device>/ (the committed layout): copy that folder into benchmarks/results/ and commit
# it, then `python -m benchmarks.readme`; never type a TPU number by hand.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
ALL_STEPS=(tests attention model train decode compile)
if [ "$#" -gt 0 ]; then STEPS=("$@"); else STEPS=("${ALL_STEPS[@]}"); fi
for s in "${STEPS[@]}"; do
  case " ${ALL_STEPS[*]} " in
    *" $s "*) ;;
    *) echo "tpu_session.sh: unknown step '$s'; steps: ${ALL_STEPS[*]}" >&2; exit 2 ;;
  esac
done
want() {
  local s
  for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}
mkdir -p "$OUT"
python -c "import jax; d = jax.devices(); print(jax.default_backend(), len(d), d[0].device_kind)" | tee "$OUT/tpu.txt"
DEVICE=$(python -c "from benchmarks import measure; print(measure.device_slug(measure.env_info()))")
RES="$OUT/results/$DEVICE"
# 1. correctness on the chip: splash (compiled, not interpreted) and the dispatcher's TPU order
if want tests; then
  timeout 600 python -m pytest parity_tests/test_splash.py parity_tests/test_attention.py -q -rA -p no:warnings \
    2>&1 | tee "$OUT/tpu_tests.log"
fi
if want attention; then
  timeout 600 python -m benchmarks run --suite attention --max-seq "${MAX_SEQ:-8192}" --out "$RES" 2>&1 \
    | tee "$OUT/bench_attention.log"
fi
for suite in model train decode; do
  if want "$suite"; then
    timeout 600 python -m benchmarks run --suite "$suite" --out "$RES" 2>&1 | tee "$OUT/bench_$suite.log"
  fi
done
# the same compile as on a CPU host (memory, compiler estimate), beside the measured times of this generation
if want compile; then
  GEN=$(python -c "import jax; k = jax.devices()[0].device_kind.lower(); print('v6e' if 'v6' in k else 'v5e' if 'lite' in k else 'v5p')")
  timeout 900 python -m benchmarks compile --target "$GEN" --out "$RES/$GEN-compiled" 2>&1 | tee "$OUT/compile.log"
fi
