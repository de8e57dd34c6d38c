#!/bin/bash
# H200: the Triton cast-transpose kernel against torch (bit-exact; stops here if not), then the d20
# probe (200 steps) of bf16 and fp8 through the kernel, delayed and dynamic scaling.
#   bash bench/gpu/fp8_cast.sh [BACKEND...]
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
PYTHONPATH=$PWD python3 tests/test_fp8_cast.py 2>&1 | grep -v -i warn | tee $OUT/fp8_cast_test.log
grep -q bit-exact $OUT/fp8_cast_test.log || exit 1
timeout 555 python3 -m pipeline.probe --steps 200 --depth 20 --out $OUT/probe \
  --backends ${@:-bf16 "fp8:cast=kernel,scaling=delayed" "fp8:cast=kernel"} 2>&1 | grep -v -i warn | tee $OUT/probe.log
