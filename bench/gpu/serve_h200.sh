#!/bin/bash
# H200: the GPU decode path. The GPU engine tests, then bench/serve_gpu.py at 1, 16, 64 and 128 streams
# (engine alone and through the HTTP API), d20 shape, bf16, random weights. (One decode step part by
# part: bench/gpu/decode_h200.sh.)
# Device call: carry [".whl"] (bench/gpu/h200_wheels.txt), command `bash bench/gpu/serve_h200.sh`.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
. bench/gpu/quiet.sh
python3 -m pytest -q -x -p no:warnings tests/test_engine_gpu.py 2>&1 | tail -3 | tee "$OUT/engine_gpu_tests.log"
python3 -m bench.serve_gpu --http --out "$OUT/serve_gpu.json" "$@" 2>&1 | quiet | tee "$OUT/serve_gpu.log"
