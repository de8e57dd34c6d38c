#!/bin/bash
# H200: the Triton cast-transpose kernel against torch (bit-exact, plain and with the fused squared
# ReLU; stops here if not), its tile shapes against a bf16 copy, then the d20 probe (200 steps)
# in what is left of a 600 s call.
#   bash bench/gpu/fp8_cast.sh [BACKEND...]   (default: bf16, fp8 (dynamic, power-of-two scales), fp8 delayed)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 tests/test_fp8_cast.py 2>&1 | grep -v -i warn | tee $OUT/fp8_cast_test.log
grep -q bit-exact $OUT/fp8_cast_test.log || exit 1
python3 -m bench.cast_kernel --out $OUT 2>&1 | grep -v -i warn | tee $OUT/cast_kernel.log
timeout $((575 - SECONDS)) python3 -m pipeline.probe --steps 200 --depth 20 --seq-len 2048 --batch 32 --vocab 65536 --out $OUT/probe \
  --backends ${@:-bf16 fp8 "fp8:scaling=delayed"} 2>&1 | grep -v -i warn | tee $OUT/probe.log
