#!/bin/bash
# H200: one decode step, part by part (bench/decode_step.py: the engine's captured step at 1, 16 and
# 128 rows, with the sampling or the attention left out, the whole forward compiled as one, the cache
# read by SDPA instead of FlexAttention, FlexAttention's own tiles or general kernel, plus the kernels of
# one replay), then the
# weight products and the cache attention alone against other kernels for the same work
# (bench/decode_kernels.py, an L2 prefetch of the next weights included).
# Device call: no carry needed, command `bash bench/gpu/decode_h200.sh` (about 5 minutes).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
. bench/gpu/quiet.sh
python3 -m bench.decode_kernels --out "$OUT/decode_kernels.json" 2>&1 | quiet | tee "$OUT/decode_kernels.log"
python3 -m bench.decode_step --rows 1,16,128 --out "$OUT/decode_step.json" 2>&1 | quiet | tee "$OUT/decode_step.log"
