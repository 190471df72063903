#!/usr/bin/env bash
# The GPU session: what the project wants from a lent GPU, in two device calls that fit its 15 minutes
# (the machine's start takes 1-2 of them). Run from the repository root; writes under $OUT.
#   bash benchmarks/tools/gpu_session.sh --plan              # the plan (steps, budgets, expected GPU times); runs nothing
#   bash benchmarks/tools/gpu_session.sh --call 1            # device call 1: tests, profile, attention, order, ring
#   bash benchmarks/tools/gpu_session.sh --call 2            # device call 2: train, decode, loops, blocks, gqa
#   bash benchmarks/tools/gpu_session.sh --dry-run --call 1  # the CPU rehearsal: the same steps at quick sizes
#   bash benchmarks/tools/gpu_session.sh model attention     # only these steps, each with its budget
# Every step runs under its own budget (`timeout -s INT`: pytest still prints its summary, a suite keeps the rows it
# finished: they are written one by one). Exit status 1 when a step failed (in a --dry-run rehearsal, also when
# one outran its budget; CI runs the whole rehearsal, .ci/run). $OUT holds at most 6 files per call (a device call returns 8):
# session.log (everything printed), gpu_tests.log, results/<device>/<suite>.json, kernel_profile.json,
# generate_loop.json, ring_decode.json, peers/attention.json, block_search.{json,md}, masked_attention.json.
# Copy results/<device>/ into benchmarks/results/, then `python -m benchmarks report` on it and
# `python -m benchmarks readme`; never type a GPU number by hand. Needs nothing beyond the image's packages
# (jax with its CUDA plugin, torch, pytest-xdist, pytest-timeout); $PYTHON picks the interpreter (default python).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
PY=${PYTHON:-python}
# step | call | budget s | expected on one H100, s | what. Expectations from the sessions so far (one H100, three
# H200s, 2026-11-27 to 2026-11-28; benchmarks/NOTES.md "GPU session on one H100" / "on one H200"); each step first
# measures what those did not reach.
PLAN="tests|1|75|50|gpu tests (55 + the flash dkv default's): 8 pytest-xdist workers, 60 s per test; 55 passed in 49.6 s on one H200 (2026-11-28)
profile|1|130|90|issue 42: each framework's floor (x + 1), the wait ladder (a matmul of 3 us to 1.4 ms: the tail after it, jax blocking / spinning / the suites' wait, torch), then JAX cuDNN vs torch cuDNN and mosaic at D=128, S 2048 and 4096: one call per wait and bursts of 10, paired, host dispatch, kernels and a per-call timeline (H200 2026-11-28: 77 s with two more variants, no ladder)
attention|1|100|90|attention suite at D=128, S <= 4096: ours (flash with its new dkv default, mosaic), JAX and torch cuDNN (H200, D=128: 89 s on 2026-11-27)
peers|-|170|140|D=128 S <= 4096: jax's attention_mgpu (pallas:mgpu) beside mosaic (its own folder; H200: 30 of 32 rows in 85 s, twice measured), then torch's FlexAttention (flex_attention: never run on a GPU; its inductor/Triton compile per shape and pass is the unknown, guessed at 3 s); in no call: by name
order|1|5|1|default attention order by evidence (tests log + attention records)
masked|-|100|70|a 256-key window and 4 packed documents, B=2, 16/4 heads, D=128, bf16, S 2048 and 8192: torch SDPA's dense mask vs FlexAttention vs JAX's default (flash for these masks), one forward each, paired (never run on a GPU: FlexAttention's Triton compile is the unknown); in no call: by name
ring|1|45|30|a windowed decode step (125m as a Mistral, w=256, B=64, 1900 tokens, fp32) on a ring of 256 slots vs the plain 2048-slot cache, paired, JAX then torch (never run on a GPU; expected ring / plain 0.25-0.4 in both: a step reads 0.5 GB of weights and 3.2 GB of keys and values on the plain cache, 0.4 GB on the ring)
train|2|130|120|train suite 1b B=1 S=2048: fused_loss, fp16 (not reached on 2026-11-28), then bf16, tf32, remat_full (H200: 3 toggles in 118 s)
decode|2|130|120|decode suite: 125m-random, B=64 first (never reached), then B=1; fp32/bf16/int8, split-K kernel, torch.compile with CUDA graphs (reduce-overhead; a compile: 14-24 s per weights format)
loops|2|80|60|generate's loops at 125m B=1, 32 tokens, paired: JAX host loop vs loop="device" (one program, one wait) vs torch's, eager and with the CUDA-graph step on the cache generate keeps (its inductor compile: 14-24 s); JAX's stopping loop with its stop read per 16-step chunk vs per step (expected 1.05-1.3x); JAX's host loop with a stopped row's EOS fed in the step program vs by an eager where (expected 1.02-1.06x) (expected: JAX's device loop per token well under its 1.1-1.4 ms synchronized step and under torch's CUDA-graph steps, 0.81-1.37 ms)
blocks|2|35|25|D=128 bf16 flash dkv block sizes at 16/16 heads: the filter's survivors and the default (moved to 32 x 128, 8 warps, 3 stages by the 2026-11-28 pairs: expected the default fastest); Mosaic's tiles settled in three sessions, left out
gqa|2|45|30|flash dkv block sizes at 16 query / 4 kv heads, the survivors and the default (the default won 1.62x on 2026-11-28; expected the default fastest)
model|-|170|160|model suite: 350m and moe-350m fp32, a fresh process each (H200 2026-11-27: 75 s and 82 s); in no call (this H200 model ran it last): by name"
ALL_STEPS=($(cut -d'|' -f1 <<<"$PLAN"))
DRY=0 PLAN_ONLY=0 CALL="" STEPS=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --plan) PLAN_ONLY=1 ;;
    --call) CALL=${2:-}; shift ;;
    --call=*) CALL=${1#--call=} ;;
    -*) echo "gpu_session.sh: unknown option '$1'; options: --plan, --dry-run, --call 1|2" >&2; exit 2 ;;
    *)
      case " ${ALL_STEPS[*]} " in
        *" $1 "*) STEPS+=("$1") ;;
        *) echo "gpu_session.sh: unknown step '$1'; steps: ${ALL_STEPS[*]}" >&2; exit 2 ;;
      esac ;;
  esac
  shift
done
if [ -n "$CALL" ] && [ "$CALL" != 1 ] && [ "$CALL" != 2 ]; then
  echo "gpu_session.sh: --call '$CALL': give 1 or 2" >&2; exit 2
fi
field() { grep "^$1|" <<<"$PLAN" | cut -d'|' -f"$2"; }
if [ "${#STEPS[@]}" -eq 0 ]; then
  for s in "${ALL_STEPS[@]}"; do
    # no --call: every step (the CPU rehearsal); a call's steps otherwise ("-": in no call, run when named)
    if [ -z "$CALL" ] || [ "$(field "$s" 2)" = "$CALL" ]; then STEPS+=("$s"); fi
  done
fi
budget() {  # a step's budget in seconds; BUDGET_<step>=S overrides it (the rehearsal's tests use this)
  local var="BUDGET_$1"
  echo "${!var:-$(field "$1" 3)}"
}
print_plan() {
  local s total=0 expect=0
  printf '%-10s %4s %8s %10s  %s\n' step call budget expected what
  for s in "${STEPS[@]}"; do
    printf '%-10s %4s %7ss %9ss  %s\n' "$s" "$(field "$s" 2)" "$(budget "$s")" "$(field "$s" 4)" "$(field "$s" 5)"
    total=$((total + $(budget "$s"))) expect=$((expect + $(field "$s" 4)))
  done
  echo "total: budget ${total} s, expected ${expect} s on one H100 (a device call may run 600 s; keep each <= 450 s and both <= 780 s)"
}
if [ "$PLAN_ONLY" = 1 ]; then print_plan; exit 0; fi

mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
echo "gpu_session.sh $(date -u +%FT%TZ) call=${CALL:-all} dry_run=$DRY steps: ${STEPS[*]}"
print_plan
if [ "$DRY" = 1 ]; then
  QUICK=(--quick)
  echo "dry run: the same steps on this machine at --quick sizes (a CPU rehearsal: gpu tests skip, nothing is timed on a GPU)"
else
  QUICK=()
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || echo "nvidia-smi: unavailable"
fi
$PY -c "import sys, jax, torch; print('python', sys.version.split()[0], '| jax', jax.__version__, jax.devices(), '| torch', torch.__version__, torch.cuda.is_available())"
DEVICE=$($PY -c "from benchmarks import measure; print(measure.device_slug(measure.env_info()))")
RES="$OUT/results/$DEVICE"
mkdir -p "$RES"
SUMMARY=() FAILED=()
step() {  # step NAME COMMAND...: run under the step's budget (output also to $STEP_LOG if set), note exit and seconds
  local name=$1 b t0 rc
  shift
  b=$(budget "$name")
  echo
  echo "=== step $name (budget ${b} s, expected $(field "$name" 4) s on one H100) ==="
  t0=$(date +%s.%N)
  if [ -n "${STEP_LOG:-}" ]; then
    timeout -s INT -k "${KILL_AFTER:-15}" "$b" "$@" 2>&1 | tee "$STEP_LOG"
    rc=${PIPESTATUS[0]}
  else
    timeout -s INT -k "${KILL_AFTER:-15}" "$b" "$@"
    rc=$?
  fi
  local dt
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  local why="" over=0
  # 124: the interrupt ended it. 137 once the budget is spent: it outlived the interrupt by KILL_AFTER s (default 15)
  # and was killed (pytest-xdist still starting its workers can). Any other 137 (the OOM killer) is a failure.
  awk -v d="$dt" -v b="$b" 'BEGIN { exit !(d >= b) }' && over=1
  if [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ "$over" = 1 ]; }; then
    why=" (its budget ended it; finished rows are kept)"
    [ "$rc" = 137 ] && why=" (its budget ended it: killed ${KILL_AFTER:-15} s after the interrupt; finished rows are kept)"
  fi
  echo "=== step $name: exit $rc after ${dt} s of ${b} s$why ==="
  SUMMARY+=("$name: exit $rc, ${dt} s of ${b} s$why")
  # the session's exit status: a step that failed, or in a rehearsal one that outran its budget
  if [ "$rc" != 0 ] && { [ -z "$why" ] || [ "$DRY" = 1 ]; }; then FAILED+=("$name"); fi
}
want() {
  local s
  for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}
# one benchmark suite into $RES, JSON only (the report is built off the device)
BENCH=("$PY" -m benchmarks run "${QUICK[@]}" --no-report --out "$RES")
if want tests; then
  # -rA lists every test's outcome (step "order" reads it); the conftest prints a verdict per backend. The 8 workers
  # share jax's persistent compilation cache (a program one worker compiled, another loads: not measured yet; on
  # 2026-11-27 compiles made a test take 3-56 s); the benchmark steps keep compiling afresh (their first_call_s).
  # No XLA autotuning in the tests: it times candidate GEMM configs of every dot while compiling, which a
  # correctness test does not need (the flag is known to jax 0.10-0.12's XLA; an unknown one aborts)
  JAX_COMPILATION_CACHE_DIR=/tmp/jaxattn-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 STEP_LOG="$OUT/gpu_tests.log" \
    XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0" \
    step tests "$PY" -m pytest parity_tests -m "gpu and not slow" -n 8 --timeout 60 -q -rA -p no:warnings \
    -p no:cacheprovider --durations=10
fi
if want profile; then
  step profile "$PY" -m benchmarks.tools.kernel_profile "${QUICK[@]}" --out "$RES" --budget-s $(($(budget profile) - 25))
fi
if want model; then
  if [ "$DRY" = 1 ]; then PRESETS=(tiny moe-tiny); else PRESETS=(350m moe-350m); fi
  step model "${BENCH[@]}" --suite model "${PRESETS[@]/#/--preset=}"
fi
if want attention; then
  if [ "$DRY" = 1 ]; then
    step attention "${BENCH[@]}" --suite attention --head-dim 64 --impl xla --impl sdpa:math
  else
    step attention "${BENCH[@]}" --suite attention --head-dim 128 --max-seq 4096 --impl flash --impl mosaic \
      --impl cudnn --impl sdpa:cudnn
  fi
fi
if want peers; then  # its own folder ($OUT/peers: a device call returns files 2 folders down at most), since its
  # mosaic rows would repeat the D=128 ones of a merged attention table
  if [ "$DRY" = 1 ]; then PEERS=(--impl xla --impl flash --impl flex_attention); else
    PEERS=(--head-dim 128 --max-seq 4096 --impl pallas:mgpu --impl mosaic --impl flex_attention); fi
  step peers "$PY" -m benchmarks run "${QUICK[@]}" --no-report --out "$OUT/peers" --suite attention "${PEERS[@]}"
fi
if want order; then
  if [ -e "$RES/attention.json" ] && [ -e "$OUT/gpu_tests.log" ]; then
    step order "$PY" -m benchmarks.tools.default_order --tests "$OUT/gpu_tests.log" --attention "$RES/attention.json"
  else
    echo "order: needs gpu_tests.log and attention.json from this call's tests and attention steps; not run"
  fi
fi
if want masked; then
  if [ "$DRY" = 1 ]; then MASKED=(--seq 128 --window 16 --rounds 2); else
    MASKED=(--seq 2048,8192 --batch 2 --heads 16/4 --dim 128 --dtype bfloat16); fi
  step masked "$PY" -m benchmarks.tools.masked_attention "${MASKED[@]}" --out "$RES"
fi
if want ring; then
  if [ "$DRY" = 1 ]; then RING=(--preset tiny --window 8 --length 40 --batch 2 --rounds 2); else RING=(--batch 64); fi
  step ring "$PY" -m benchmarks.tools.ring_decode "${RING[@]}" --out "$RES"
fi
if want train; then
  if [ "$DRY" = 1 ]; then TOGGLES=(baseline bf16); else TOGGLES=(fused_loss fp16 bf16 tf32 remat_full); fi
  step train "${BENCH[@]}" --suite train "${TOGGLES[@]/#/--toggle=}" --budget-s $(($(budget train) - 30))
fi
if want decode; then
  if [ "$DRY" = 1 ]; then BATCHES=(4 1); else BATCHES=(64 1); fi  # the larger batch first: never reached before
  step decode "${BENCH[@]}" --suite decode --decode-impl jaxattn+flash_decode --decode-impl torchref+cudagraphs \
    "${BATCHES[@]/#/--batch=}" --budget-s $(($(budget decode) - 30))
fi
if want loops; then
  if [ "$DRY" = 1 ]; then LOOPS=(--preset tiny --new 8 --rounds 2); else LOOPS=(--preset 125m --new 32 --rounds 5); fi
  step loops "$PY" -m benchmarks.tools.generate_loop "${LOOPS[@]}" --out "$RES"
fi
if want blocks; then
  step blocks "$PY" -m benchmarks.tools.block_search --survivors benchmarks/results/h100-compiled/block_search.json \
    --kernel flash_bwd_dkv --d 128 --dtype bf16 --out "$RES"
fi
if want gqa; then
  step gqa "$PY" -m benchmarks.tools.block_search --survivors benchmarks/results/h100-compiled/block_search.json \
    --kernel flash_bwd_dkv --d 128 --dtype bf16 --kv-heads 4 --out "$RES"
fi
echo
echo "=== session summary (call ${CALL:-all}) ==="
printf '%s\n' "${SUMMARY[@]}"
ls -l "$RES"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "failed steps: ${FAILED[*]} (a budget's interrupt counts as a failure only in a --dry-run rehearsal)"
  exit 1
fi
