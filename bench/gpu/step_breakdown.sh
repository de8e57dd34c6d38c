#!/bin/bash
# H200: stage TE's last core part, then where the d20 micro-step's time goes: SDPA kernels alone, then
# bf16 / fp8 with the default and the cuDNN attention kernel, fp8 with fast accumulation everywhere.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p /root/stage && cp .gpu-stage/small/* .gpu-stage/core/tecore.part04 /root/stage/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout 530 python3 -m bench.train_step --depth 20 --batch 32 --out $OUT \
  --variants bf16 fp8 bf16@cudnn fp8@cudnn fp8:fast_accum=all@cudnn 2>&1 | tee $OUT/train_step.log
