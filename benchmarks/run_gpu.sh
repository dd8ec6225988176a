#!/usr/bin/env bash
# Runs the benchmarks on this machine's GPU, one step after the other, into OUT_DIR (default benchmarks/results):
#
#   bash benchmarks/run_gpu.sh [OUT_DIR] [STEP ...]
#
# Steps (default: layers train host):
#   layers  benchmarks/bench_layers.py     one LoRA layer: training fwd+bwd, decode, dequantization
#   train   benchmarks/bench_train_step.py training steps and generation of a Llama-3-8B-shaped model
#   host    benchmarks/host_overhead.py    host (CPU) time per layer call
#   tune    benchmarks/tune_small_m.py     small-M tilings and crossovers of this GPU -> OUT_DIR/tune/
# Extra arguments per step: LAYERS_ARGS, TRAIN_ARGS, HOST_ARGS, TUNE_ARGS (e.g. TRAIN_ARGS="--steps 20").
# PYTHON picks the interpreter. A step that fails does not stop the next one; the exit code is the number of failed
# steps. Logs: OUT_DIR/<step>.log (also on stdout); OUT_DIR/env.txt records the GPU, driver and versions.
set -u -o pipefail

OUT="${1:-benchmarks/results}"
[ $# -gt 0 ] && shift
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(layers train host)

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's package, even where another is installed
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"

for step in "${STEPS[@]}"; do
  case "$step" in
    layers|train|host|tune) ;;
    *) echo "usage: $0 [OUT_DIR] [layers|train|host|tune ...]; unknown step '$step'" >&2; exit 2 ;;
  esac
done

{
  echo "# date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "# command: $0 $OUT ${STEPS[*]}"
  echo "# git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no commit')"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  "$PY" - <<'PYEOF' 2>&1 || true
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "peft", "bitsandbytes", "accelerate", "matplotlib", "tqdm"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
PYEOF
} > "$OUT/env.txt"
cat "$OUT/env.txt"

failed=0
# run_step NAME COMMAND...: logs to OUT/NAME.log; never stops the loop.
run_step() {
  local name="$1"; shift
  local start=$SECONDS
  echo "=== [$name] $(date -u +%H:%M:%S): $*" | tee "$OUT/$name.log"
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== [$name] exit code $rc after $(( SECONDS - start )) s" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed=$(( failed + 1 ))
}

for step in "${STEPS[@]}"; do
  case "$step" in
    # shellcheck disable=SC2086  # *_ARGS are word-split on purpose
    layers) run_step layers "$PY" benchmarks/bench_layers.py --out "$OUT" ${LAYERS_ARGS:-} ;;
    train)  run_step train_step "$PY" benchmarks/bench_train_step.py --out "$OUT" ${TRAIN_ARGS:-} ;;
    host)   run_step host "$PY" benchmarks/host_overhead.py --out "$OUT" ${HOST_ARGS:-} ;;
    tune)   run_step tune "$PY" benchmarks/tune_small_m.py --out "$OUT/tune" ${TUNE_ARGS:-} ;;
  esac
done
echo "=== done ($failed failed); results in $OUT:"
ls -la "$OUT"
exit "$failed"
