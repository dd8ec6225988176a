#!/usr/bin/env bash
# Kernel tuning and host-overhead measurements in one GPU command (issue #3 / #6), each step under a time limit:
#
#     bash benchmarks/run_tuning_gpu.sh OUT_DIR
#
#   tests   pytest -m gpu on the kernels this touches (fused small-M, dispatch, tuning tables)
#   host    benchmarks/host_overhead.py: host time per layer call, FastLoRA vs PEFT (decode and batch-1 training)
#   tune    benchmarks/tune_small_m.py: small-M tilings + crossover per shape -> OUT_DIR/tune/small_m_configs.json
# Limits (seconds) from TESTS_S, HOST_S, TUNE_S; logs in OUT_DIR/<step>.log. A failing step does not stop
# the next one.
set -u
OUT=${1:?usage: bash benchmarks/run_tuning_gpu.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python}

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   rc=$? in $(($(date +%s) - t0))s"
    tail -n 3 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step tests "${TESTS_S:-110}" "$PY" -m pytest -m gpu -q -x -p no:cacheprovider tests/ops/test_fused_small_m.py \
    tests/ops/test_tuned.py tests/ops/test_ops_dispatch.py
step host "${HOST_S:-60}" "$PY" benchmarks/host_overhead.py --out "$OUT/host"
step tune "${TUNE_S:-230}" "$PY" benchmarks/tune_small_m.py --out "$OUT/tune" --time-budget "$((${TUNE_S:-230} - 15))"
