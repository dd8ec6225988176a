#!/usr/bin/env bash
# The one command for the GPU box: runs bench_layers, then bench_train_step, into OUT_DIR.
#
#   bash benchmarks/run_gpu.sh OUT_DIR [all|layers|train] [-- extra args passed to both scripts]
#
# Each step runs under `timeout` (SIGTERM: the script then writes tables/targets/plots of what it measured; SIGKILL
# 30 s later) and gets a soft budget (--budget-s) a bit shorter, after which it records the remaining work as
# skipped. A step that fails or times out does not stop the next one. Logs: OUT_DIR/<step>.log (also on stdout).
# Defaults fit one 10-minute command for `all` (210 s + 330 s); a single step gets 540 s. Override with
# LAYERS_TIMEOUT=... TRAIN_TIMEOUT=... (seconds), the interpreter with PYTHON=...; TRAIN_PROFILE= skips profiling.
set -u -o pipefail

OUT="${1:-benchmarks/results}"
WHAT="${2:-all}"
shift $(( $# >= 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"

case "$WHAT" in
  all)    LAYERS_TIMEOUT="${LAYERS_TIMEOUT:-210}"; TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-330}" ;;
  layers) LAYERS_TIMEOUT="${LAYERS_TIMEOUT:-540}"; TRAIN_TIMEOUT=0 ;;
  train)  LAYERS_TIMEOUT=0; TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-540}" ;;
  *) echo "usage: $0 OUT_DIR [all|layers|train] [-- extra args]" >&2; exit 2 ;;
esac

{
  echo "# date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "# command: $0 $OUT $WHAT ${EXTRA[*]:-}"
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

# run_step NAME TIMEOUT_S SCRIPT ARGS...: never fails, so the next step always runs.
run_step() {
  local name="$1" limit="$2" script="$3"; shift 3
  local budget=$(( limit * 85 / 100 - 20 ))
  local start=$SECONDS
  echo "=== [$name] $(date -u +%H:%M:%S) timeout ${limit}s, budget ${budget}s: $PY $script $*" | tee "$OUT/$name.log"
  timeout --signal=TERM --kill-after=30 "$limit" "$PY" "$script" --out "$OUT" --budget-s "$budget" "$@" 2>&1 \
    | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo; echo "=== [$name] exit code $rc after $(( SECONDS - start ))s" | tee -a "$OUT/$name.log"
  if [ "$rc" -eq 124 ]; then
    echo "=== [$name] timed out; it wrote tables/targets/plots of the rows it measured" | tee -a "$OUT/$name.log"
  elif [ "$rc" -eq 137 ]; then
    echo "=== [$name] killed: the CSVs hold every row measured; redoing tables/targets/plots" | tee -a "$OUT/$name.log"
    timeout 60 "$PY" "$script" --out "$OUT" --replot 2>&1 | tee -a "$OUT/$name.replot.log" || true
  fi
  return 0
}

if [ "$LAYERS_TIMEOUT" -gt 0 ]; then
  run_step layers "$LAYERS_TIMEOUT" benchmarks/bench_layers.py "${EXTRA[@]}"
fi
if [ "$TRAIN_TIMEOUT" -gt 0 ]; then
  PROFILE="${TRAIN_PROFILE-fastlora-nf4,fastlora-int8}"  # TRAIN_PROFILE= (empty) skips the torch.profiler runs
  run_step train_step "$TRAIN_TIMEOUT" benchmarks/bench_train_step.py ${PROFILE:+--profile "$PROFILE"} "${EXTRA[@]}"
fi
echo "=== done; results in $OUT:"
ls -la "$OUT"
