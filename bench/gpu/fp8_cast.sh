#!/bin/bash
# H200: the Triton cast-transpose kernel against torch (bit-exact), then the d20 micro-step of bf16, fp8
# with the inline casts, fp8 through the kernel (and with the head converted), profiled by kernel.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 tests/test_fp8_cast.py 2>&1 | grep -v -i warn | tee $OUT/fp8_cast_test.log
timeout 540 python3 -m bench.train_step --depth 20 --batch 32 --no-attention --out $OUT \
  --variants ${@:-bf16 fp8:cast=kernel fp8:cast=inline "fp8:cast=kernel,skip="} 2>&1 | grep -v -i warn | tee $OUT/train_step.log
