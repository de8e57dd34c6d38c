#!/bin/bash
# The cost of sharding on one GPU at d20 (bench/fsdp.py): bf16 and fp8, each trained STEPS steps
# without a wrapper and under FSDP2 as `runtime.parallel: fsdp` runs it (loss after the steps compared,
# 0.5% allowed), then under DDP for speed only. Every mode is timed over the same steps (after 5 of
# warm-up, 40 steps in 4 rounds: median and range). 16 x 2048 tokens a step, synthetic Markov tokens,
# every block compiled on its own in every mode (FSDP needs that, so the ratio is the sharding alone;
# COMPILE=stage compiles none/ddp whole, as the training stage does). Needs torch, Triton, pyyaml.
#   bash bench/gpu/fsdp.sh        About 7 minutes on an H200.
# Environment: STEPS (200), BATCH (16), BACKENDS ("bf16 fp8"), MODES ("none fsdp ddp": in that order,
# each over every backend), COMPILE (regional | stage), OUT (/tmp/sparkchat-bench/fsdp). fsdp.json is
# rewritten after every run, so a run cut short keeps those that finished.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/sparkchat-bench/fsdp}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -m bench.fsdp --depth 20 --seq-len 2048 --vocab 65536 --batch "${BATCH:-16}" --steps "${STEPS:-200}" \
  --backends ${BACKENDS:-bf16 fp8} --modes ${MODES:-none fsdp ddp} --compile "${COMPILE:-regional}" --out "$OUT" \
  2>&1 | grep -v -i warn | tee "$OUT/fsdp.log"
