#!/usr/bin/env bash
# Every multi-GPU FastLoRA check in one command, for a machine with 2 GPUs:
#
#     bash tests/distributed/run_gpu.sh OUTDIR
#
# Runs (each step under a time limit, continuing past failures; ~6 min when all pass, 8.3 min at most):
#   ddp            torchrun, 2 procs, nccl: DDP(find_unused_parameters=False) vs one process on the same global batch
#   fsdp2          torchrun, 2 procs, nccl: prepare_for_fsdp(fsdp_version=2) + fully_shard + save_adapter vs one
#                  process, bf16/fp16/uint8 storage; every scenario checks the all-gathered packed bytes (must not
#                  change), and the control fp16-st-mp-v1 (the pre-fix path) must show changed bytes
#   device_map     pytest (gpu): device_map="auto" + max_memory over 2 GPUs vs one GPU, kernels on each layer's device
#   trainer-ddp    accelerate launch (accelerate_ddp.yaml), HF Trainer, gradient checkpointing + modules_to_save
#   trainer-fsdp2  accelerate launch (accelerate_fsdp2.yaml), HF Trainer, bf16 storage
#   trainer-fsdp2-u8  the same with uint8 storage (bitsandbytes' default)
#   trainer-fsdp1  accelerate launch (accelerate_fsdp1.yaml), HF Trainer
# Writes OUTDIR/<step>.log, OUTDIR/results/*.json, OUTDIR/device_map.json and OUTDIR/SUMMARY.md.
# Exit code: 0 when every check passed, 1 otherwise.
set -u
OUT=${1:?usage: bash tests/distributed/run_gpu.sh OUTDIR}
mkdir -p "$OUT/results"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
BUDGET_S=${FASTLORA_GPU_BUDGET_S:-500}

# NVLink multicast stays off in every launched process.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d /tmp/fastlora-triton-XXXX)}  # shared: compile once
# FASTLORA_DIST_CPU=1 TRITON_INTERPRET=1 runs the torchrun steps on CPU (a smoke test of this script, not a result).
CPU_FLAG=()
if [[ ${FASTLORA_DIST_CPU:-0} == 1 ]]; then CPU_FLAG=(--cpu); else
    unset TRITON_INTERPRET PEFT_FASTLORA_FORCE_TRITON FASTLORA_DIST_CPU; fi

START=$(date +%s)
: > "$OUT/steps.tsv"

# step NAME LIMIT_S CMD...: runs CMD with at most LIMIT_S seconds (less if the total budget runs short).
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START)))
    if ((left < 30)); then
        printf '%s\tskipped\t0\t(budget spent)\n' "$name" >> "$OUT/steps.tsv"
        echo "== $name: skipped, budget spent"
        return
    fi
    ((limit > left - 10)) && limit=$((left - 10))
    echo "== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$name.log" >> "$OUT/steps.tsv"
    echo "   rc=$rc in $(($(date +%s) - t0))s"
}

step env 30 bash -c 'nvidia-smi -L; nvidia-smi topo -m; env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)_" | sort'
step versions 60 "$PY" -c "
import torch, transformers, peft, accelerate, bitsandbytes, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
for m in (transformers, peft, accelerate, bitsandbytes, triton):
    print(m.__name__, m.__version__)"
step model 60 "$PY" -c "
from pathlib import Path
from tests.utils import save_tiny_llama
save_tiny_llama(Path('$OUT/tiny-llama'))"
MODEL="$OUT/tiny-llama"
RES="$OUT/results"

step ddp 110 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.distributed.ddp_worker \
    --model "$MODEL" --out "$RES" --scenarios bf16,bf16-gc,bf16-gcr,bf16-mts,fp16,fp32-gc-mts
step fsdp2 130 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.distributed.fsdp_worker \
    --model "$MODEL" --out "$RES" --scenarios bf16-st-a32-mp-gc-mts,fp16-st-mp,bf16-mp-gc,bf16-st-leaf,fp16-st-mp-v1
step device_map 90 env FASTLORA_DIST_REPORT="$OUT/device_map.json" "$PY" -m pytest -p no:cacheprovider -q -rA \
    tests/distributed/test_device_map.py --junitxml "$OUT/device_map.xml"
step trainer-ddp 80 "$PY" -m accelerate.commands.launch --config_file tests/distributed/accelerate_ddp.yaml \
    --main_process_port 29531 -m tests.distributed.trainer_worker --model "$MODEL" --out "$RES" \
    --scenario bf16-gc-mts --tag ddp-bf16-gc-mts "${CPU_FLAG[@]}"
step trainer-fsdp2 80 "$PY" -m accelerate.commands.launch --config_file tests/distributed/accelerate_fsdp2.yaml \
    --main_process_port 29532 -m tests.distributed.trainer_worker --model "$MODEL" --out "$RES" \
    --scenario bf16-st-a32-gc-mts --tag fsdp2-bf16-st-a32-gc-mts
step trainer-fsdp2-u8 80 "$PY" -m accelerate.commands.launch --config_file tests/distributed/accelerate_fsdp2.yaml \
    --main_process_port 29534 -m tests.distributed.trainer_worker --model "$MODEL" --out "$RES" \
    --scenario bf16-gc-mts --tag fsdp2-bf16-gc-mts
step trainer-fsdp1 150 "$PY" -m accelerate.commands.launch --config_file tests/distributed/accelerate_fsdp1.yaml \
    --main_process_port 29533 -m tests.distributed.trainer_worker --model "$MODEL" --out "$RES" \
    --scenario bf16-st-a32-gc-mts --tag fsdp1-bf16-st-a32-gc-mts

rm -rf "$MODEL" "$RES"/trainer-*-ckpt
find "$RES" -name 'adapter_model.safetensors' -size +5M -delete  # keep OUTDIR small; tiny adapters stay
"$PY" -m tests.distributed.summarize "$OUT"
