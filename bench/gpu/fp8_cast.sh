#!/bin/bash
# fp8's Triton cast-transpose kernel: first the GPU test (bit-exact against torch for every FP8 code and
# midpoint, NaN, more than 2^31 elements, every tile shape; stops here if not), then its tile shapes and
# the op against a bf16 copy of the same tensor (bench/cast_kernel.py: median and range of 5 rounds).
#   bash bench/gpu/fp8_cast.sh          Environment: OUT (/tmp/sparkchat-bench/fp8_cast). A few minutes.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sparkchat-bench/fp8_cast}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 tests/test_fp8_cast.py 2>&1 | grep -v -i warn | tee "$OUT/fp8_cast_test.log"
grep -q bit-exact "$OUT/fp8_cast_test.log" || { echo "the GPU test did not pass: no timing"; exit 1; }
python3 -m bench.cast_kernel --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/cast_kernel.log"
