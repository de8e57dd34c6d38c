#!/bin/bash
# H200, d20: the micro-step under the two attention layouts (model's heads-first RoPE/QK-norm against
# `@bthd`, heads-last) and fp8's two scalings, plus fp8 delayed with attn.c_proj left in bf16.
#   bash bench/gpu/layout_and_scaling.sh
# Ran at commit b87e03e (results: bench/results/h200-d20-2026-12-03b). Heads-last then became the model's
# layout and the `@bthd` modifier was removed (train_step now refuses it), so this script is only the record
# of that run.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout 560 python3 -m bench.train_step --depth 20 --batch 32 --no-attention --out $OUT \
  --variants bf16 bf16@bthd fp8 fp8:scaling=delayed fp8:scaling=delayed@bthd \
  "fp8:scaling=delayed,skip=lm_head+attn.c_proj@bthd" 2>&1 | grep -v -i warn | tee $OUT/train_step.log
