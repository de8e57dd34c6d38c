#!/bin/bash
# H200: the GPU decode path. The GPU engine tests, then bench/serve_gpu.py at 1, 16, 64 and 128 streams
# (engine alone and through the HTTP API), d20 shape, bf16, random weights.
# Device call: carry [".whl"] (bench/gpu/h200_wheels.txt), command `bash bench/gpu/serve_h200.sh`.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -x tests/test_engine_gpu.py 2>&1 | tail -3
python3 -m bench.serve_gpu --http --out "${OUT:-/tmp}/serve_gpu.json" "$@" 2>&1 | grep -v Warn | tee "${OUT:-/tmp}/serve_gpu.log"
